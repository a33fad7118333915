"""Bad input through the command line: every case exits with code 2, prints no traceback, and its
message names the key (config) or the file and line (data). Nothing is written to output_dir."""
from __future__ import annotations

import json

import pytest

from conftest import SMALL_MODEL, run_stage

# (stage, overrides, what the message must name)
CONFIG_CASES = [
    ("sft", ["train.micro_batch_size=0"], "train.micro_batch_size"),
    ("sft", ["train.micro_batch_size=-4"], "train.micro_batch_size"),
    ("sft", ["train.global_batch_size=0"], "train.global_batch_size"),
    ("sft", ["train.global_batch_size=48"], "train.global_batch_size"),
    ("sft", ["seed=-1"], "seed must be >= 0"),
    ("sft", ["train.max_consecutive_skips=0"], "train.max_consecutive_skips"),
    ("sft", ["train.eps=0"], "train.eps"),
    ("sft", ["train.lr=nan"], "train.lr"),
    ("sft", ["train.lr=inf"], "train.lr"),
    ("sft", ["train.lr=-1e-3"], "train.lr"),
    ("sft", ["train.betas=[0.9,1.5]"], "train.betas"),
    ("sft", ["train.scheduler=step"], "train.scheduler"),
    ("sft", ["train.epochs=0"], "train.epochs"),
    ("sft", ["train.log_every=0"], "train.log_every"),
    ("sft", ["data.max_len=10", "data.max_prompt_len=20"], "data.max_len"),
    ("sft", ["data.overlong=chop"], "data.overlong"),
    ("sft", ["data.eval_fraction=1.5"], "data.eval_fraction"),
    ("sft", ["engine.precision=fp8"], "engine.precision"),
    ("sft", ["engine=zero9"], "engine"),
    ("sft", ["engine.timeout_s=0"], "engine.timeout_s"),
    ("sft", ["train.lrr=1"], "train.lr"),
    ("sft", ["train.lr=fast"], "train.lr"),
    ("sft", ["model.lora.r=-1"], "model.lora.r"),
    ("sft", ["eval.temperature=0"], "eval.temperature"),
    ("sft", [*SMALL_MODEL, "data.max_len=4096"], "data.max_len (4096) exceeds the model's context"),
    ("reward", ["train.micro_batch_size=-1"], "train.micro_batch_size"),
    ("reward", ["reward.score_reg=-1"], "reward.score_reg"),
    ("reward", ["reward.head_init_std=-0.02"], "reward.head_init_std must be >= 0"),
    ("reward", ["reward.head_only_fraction=1.0"], "reward.head_only_fraction must be in [0, 1)"),
    ("reward", ["seed=-3"], "seed must be >= 0"),
    ("dpo", ["dpo.loss_type=orpo"], "dpo.loss_type"),
    ("dpo", ["dpo.loss_type=kto", "dpo.desirable_weight=0"], "dpo.desirable_weight must be a finite number > 0"),
    ("dpo", ["dpo.loss_type=kto", "dpo.undesirable_weight=inf"], "dpo.undesirable_weight must be a finite number > 0"),
    ("dpo", ["dpo.undesirable_weight=2"], "dpo.undesirable_weight applies to dpo.loss_type=kto"),
    ("dpo", ["dpo.beta=0"], "dpo.beta"),
    ("dpo", ["dpo.label_smoothing=0.5"], "dpo.label_smoothing"),
    ("dpo", ["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"], "dpo.label_smoothing applies to"),
    ("dpo", ["dpo.gamma=0.5"], "dpo.gamma applies to"),
    ("dpo", ["dpo.sft_coef=-1"], "dpo.sft_coef"),
    ("dpo", ["dpo.reference=lazy"], "dpo.reference"),
    ("dpo", ["train.global_batch_size=48"], "train.global_batch_size"),
    ("ppo", ["rollout.prompts_per_step=48"], "rollout.prompts_per_step"),
    ("ppo", ["rollout.prompts_per_step=0"], "rollout.prompts_per_step"),
    ("ppo", ["rollout.mini_batch_size=0"], "rollout.mini_batch_size"),
    ("ppo", ["rollout.micro_batch_size=0"], "rollout.micro_batch_size"),
    ("ppo", ["rollout.mini_batch_size=24"], "rollout.mini_batch_size"),
    ("ppo", ["seed=-5"], "seed must be >= 0"),
    ("ppo", ["train.max_consecutive_skips=0"], "train.max_consecutive_skips"),
    ("ppo", ["actor.eps=0"], "actor.eps"),
    ("ppo", ["critic.lr=nan"], "critic.lr"),
    ("ppo", ["ppo.kl_coef=-0.1"], "ppo.kl_coef"),
    ("ppo", ["ppo.kl_estimator=k9"], "ppo.kl_estimator"),
    ("ppo", ["ppo.advantage_estimator=magic"], "ppo.advantage_estimator"),
    ("ppo", ["ppo.gamma=1.5"], "ppo.gamma"),
    ("ppo", ["ppo.ema_decay=1"], "ppo.ema_decay"),
    ("ppo", ["rollout.top_p=0"], "rollout.top_p"),
    ("ppo", ["critic.lora.alpha=8"], "model.lora.alpha"),
    ("ppo", ["reward.sources=[modle]"], "reward.sources: unknown source 'modle'"),
    ("ppo", ["reward.sources=[judge,judge]"], "reward.sources names a source twice"),
    ("ppo", ["reward.sources=[judge,model]", "reward.weights=[1]"], "reward.weights has 1 weights for 2"),
    ("ppo", ["reward.sources=[function]"], "reward.function must be 'module:function'"),
    ("ppo", ["reward.sources=[function]", "reward.function=no_such_module_xyz:score"], "reward.function="),
    ("ppo", ["reward.sources=[function]", "reward.function=os:sep"], "reward.function='os:sep': 'sep' is a str"),
    ("ppo", ["reward.function=os.path:join"], "'function' is not in reward.sources"),
    ("ppo", ["reward.weights=[nan]"], "reward.weights must be finite"),
    ("ppo", ["alarms.window=1"], "alarms.window"),
    ("ppo", ["alarms.entropy_ratio=2"], "alarms.entropy_ratio"),
    ("ppo", ["alarms.gold_drop=-1"], "alarms.gold_drop"),
    ("ppo", ["alarms.kl_slope=fast"], "alarms.kl_slope"),
]


