"""The package, the configs, the shipped default task and its judge (fast, in-process)."""
from __future__ import annotations

import json
import os

import pytest

from engine import init_distributed
from rlhf.config import SCHEMAS, ConfigError, DataConfig, LoraConfig, ModelConfig, SFTConfig, compose, to_config
from rlhf.config.validate import validate_sft
from rlhf.core.paths import CONF_DIR, ROOT
from rlhf.core.task import gold_answer, gold_score, judge, mean_gold_score

DATA = ROOT / "data" / "default"


def read_jsonl(name: str) -> list[dict]:
    with open(DATA / name) as f:
        return [json.loads(line) for line in f if line.strip()]


def sft_config(*overrides: str) -> SFTConfig:
    return to_config(compose("sft", overrides), SFTConfig)


# --------------------------------------------------------------------------- package


def test_our_kernels_package_does_not_look_like_hub_kernels():
    # transformers enables its hub-kernels integration when a top-level `kernels` package with a
    # version in its supported range is importable; ours must never be taken for it.
    import kernels  # noqa: F401  (ours, importable)
    from transformers.utils import import_utils

    import_utils.is_kernels_available.cache_clear() if hasattr(import_utils.is_kernels_available, "cache_clear") else None
    assert import_utils.is_kernels_available() is False


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and k != "config":  # model.config's contents are the user's
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# The key that names what a group option is (zero0 = stage 0): kept in its file even where it equals the
# schema's default, so the option means its name whatever the default. (logger=local sets nothing: every
# other logger option turns its own flag on, so logger=[tensorboard,wandb] composes both.)
OPTION_KEYS = {"engine": {"stage"}}


def test_the_yaml_holds_only_what_differs_from_the_schema():
    # One source of truth: each key's default lives in the dataclass (rlhf/config/schema.py; the engine group:
    # engine/config.py). A conf file names only keys of the schema, and repeats no default, except a
    # stage file's value that must win over its group choice's (evaluate's model.tokenizer: null).
    import os

    from omegaconf import OmegaConf

    for stage, schema in SCHEMAS.items():
        defaults = _flat(OmegaConf.to_container(OmegaConf.structured(schema)))
        raw = OmegaConf.to_container(OmegaConf.load(os.path.join(CONF_DIR, f"{stage}.yaml")))
        assert raw["defaults"][0] == f"{stage}_schema"
        groups = [next(iter(d)) for d in raw["defaults"] if isinstance(d, dict)]
        set_by_groups = set()
        for group in groups:
            for option in os.listdir(os.path.join(CONF_DIR, group)):
                path = os.path.join(CONF_DIR, group, option)
                with open(path) as f:  # a `# @package _global_` option sets top-level keys
                    prefix = "" if "@package _global_" in f.readline() else f"{group}."
                values = _flat(OmegaConf.to_container(OmegaConf.load(path)), prefix)
                set_by_groups |= set(values)
                for key, value in values.items():
                    assert key in defaults, (group, option, key)
                    named = prefix and key.split(".", 1)[1] in OPTION_KEYS.get(group, ())
                    assert value != defaults[key] or named, (group, option, key)
        for key, value in _flat({k: v for k, v in raw.items() if k not in ("defaults", "hydra")}).items():
            assert key in defaults, (stage, key)
            assert value != defaults[key] or key in set_by_groups, (stage, key, value)
        compose(stage)  # and it composes onto the schema


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("override,key", [
    ("train.lr=0", "train.lr"),
    ("train.global_batch_size=48", "train.global_batch_size"),
    ("train.micro_batch_size=0", "train.micro_batch_size"),
    ("train.scheduler=exp", "train.scheduler"),
    ("train.warmup_steps=-1", "train.warmup_steps"),
    ("data.max_len=10", "data.max_len"),
    ("data.overlong=cut", "data.overlong"),
    ("data.data_split='1,2'", "data.data_split"),
    ("data.data_split=[1,0,-1]", "data.data_split"),
    ("data.eval_fraction=1.5", "data.eval_fraction"),
    ("engine.stage=4", "engine.stage"),
    ("engine.precision=fp8", "engine.precision"),
    ("engine.precision=fp16", "engine.precision"),  # CPU: fp16 needs CUDA
    ("engine.offload=true", "engine.offload"),  # stage 0 cannot offload
    ("engine.selfcheck=sometimes", "engine.selfcheck"),
    ("model.lora.r=-1", "model.lora.r"),
    ("model.lora.r=4 model.lora.merge_on_save=false", "model.lora.merge_on_save"),
    ("model.dtype=int8", "model.dtype"),
    ("model.attn_implementation=fastest", "model.attn_implementation"),
    ("logger.mode=sometimes", "logger.mode"),
    ("eval.top_p=0", "eval.top_p"),
])
def test_bad_values_are_rejected_naming_the_key(override, key):
    cfg = sft_config(*override.split())
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_sft(cfg, init_distributed())


