"""The stage apps' command line: `--help` from the schema, `--cfg job` resolved, unknown keys, and
hub names on a machine without internet (HF_ENDPOINT pointed at a closed local port)."""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time
import typing

import pytest

from conftest import CLOSED_PORT, ROOT, run_stage
from rlhf.config import DPOConfig, EvaluateConfig, PPOConfig, RewardConfig, ServeConfig, SFTConfig

STAGES = {"sft": SFTConfig, "reward": RewardConfig, "dpo": DPOConfig, "ppo": PPOConfig, "evaluate": EvaluateConfig,
          "serve": ServeConfig}
OFFLINE_LIMIT_S = 5.0  # on a busy machine: at most this, or a plain start (--cfg job) + SLACK_S
SLACK_S = 3.0


def leaf_keys(schema: type, prefix: str = "") -> list[str]:
    """Every leaf key of a dataclass schema, dotted (written here independently of rlhf/config/cli.py)."""
    hints = typing.get_type_hints(schema)
    keys = []
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += leaf_keys(hints[f.name], prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def help_entries(text: str) -> dict[str, tuple[str, str]]:
    """{key: (value, description)} from `--help`: `  key=value   description`, the description on
    the next line (indented) when `key=value` is long."""
    lines = text.splitlines()
    entries = {}
    for i, line in enumerate(lines):
        m = re.match(r"^  ([\w.]+)=(.*?)(?:\s{2,}(\S.*))?$", line)
        if m:
            desc = m.group(3)
            if desc is None and i + 1 < len(lines) and re.match(r"^ {10,}\S", lines[i + 1]):
                desc = lines[i + 1].strip()
            entries[m.group(1)] = (m.group(2), desc or "")
    return entries


def offline_env(monkeypatch, **extra: str) -> None:
    monkeypatch.setenv("HF_ENDPOINT", CLOSED_PORT)
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in extra.items():
        monkeypatch.setenv(key, value)


# ----------------------------------------------------------------------------- --help and --cfg


@pytest.mark.parametrize("stage", list(STAGES))
def test_help_lists_every_key_with_its_value_and_a_description(stage):
    proc = run_stage(stage, "--help")
    entries = help_entries(proc.stdout)
    expected = leaf_keys(STAGES[stage])
    assert sorted(entries) == sorted(expected)
    assert [k for k in expected if not entries[k][1]] == []  # every key has a description
    assert entries["seed"][0] == "1234" and "Traceback" not in proc.stderr
    assert "--hydra-help" in proc.stdout  # Hydra's own help stays reachable


def test_help_shows_values_after_overrides_and_descriptions_from_the_schema():
    proc = run_stage("sft", "train.lr=0.123", "engine=zero3", "model.lora.r=4", "--help")
    entries = help_entries(proc.stdout)
    assert entries["train.lr"] == ("0.123", "peak learning rate (AdamW)")
    assert entries["engine.stage"][0] == "3"  # from conf/engine/zero3.yaml
    assert entries["model.lora.r"] == ("4", "0 = no LoRA")
    assert entries["train.betas"][0] == "[0.9, 0.95]"
    assert entries["data.path"][0] == str(ROOT / "data/default/sft_train.jsonl")  # ${root:...} resolved
    assert "engine: zero0 zero1 zero2 [zero3] zero3_offload" in proc.stdout
    assert "\nmodel.lora: LoRA adapters (r=0: none)\n" in proc.stdout  # a group's header and description


def test_cfg_job_is_resolved():
    proc = run_stage("ppo", "--cfg", "job")
    assert "${" not in proc.stdout  # ${root:...} and actor.lora: ${model.lora} resolved
    assert f"ptx_path: {ROOT / 'data/default/sft_train.jsonl'}" in proc.stdout


# ----------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize("override", ["train.lrr=1", "+train.lrr=1"])
@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_unknown_key_exits_2_with_the_closest_key(stage, override, tmp_path):
    proc = run_stage(stage, f"output_dir={tmp_path}", override, check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and line.startswith("error (configuration/data): unknown config key 'train.lrr'")
    assert "did you mean 'train.lr'?" in line
    assert not os.listdir(tmp_path)  # nothing ran


def test_wrongly_nested_key_and_bad_group_option(tmp_path):
    proc = run_stage("sft", f"output_dir={tmp_path}", "lora.r=8", check=False)
    assert proc.returncode == 2 and "did you mean 'model.lora.r'?" in proc.stderr
    proc = run_stage("ppo", "rollout.lr=1", "--cfg", "job", check=False)
    assert proc.returncode == 2 and re.search(r"did you mean '(actor|critic)\.lr' or '(actor|critic)\.lr'\?", proc.stderr)
    proc = run_stage("sft", "engine=zero9", "--cfg", "job", check=False)
    assert proc.returncode == 2 and "zero9" in proc.stderr and "options: zero0, zero1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_wrong_type_or_a_key_below_a_link_is_caught_before_hydra():
    # Hydra composes onto the schema, so it would stop on these with its own report (exit 1); and
    # critic.lora.alpha=8 would write through critic.lora=${model.lora} into the actor's LoRA too.
    from rlhf.config.cli import check_overrides
    from rlhf.config import ConfigError

    conf = str(ROOT / "conf")
    with pytest.raises(ConfigError, match=r"config key 'train\.lr' \(in 'train\.lr=fast'\): Value 'fast'"):
        check_overrides(["train.lr=fast"], SFTConfig, conf, "rlhf.sft")
    with pytest.raises(ConfigError, match=r"below critic\.lora, which is \$\{model\.lora\}: set model\.lora\.alpha"):
        check_overrides(["critic.lora.alpha=8"], PPOConfig, conf, "rlhf.ppo")
    assert check_overrides(["actor.lora={r:2}", "model.lora.r=4", "ptx_path=null", "model.config.x=1"],
                           PPOConfig, conf, "rlhf.ppo") == {"model.config.x=1": "++model.config.x=1"}


def test_trl_flags_name_the_override_to_write_instead():
    """`python -m rlhf.sft --model_name_or_path X` printed Hydra's usage page (#29): TRL's and transformers'
    flags are translated to this stage's keys (PPO's policy keys are actor.*), in one line."""
    from rlhf.config import ConfigError
    from rlhf.config.cli import check_foreign_flags

    def says(argv, schema=SFTConfig, app="rlhf.sft"):
        foreign = {w.partition("=")[0] for w in argv if w.startswith("-")}
        with pytest.raises(ConfigError) as e:
            check_foreign_flags(argv, foreign, schema, app)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert says(["--model_name_or_path", "X", "train.max_steps=3"]) == (
        "--model_name_or_path X: python -m rlhf.sft takes Hydra overrides (key=value, no dashes), not flags: "
        "write model.name_or_path=X")
    assert says(["--learning_rate=1e-5", "--num_train_epochs", "2", "--per_device_train_batch_size", "4"]).endswith(
        "write train.lr=1e-5 train.epochs=2 train.micro_batch_size=4")
    assert says(["--output_dir", "d", "--seed", "3", "--max_steps", "5", "--dataset_name", "x.jsonl"]).endswith(
        "write output_dir=d seed=3 train.max_steps=5 data.path=x.jsonl")
    assert says(["--model_name_or_path", "m", "--learning_rate", "1e-6", "--per_device_train_batch_size", "4",
                 "--num_generations", "8"], PPOConfig, "rlhf.ppo").endswith(
        "write actor.model=m actor.lr=1e-6 rollout.micro_batch_size=4 rollout.n_samples_per_prompt=8")
    assert says(["--beta", "0.2"], DPOConfig, "rlhf.dpo").endswith("write dpo.beta=0.2")
    assert says(["--bf16", "--gradient_checkpointing", "--train.lr=3e-4"]).endswith(
        "write engine.precision=bf16 engine.activation_checkpointing=true train.lr=3e-4")
    assert says(["--report_to", "none"]) == ("--report_to none: python -m rlhf.sft takes Hydra overrides (key=value, "
                                             "no dashes), not flags: for --report_to write key=value (python -m "
                                             "rlhf.sft --help lists the keys)")
    assert says(["--learning_rate", "1"], EvaluateConfig, "rlhf.evaluate").endswith(  # no such key there
        "for --learning_rate write key=value (python -m rlhf.evaluate --help lists the keys)")
    check_foreign_flags(["train.lr=1", "--cfg", "job"], set(), SFTConfig, "rlhf.sft")  # Hydra's own: fine


def test_a_comma_list_without_brackets_and_an_output_dir_that_is_a_file(tmp_path):
    """Hydra reads `key=a,b` as a sweep and stopped with several lines (exit 1); an output_dir that is a
    file was a traceback from Hydra making it its run directory (#29)."""
    from rlhf.config import ConfigError
    from rlhf.config.cli import check_overrides

    conf = str(ROOT / "conf")
    with pytest.raises(ConfigError) as e:
        check_overrides(["model.lora.target_modules=q_proj,v_proj"], SFTConfig, conf, "rlhf.sft")
    assert "write model.lora.target_modules=[q_proj,v_proj] for a list" in str(e.value)
    with pytest.raises(ConfigError, match="choose one option of the config group 'engine'"):
        check_overrides(["engine=zero2,zero3"], SFTConfig, conf, "rlhf.sft")
    assert check_overrides(["train.lr=1e-3,1e-4"], SFTConfig, conf, "rlhf.sft", multirun=True) == {}  # a real sweep
    assert check_overrides(["model.lora.target_modules=[q_proj,v_proj]", "data.data_split='2,4,4'"], SFTConfig, conf,
                           "rlhf.sft") == {}
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=r"output_dir='.*/f' is a file, not a directory"):
        check_overrides([f"output_dir={tmp_path / 'f'}"], SFTConfig, conf, "rlhf.sft")
    with pytest.raises(ConfigError, match=r"output_dir='.*/f/sub/run': .*/f is a file, so no directory can be made"):
        check_overrides([f"output_dir={tmp_path / 'f' / 'sub' / 'run'}"], PPOConfig, conf, "rlhf.ppo")
    assert check_overrides([f"output_dir={tmp_path / 'new' / 'run'}"], SFTConfig, conf, "rlhf.sft") == {}


def test_keys_below_a_dict_key_are_free(tmp_path):
    # model.config holds HF config kwargs: a key the YAML lacks is added (not a Hydra struct error)
    proc = run_stage("ppo", "model.config.rope_theta=500.0", "--cfg", "job")
    assert "rope_theta: 500.0" in proc.stdout


def test_suggest_prefers_the_same_last_part_then_difflib():
    from rlhf.config.cli import suggest

    valid = ["train.lr", "train.log_every", "actor.lr", "critic.lr", "rollout.micro_batch_size"]
    assert suggest("train.lrr", valid) == ["train.lr"]
    assert suggest("lr", valid)[0] == "train.lr" and set(suggest("lr", valid)) == {"train.lr", "actor.lr", "critic.lr"}
    assert suggest("rollout.micro_batch", valid) == ["rollout.micro_batch_size"]
    assert suggest("zzz", valid) == []


def test_descriptions_come_from_trailing_comments_else_the_block_above():
    from rlhf.config.cli import describe
    from rlhf.config import ModelConfig, TrainConfig

    assert describe(TrainConfig, "scheduler") == "constant | linear | cosine"
    assert describe(ModelConfig, "name_or_path").startswith("a local HF directory, a hub name")
    assert describe(SFTConfig, "seed") == "random init, dropout and data order"  # from the base StageConfig


# ----------------------------------------------------------------------------- hub names offline


@pytest.fixture(scope="module")
def start_s() -> dict[str, float]:
    """Seconds a plain `--cfg job` takes per stage (imports + composition): this machine's floor."""
    out = {}
    for stage in ("sft", "ppo"):
        t0 = time.time()
        run_stage(stage, "--cfg", "job", fresh=True)  # a new process's start, imports included
        out[stage] = time.time() - t0
    return out


@pytest.mark.parametrize("stage,override,key", [
    ("sft", "model.name_or_path=facebook/opt-125m", "model.name_or_path"),
    ("sft", "model.tokenizer=facebook/opt-125m", "model.tokenizer"),
    ("sft", "data.path=Dahoas/rm-static", "data.path"),
    ("ppo", "actor.model=facebook/opt-125m", "actor.model"),
])
def test_offline_hub_name_fails_fast_naming_the_key(stage, override, key, tmp_path, monkeypatch, start_s):
    """A hub name with no network is one line naming the key, at a plain start's speed: no retries, no backoff
    (huggingface_hub's would add 15 s or more). A timing on a machine shared with other tests is noisy, so a
    slow try is measured again beside a fresh plain start under the same load: a real wait is slow every time."""
    offline_env(monkeypatch, HF_HOME=str(tmp_path / "hf"))  # an empty cache
    plain = start_s[stage]
    for attempt in range(3):
        t0 = time.time()
        proc = run_stage(stage, f"output_dir={tmp_path / 'out'}", override, check=False, timeout=120, fresh=True)
        elapsed = time.time() - t0
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        err = [line for line in proc.stderr.splitlines() if line.startswith("error")]
        assert len(err) == 1 and err[0].startswith(f"error (configuration/data): {key}=")
        assert CLOSED_PORT in err[0] and "HF_HUB_OFFLINE=1" in err[0] and "local path" in err[0]
        limit = max(OFFLINE_LIMIT_S, 1.5 * plain + SLACK_S)  # 1.5x: a loaded machine starts unevenly
        print(f"{stage} {override}: exit 2 after {elapsed:.2f} s (a plain start: {plain:.2f} s)")
        if elapsed < limit:
            break
        t0 = time.time()
        run_stage(stage, "--cfg", "job", fresh=True)  # the floor again, under the load of this moment
        plain = time.time() - t0
    assert elapsed < limit, f"took {elapsed:.1f} s in each of 3 tries (the last plain start: {plain:.1f} s)"


def test_offline_hub_dataset_in_offline_mode_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    # HF_HUB_OFFLINE=1: no probe; `datasets` raises ConnectionError for a name it has not cached
    offline_env(monkeypatch, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    proc = run_stage("sft", f"output_dir={tmp_path / 'out'}", "data.path=Dahoas/rm-static", check=False, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error (configuration/data): data.path='Dahoas/rm-static'" in proc.stderr
    assert "ConnectionError" in proc.stderr


def fake_hub_cache(hf_home, repo: str) -> None:
    """`repo` in a Hugging Face hub cache under `hf_home`, as a download would leave it: the shipped
    tokenizer plus a model config.json."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    shutil.copytree(ROOT / "data/tokenizer", root / "snapshots" / commit)
    (root / "snapshots" / commit / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, '
        '"num_attention_heads": 4, "vocab_size": 100}')
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)


@pytest.mark.parametrize("offline_flag", ["", "1"])
def test_cached_hub_name_still_loads_offline(offline_flag, tmp_path, monkeypatch):
    fake_hub_cache(tmp_path / "hf", "local/tok")
    offline_env(monkeypatch, HF_HOME=str(tmp_path / "hf"), **({"HF_HUB_OFFLINE": offline_flag} if offline_flag else {}))
    # a global batch larger than the data stops the run right after the tokenizer loaded and the data
    # was tokenized with it (exit 2, before any model is built)
    proc = run_stage("sft", f"output_dir={tmp_path / 'out'}", "model.tokenizer=local/tok",
                     "train.global_batch_size=100000", "train.micro_batch_size=100000", check=False, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "train.global_batch_size=100000 exceeds the" in proc.stderr  # got past the tokenizer
    assert "cannot load a tokenizer" not in proc.stderr
    if not offline_flag:
        assert "loading model.tokenizer=local/tok from the local cache" in proc.stdout + proc.stderr