@pytest.mark.parametrize("stage,overrides,named", CONFIG_CASES, ids=[" ".join(c[1][-1:]) + f" ({c[0]})" for c in CONFIG_CASES])
def test_bad_config_value_exits_2_naming_the_key(stage, overrides, named, tmp_path):
    # PPO's and DPO's model paths must exist before its values are checked (a typo'd path is its own error)
    models = {"ppo": [f"actor.model={tmp_path}", f"critic.model={tmp_path}"], "dpo": ["model.name_or_path=null"],
              "reward": ["model.fallback_to_config=true"]}.get(stage, [])
    proc = run_stage(stage, f"output_dir={tmp_path / 'o'}", *models, *overrides, check=False, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert named in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def _write(path, text: bytes | str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


SFT_ROW = '{"prompt": "Human: Reverse ab.\\n\\nAssistant:", "response": " ba"}\n'
PAIR_ROW = '{"prompt": "Human: Reverse ab.\\n\\nAssistant:", "chosen": " ba", "rejected": " ab"}\n'

# (stage, file name, contents, what the message must say, line named?)
DATA_CASES = [
    ("sft", "nonutf8.jsonl", SFT_ROW.encode() + b'{"prompt": "\xff\xfe", "response": " x"}\n', "not UTF-8", 2),
    ("sft", "badjson.jsonl", SFT_ROW + '{"prompt": "a", "response": \n', "invalid JSON", 2),
    ("sft", "array.jsonl", SFT_ROW + '["a", "b"]\n', "expected a JSON object", 2),
    ("sft", "missing.jsonl", SFT_ROW + '{"prompt": "a"}\n', "'response'", 2),
    ("sft", "emptyprompt.jsonl", '{"prompt": "", "response": " b"}\n', "field 'prompt' is empty", 1),
    ("sft", "emptyresponse.jsonl", '{"prompt": "a", "response": "  "}\n', "field 'response' is empty", 1),
    ("sft", "notstring.jsonl", '{"prompt": 3, "response": " b"}\n', "must be a string", 1),
    ("sft", "role.jsonl", '{"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n',
     "role 'wizard'", 1),
    ("sft", "lastrole.jsonl", '{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "yo"}]}\n',
     "expected 'assistant'", 1),
    ("sft", "corrupt.parquet", b"PAR1 this is not parquet", "not a readable parquet file", None),
    ("sft", "unsupported.csv", "prompt,response\na,b\n", "unsupported file type", None),
    ("sft", "nonutf8.json", b'[{"prompt": "\xff", "response": "b"}]', "not UTF-8", None),
    ("reward", "emptychosen.jsonl", '{"prompt": "a", "chosen": "", "rejected": " b"}\n', "field 'chosen' is empty", 1),
    ("reward", "hh.jsonl", '{"chosen": "Human: a\\n\\nAssistant: b", "rejected": "Human: c\\n\\nAssistant: d"}\n',
     "must share the prompt", 1),
    ("reward", "nonutf8.jsonl", PAIR_ROW.encode() + b'{"prompt": "\xc3\x28", "chosen": "a", "rejected": "b"}\n',
     "not UTF-8", 2),
    ("dpo", "emptyrejected.jsonl", PAIR_ROW + '{"prompt": "a", "chosen": " b", "rejected": ""}\n', "field 'rejected' is empty", 2),
]


@pytest.mark.parametrize("stage,name,contents,says,line", DATA_CASES, ids=[c[1] + f" ({c[0]})" for c in DATA_CASES])
def test_bad_data_file_exits_2_naming_file_and_line(stage, name, contents, says, line, tmp_path):
    path = _write(tmp_path / "data" / name, contents)
    extra = {"reward": ["model.fallback_to_config=true"], "dpo": ["model.name_or_path=null"]}.get(stage, [])
    proc = run_stage(stage, f"output_dir={tmp_path / 'o'}", f"data.path={path}", *extra, check=False, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert says in proc.stderr, proc.stderr[-3000:]
    assert (f"{path}:{line}" if line else path) in proc.stderr, proc.stderr[-3000:]


def test_a_directory_of_mixed_formats_is_refused_not_half_read(tmp_path):
    d = tmp_path / "mixed"
    _write(d / "a.jsonl", SFT_ROW * 4)
    _write(d / "b.json", json.dumps([json.loads(SFT_ROW)] * 4))
    proc = run_stage("sft", f"output_dir={tmp_path / 'o'}", f"data.path={d}", check=False, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"{d}: a directory of mixed formats (.json, .jsonl)" in proc.stderr


def test_a_cut_last_line_of_metrics_jsonl_is_not_a_record(tmp_path):
    from rlhf.run.runlog import read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "kind": "train", "loss": 1.0}\n{"step": 2, "kind": "tr')
    assert read_metrics(str(tmp_path)) == [{"step": 1, "kind": "train", "loss": 1.0}]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "ki\n{"step": 2, "kind": "train"}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: not a JSON record"):
        read_metrics(str(tmp_path))


# ----------------------------------------------------------------------------- issue #29: nothing silently a no-op
#
# A user's own models, data, functions and habits that used to run and do nothing (or fail late, or with a
# traceback): each stops at once with exit code 2 and one `error (...)` line naming the key or the file.

FUNCTIONS = '''
import math

def per_row(prompt, response, row):
    return float(len(response))

def trl_style(completions, **kwargs):  # TRL's batched convention, used as it is
    return [float(len(c)) for c in completions]

def strings(prompt, response, row):
    return "good"

def raises(prompt, response, row):
    raise KeyError("solution")

def nan(completions, **kwargs):
    return [math.nan] * len(completions)

def wrong_length(prompts, completions, **kwargs):
    return [1.0] * (len(completions) + 1)

def two_args(prompt, response):
    return 1.0
'''


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """One tiny workspace for the table below: a causal LM and a reward model (tiny Llamas with the shipped
    tokenizer), a plain file, a directory of .txt files and a module of reward functions."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig

    from conftest import ROOT

    w = tmp_path_factory.mktemp("refusals")
    tok = AutoTokenizer.from_pretrained(ROOT / "data" / "tokenizer")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    rm_config = LlamaConfig(**config.to_dict(), num_labels=1)
    for name, cls, cfg in (("policy", AutoModelForCausalLM, config), ("rm", AutoModelForSequenceClassification, rm_config)):
        cls.from_config(cfg).save_pretrained(w / name)
        for f in (ROOT / "data" / "tokenizer").iterdir():
            shutil.copy(f, w / name)
    (w / "afile").write_text("not a directory\n")
    _write(w / "txtdata" / "a.txt", "Human: hi\n")
    _write(w / "txtdata" / "b.txt", "Assistant: hello\n")
    _write(w / "fns" / "user_fns.py", FUNCTIONS)
    return w


PPO_MODELS = ["actor.model={W}/policy", "critic.model={W}/rm"]
PPO_FN = [*PPO_MODELS, "reward.sources=[function]", "ppo.kl_coef=0.05"]

# (stage, overrides ({W}: the workspace), what the one error line must say)
REFUSALS = [
    # 1. a reward model where a causal LM is needed
    ("ppo", ["actor.model={W}/rm", "critic.model={W}/rm"], "actor.model="),
    ("ppo", [*PPO_MODELS, "reference.model={W}/rm"], "reference.model="),
    ("sft", ["model.name_or_path={W}/rm"], "model.name_or_path="),
    ("dpo", ["model.name_or_path={W}/rm"], "model.name_or_path="),
    # 2. a group-relative estimator with groups of one
    ("ppo", [*PPO_MODELS, "algorithm=grpo", "rollout.n_samples_per_prompt=1", "rollout.prompts_per_step=64"],
     "rollout.n_samples_per_prompt"),
    ("ppo", [*PPO_MODELS, "algorithm=rloo", "rollout.n_samples_per_prompt=1", "rollout.prompts_per_step=64"],
     "rollout.n_samples_per_prompt"),
    # 3. resume=true with nothing to resume
    ("sft", ["train.resume=true"], "train.resume=auto"),
    # 4. a reward function that cannot score: checked on the first prompt rows before any model loads
    ("ppo", [*PPO_FN, "reward.function=user_fns:strings"], "reward.function=user_fns:strings"),
    ("ppo", [*PPO_FN, "reward.function=user_fns:raises"], "KeyError"),
    ("ppo", [*PPO_FN, "reward.function=user_fns:nan"], "nan"),
    ("ppo", [*PPO_FN, "reward.function=user_fns:wrong_length"], "9 scores for 8"),
    ("ppo", [*PPO_FN, "reward.function=user_fns:two_args"], "fits neither"),
    # 5. TRL / transformers flags
    ("sft", ["--model_name_or_path", "X"], "write model.name_or_path=X"),
    ("sft", ["--learning_rate=1e-5", "--num_train_epochs", "2"], "write train.lr=1e-5 train.epochs=2"),
    ("ppo", ["--learning_rate", "1e-5"], "write actor.lr=1e-5"),
    ("sft", ["--output_dir", "d"], "write output_dir=d"),
    ("sft", ["--bogus_flag", "1"], "write key=value (python -m rlhf.sft --help lists the keys)"),
    # 6. bad inputs that escaped as tracebacks or misleading messages
    ("sft", ["output_dir={W}/afile"], "output_dir="),
    ("sft", ["model.lora.r=8", "model.lora.target_modules=q_proj,v_proj"],
     "write model.lora.target_modules=[q_proj,v_proj]"),
    ("sft", ["model.name_or_path={W}/afile"], "is a file: it must be a model directory"),
    ("sft", ["data.path={W}/txtdata"], "no .jsonl, .json or .parquet file"),
]


@pytest.mark.parametrize("stage,overrides,says", REFUSALS, ids=[" ".join(c[1][-2:]) + f" ({c[0]})" for c in REFUSALS])
def test_a_silent_no_op_is_refused_with_one_line(stage, overrides, says, ws, tmp_path):
    import os

    from conftest import ROOT

    args = [o.replace("{W}", str(ws)) for o in overrides]
    env = {"PYTHONPATH": f"{ws / 'fns'}{os.pathsep}{ROOT}"}
    proc = run_stage(stage, f"output_dir={tmp_path / 'o'}", *args, check=False, timeout=300, env=env)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error (")]
    assert len(errors) == 1 and says.replace("{W}", str(ws)) in errors[0], proc.stderr[-3000:]
    assert "usage:" not in proc.stderr  # not Hydra's usage page
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_the_accepted_reward_functions_run_and_score_every_row(ws, tmp_path):
    """The counterpart of the refusals above: a TRL-style batched function (`fn(completions, **kwargs) ->
    list[float]`), which used to fail on every row, now scores every row of a PPO run."""
    import os

    from conftest import ROOT, metrics, summary

    out = tmp_path / "o"
    run_stage("ppo", f"output_dir={out}", f"actor.model={ws / 'policy'}", f"critic.model={ws / 'policy'}",
              "reward.sources=[function]", "reward.function=user_fns:trl_style", "train.max_steps=1",
              "train.eval_every=0", "train.save_every=0", "data.num_eval_prompts=4", "rollout.prompts_per_step=8",
              "rollout.mini_batch_size=8", "rollout.micro_batch_size=8", "rollout.max_new_tokens=6",
              "eval.max_new_tokens=6", "alarms.enabled=false", timeout=300,
              env={"PYTHONPATH": f"{ws / 'fns'}{os.pathsep}{ROOT}"})
    (train,) = metrics(out, "train")
    assert train["reward_errors"] == 0 and train.get("nonfinite_rows", 0) == 0, train
    assert train["reward"] > 0  # the mean length of the responses
    assert summary(out)["reward_errors"] == 0