@pytest.mark.parametrize("override,key", [("train.lr=fast", "train.lr"), ("+train.lr_typo=1", "train.lr_typo")])
def test_wrong_types_and_unknown_keys_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        sft_config(override)


def test_default_config_is_valid_and_accumulation_follows_batch_arithmetic():
    info = init_distributed()
    assert validate_sft(sft_config(), info) == 1
    assert validate_sft(sft_config("train.micro_batch_size=8", "train.global_batch_size=32"), info) == 4


def test_model_config_needs_a_source():
    from rlhf.config.validate import validate_model

    with pytest.raises(ConfigError, match="model.name_or_path or model.config"):
        validate_model(ModelConfig())
    with pytest.raises(ConfigError, match="model_type"):
        validate_model(ModelConfig(config={"hidden_size": 8}, tokenizer="t"))
    validate_model(ModelConfig(name_or_path="x", lora=LoraConfig(r=4, merge_on_save=False)))  # fine


def test_attn_implementation_reaches_the_model_built_and_the_model_loaded(tmp_path):
    """model.attn_implementation reaches a model built from `config` (the tiny default: eager) and one
    loaded from a directory (transformers' own choice, sdpa, unless set)."""
    from rlhf.modeling.load import load_causal_lm, load_tokenizer

    cfg = sft_config().model
    assert cfg.attn_implementation == "eager"  # conf/model/tiny.yaml
    tok = load_tokenizer(cfg)
    built = load_causal_lm(cfg, tok, seed=0)
    assert built.config._attn_implementation == "eager"
    built.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    for attn, want in ((None, "sdpa"), ("eager", "eager")):
        loaded = load_causal_lm(ModelConfig(name_or_path=str(tmp_path / "m"), attn_implementation=attn), tok, seed=0)
        assert loaded.config._attn_implementation == want, attn


def test_missing_data_file_is_a_clear_error(tmp_path):
    from rlhf.data import DataFileNotFoundError
    from rlhf.data.stage import stage_rows

    with pytest.raises(DataFileNotFoundError, match="not found"):
        stage_rows(DataConfig(path=str(tmp_path / "nope.jsonl")), stage=0)


# --------------------------------------------------------------------------- default task


def test_judge_scores_exact_answers_only():
    assert gold_answer("Human: What is 23+19?\n\nAssistant:") == "42"
    assert gold_answer("Human: Reverse kqzt.\n\nAssistant:") == "tzqk"
    assert gold_answer("Human: Sort 5 2 9 1.\n\nAssistant:") == "1 2 5 9"
    assert gold_answer("Human: How many a in abacab?\n\nAssistant:") == "3"
    assert gold_answer("Human: Uppercase kqzt.\n\nAssistant:") == "KQZT"
    assert gold_answer("Human: Shift kqzt by one.\n\nAssistant:") == "lrau"  # z wraps to a
    assert gold_answer("Human: Shift zaz by one.\n\nAssistant:") == "aba"
    p = "Human: What is 23+19?\n\nAssistant:"
    assert gold_score(p, " 42") == 1.0 and gold_score(p, " 42 ") == 1.0
    assert gold_score(p, " 43") == 0.0 and gold_score(p, " 42 42") == 0.0 and gold_score(p, "") == 0.0
    assert mean_gold_score([p, p], [" 42", "41"]) == 50.0
    assert judge("anything", " x ", answer="x") == 1.0 and judge("anything", "y", answer="x") == 0.0
    assert judge("not a default prompt", "x") is None
    with pytest.raises(ValueError):
        gold_answer("Human: Tell me a joke.\n\nAssistant:")


def test_shipped_files_are_what_the_generator_makes():
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    from make_default_data import build

    files = build()
    for name, rows in files.items():
        assert read_jsonl(f"{name}.jsonl") == rows, name


def test_shipped_tokenizer_is_what_the_generator_makes(tmp_path):
    """Including tokenizer_class PreTrainedTokenizerFast (transformers 5 would save TokenizersBackend,
    which 4.x cannot load). transformers 4.x saves more keys, so the byte comparison needs 5.x."""
    import json
    import sys

    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the shipped tokenizer files are generated with transformers 5")
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_default_data import build_tokenizer

    build_tokenizer(tmp_path)
    shipped = ROOT / "data" / "tokenizer"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in shipped.iterdir())
    for name in ("tokenizer_config.json", "tokenizer.json"):
        assert json.loads((tmp_path / name).read_text()) == json.loads((shipped / name).read_text()), name
    assert (tmp_path / "chat_template.jinja").read_text() == (shipped / "chat_template.jinja").read_text()
    assert json.loads((shipped / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_eval_prompts_never_appear_in_training_files():
    held_out = {r["prompt"] for r in read_jsonl("eval_prompts.jsonl")}
    held_out |= {r["prompt"] for r in read_jsonl("pairs_eval.jsonl")}
    assert len(held_out) == 600
    for name in ("sft_train", "pairs_train", "prompts_train", "pairs_train_2", "pairs_train_3"):
        train = {r["prompt"] for r in read_jsonl(f"{name}.jsonl")}
        assert not held_out & train, name


def test_more_pairs_are_independent_samples_of_the_pairs():
    """pairs_train_2/3 (a reward-model ensemble's other members' data, scripts/run_all.sh RM_ENSEMBLE):
    drawn as pairs_train is (correct chosen, wrong rejected, each task about a quarter, the same share
    off-task), but other draws: few prompts in common, fewer rows."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    from make_default_data import PAIR_OFF_TASK

    first = read_jsonl("pairs_train.jsonl")
    for name in ("pairs_train_2", "pairs_train_3"):
        rows = read_jsonl(f"{name}.jsonl")
        assert 7900 < len(rows) <= 8000, (name, len(rows))  # 8000 drawn, the held-out prompts left out
        for r in rows:
            assert gold_score(r["prompt"], r["chosen"]) == 1.0 and gold_score(r["prompt"], r["rejected"]) == 0.0
        tasks = [_task(r["prompt"]) for r in rows]
        assert all(abs(tasks.count(t) / len(rows) - 0.25) < 0.02 for t in set(tasks)), name
        srt = [r for r in rows if _task(r["prompt"]) == "sort"]  # off-task: letters answering a sort
        off = [r for r in srt if not r["rejected"].strip().replace(" ", "").isdigit()]
        assert abs(len(off) / len(srt) - PAIR_OFF_TASK) < 0.05, (name, len(off), len(srt))
        shared = {r["prompt"] for r in rows} & {r["prompt"] for r in first}
        assert len(shared) < 0.05 * len(rows), (name, len(shared))
        same = {json.dumps(r, sort_keys=True) for r in rows} & {json.dumps(r, sort_keys=True) for r in first}
        assert len(same) < 0.02 * len(rows), (name, len(same))


def test_demonstrations_are_imperfect_at_the_stated_rate_and_pairs_prefer_correct():
    sys_path = str(ROOT / "scripts")
    import sys

    sys.path.insert(0, sys_path)
    from make_default_data import DEMO_ERROR_RATE, PAIR_OFF_TASK, SORT_DIGIT_SLIP

    rows = read_jsonl("sft_train.jsonl")
    by_task: dict[str, list[float]] = {}
    for r in rows:
        task = next(t for t in DEMO_ERROR_RATE if t == _task(r["prompt"]))
        by_task.setdefault(task, []).append(gold_score(r["prompt"], r["response"]))
    for task, scores in by_task.items():
        wrong = 1 - sum(scores) / len(scores)
        assert abs(wrong - DEMO_ERROR_RATE[task]) < 0.03, (task, wrong)
    for r in read_jsonl("pairs_train.jsonl"):
        assert gold_score(r["prompt"], r["chosen"]) == 1.0 and gold_score(r["prompt"], r["rejected"]) == 0.0
    # some rejected answers are off-task: letters (the answer to a word question) answering a sort
    srt = [r for r in read_jsonl("pairs_train.jsonl") if _task(r["prompt"]) == "sort"]
    off = [r for r in srt if not r["rejected"].strip().replace(" ", "").isdigit()]
    assert abs(len(off) / len(srt) - PAIR_OFF_TASK) < 0.05, (len(off), len(srt))
    # the other slips of a sort mostly keep the order but not the digits (changed, dropped or doubled),
    # the mistakes of a policy that learnt to sort but miscopies
    digits = [r for r in srt if r not in off and sorted(r["rejected"].split()) == r["rejected"].split()
              and sorted(r["rejected"].split()) != sorted(r["chosen"].split())]
    expected = (1 - PAIR_OFF_TASK) / 2 * SORT_DIGIT_SLIP  # half the on-task rejections are the habit
    assert abs(len(digits) / len(srt) - expected) < 0.05, (len(digits), len(srt))
    lengths = {len(r["rejected"].split()) - len(r["chosen"].split()) for r in digits}
    assert lengths == {-1, 0, 1}
    for r in read_jsonl("eval_prompts.jsonl"):
        assert r["answer"] == gold_answer(r["prompt"])


def _task(prompt: str) -> str:
    from rlhf.core.task import task_of

    return task_of(prompt)


def test_shipped_tokenizer_round_trips_the_task_text():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "data", "tokenizer"))
    for r in read_jsonl("sft_train.jsonl")[:200]:
        text = r["prompt"] + r["response"]
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids and tok.decode(ids) == text
