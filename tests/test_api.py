"""The `rlhf` command (rlhf/__main__.py), the Python API (rlhf/api.py) with objects passed as such
(rlhf/core/plugins.py `registered`), and which code made a run (rlhf/core/provenance.py): in summary.json,
in `rlhf env`, and in the line a resume by other code logs. The installed wheel: tests/test_install.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, SMALL_MODEL, cli_env, run_stage, same_run
from rlhf.__main__ import COMMANDS
from rlhf.core.errors import ConfigError
from rlhf.core.plugins import load_function, registered
from rlhf.core.provenance import git_commit, package_version, provenance
from rlhf.run.stage import other_code

SFT_SMOKE = ["train.max_steps=2", "train.eval_every=0", "train.save_every=0", "data.num_eval_prompts=4",
             "eval.max_new_tokens=4", *SMALL_MODEL]


def python(*args: str, cwd=ROOT, code: str | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, *(("-c", code) if code else ()), *args]
    return subprocess.run(argv, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=600)


# ----------------------------------------------------------------------------- the rlhf command


def test_rlhf_command_lists_its_commands_and_refuses_an_unknown_one_in_one_line():
    shown = python("-m", "rlhf", "--help")
    assert shown.returncode == 0
    listed = [line.split()[0] for line in shown.stdout.split("commands:\n")[1].split("\n\n")[0].splitlines()]
    assert listed == list(COMMANDS)
    assert all(os.path.isfile(ROOT / "rlhf" / f"{c}.py") for c in COMMANDS)  # each names a module rlhf.<c>
    wrong = python("-m", "rlhf", "sftt", "train.lr=1")
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert wrong.stderr.strip().splitlines() == [
        f"rlhf: unknown command 'sftt' (commands: {', '.join(COMMANDS)}; rlhf --help)"]
    bare = python("-m", "rlhf")
    assert bare.returncode == 2 and "usage: rlhf <command>" in bare.stderr
    version = python("-m", "rlhf", "--version")
    commit = git_commit()
    assert version.returncode == 0
    assert version.stdout == f"rlhf-pipeline {package_version()} (commit {commit[:7]}{commit[40:]})\n"


def test_rlhf_command_is_python_m_with_the_same_arguments():
    """`rlhf sft ARGS` composes what `python -m rlhf.sft ARGS` does (Hydra sees the same argv), and a user
    error is the same line with the same exit code."""
    args = ["train.lr=0.25", "model=opt", "--cfg", "job"]
    via_command, via_module = python("-m", "rlhf", "sft", *args), python("-m", "rlhf.sft", *args)
    assert via_command.returncode == via_module.returncode == 0, via_command.stderr[-2000:]
    assert via_command.stdout == via_module.stdout and "lr: 0.25" in via_command.stdout
    bad_command, bad_module = python("-m", "rlhf", "sft", "train.lrr=1"), python("-m", "rlhf.sft", "train.lrr=1")
    assert bad_command.returncode == bad_module.returncode == 2
    assert bad_command.stderr == bad_module.stderr
    assert bad_command.stderr.startswith("error (configuration/data): unknown config key 'train.lrr'")


def test_rlhf_env_names_the_version_and_the_commit():
    proc = python("-m", "rlhf", "env")
    assert proc.returncode == 0, proc.stderr[-2000:]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    first = proc.stdout.splitlines()[0]
    assert first.startswith(f"rlhf-pipeline {package_version()} (the checkout {ROOT}, commit {head}")
    assert package_version() == "0.1.0" or package_version()[0].isdigit()


# ----------------------------------------------------------------------------- provenance


def test_provenance_is_the_installed_version_and_the_checkouts_commit():
    import importlib.metadata

    assert package_version() == importlib.metadata.version("rlhf-pipeline")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert git_commit().removesuffix("+dirty") == head and len(head) == 40
    assert provenance() == {"version": package_version(), "commit": git_commit()}


def test_a_resume_by_other_code_is_one_line():
    now = provenance()
    assert other_code({"code": dict(now)}) is None
    old = other_code({"code": {"version": "0.0.9", "commit": "a" * 40}})
    assert old == f"it was saved by version 0.0.9 (commit aaaaaaa), this is {now['version']} " \
                  f"(commit {now['commit'][:7]}{now['commit'][40:]})"
    assert other_code({"code": {"version": now["version"], "commit": None}}).startswith(
        f"it was saved by version {now['version']} (no checkout), this is")
    assert other_code({"world_size": 1}).startswith("it was saved by an older version than this one")


def test_a_resumed_run_says_which_version_saved_it(tmp_path):
    out = tmp_path / "sft"
    run_stage("sft", f"output_dir={out}", *SFT_SMOKE, "train.save_every=2")
    meta_path = out / "checkpoints" / "step_0000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["extra_state"]["run"]["code"] == provenance()  # what each checkpoint records
    assert json.loads((out / "summary.json").read_text())["version"] == package_version()
    meta["extra_state"]["run"]["code"] = {"version": "0.0.9", "commit": None}
    meta_path.write_text(json.dumps(meta))
    run_stage("sft", f"output_dir={out}", *SFT_SMOKE, "train.max_steps=4", "train.resume=true")
    lines = [line for line in (out / "sft.log").read_text().splitlines() if "saved by version" in line]
    assert len(lines) == 1, lines
    assert lines[0].endswith(f"resuming {out}/checkpoints/step_0000002: it was saved by version 0.0.9 (no checkout), "
                             f"this is {package_version()} (commit {git_commit()[:7]}{git_commit()[40:]})")
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


# ----------------------------------------------------------------------------- objects passed from Python


def brevity(prompt, response, row):  # importable by its own name: tests.test_api is on sys.path as test_api
    return -len(response)


def test_objects_are_named_by_their_own_module_or_registered_for_this_process():
    closure = lambda p, r, row: 1.0  # noqa: E731 - what a notebook passes
    other = lambda p, r, row: 0.0  # noqa: E731
    with registered({"reward.function": closure, "eval.judge": other, "x": brevity}) as specs:
        assert specs["reward.function"] == "test_api:test_objects_are_named_by_their_own_module_or_registered_" \
                                           "for_this_process._locals_._lambda_"
        assert specs["eval.judge"] == specs["reward.function"] + "_2"  # the same name, taken: suffixed
        assert specs["x"] == "test_api:brevity"  # imported by that name, in any process
        assert load_function(specs["reward.function"]) is closure and load_function(specs["eval.judge"]) is other
    assert load_function("test_api:brevity") is brevity
    with pytest.raises(ConfigError, match="has no attribute"):
        load_function(specs["reward.function"])  # gone after the block
    with pytest.raises(ConfigError, match="eval.judge: 3 is a int, not a function or class"):
        with registered({"eval.judge": 3}):
            pass


# What a notebook does: functions and classes defined in __main__, stages run one after another, errors caught.
API_SCRIPT = """
import json, os, sys
from rlhf import api
from rlhf.core.errors import ConfigError
from rlhf.rl.environments import Environment, Step

SMALL = {small!r}
calls = []

def quarter(prompt, response, row):
    calls.append(response)
    return 0.25

class Echo(Environment):
    def step(self, text):
        return Step(observation=None, reward={{}})

sft = api.run("sft", "output_dir=out/sft", "train.max_steps=2", "train.eval_every=0", "train.save_every=0",
              "data.num_eval_prompts=4", "eval.max_new_tokens=4", *SMALL, judge=lambda p, r, row: 1.0)
with open("out/sft/summary.json") as f:
    assert sft == json.load(f)
ppo = api.run("ppo", "algorithm=grpo", "actor.model=out/sft", "output_dir=out/grpo", "train.max_steps=1",
              "train.eval_every=0", "train.save_every=0", "data.num_eval_prompts=4", "rollout.prompts_per_step=4",
              "rollout.max_new_tokens=4", "eval.max_new_tokens=4", "reward.sources=[function]",
              reward_function=quarter)
errors = []
for call in (lambda: api.run("sft", "train.lrr=1"),
             lambda: api.run("ppo", "algorithm=grpo", "actor.model=out/sft", "output_dir=out/env", "rollout.env_workers=2",
                             "reward.sources=[function]", reward_function=quarter, env=Echo),
             lambda: api.run("ppo", "reward.function=m:f", reward_function=quarter),
             lambda: api.run("rl")):
    try:
        call()
        errors.append(None)
    except ConfigError as e:
        errors.append(str(e))
print(json.dumps({{"sft": sft, "ppo": ppo, "calls": len(calls), "errors": errors}}))
"""


def test_api_runs_stages_with_python_objects_and_raises_the_command_lines_error(tmp_path):
    proc = python(cwd=tmp_path, code=API_SCRIPT.format(small=SMALL_MODEL))
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    sft, ppo = got["sft"], got["ppo"]
    assert sft["stage"] == "sft" and sft["steps"] == 2 and sft["version"] == package_version()
    assert sft["commit"] is None or sft["commit"] == git_commit()  # run from tmp_path: the checkout's code
    # the judge passed as a lambda judged every held-out prompt right, before and after
    assert sft["gold_score_before"] == sft["gold_score_after"] == 100.0
    assert ppo["stage"] == "ppo" and ppo["steps"] == 1 and ppo["reward_sources"] == ["function"]
    assert ppo["reward_before"] == ppo["reward_after"] == 0.25  # the function's value, on every response
    assert got["calls"] >= 4 * 8  # 4 prompts x 8 samples, plus the evaluations
    # the command line's line for the same mistake, after its "error (configuration/data): "
    cli = subprocess.run([sys.executable, "-m", "rlhf.sft", "train.lrr=1"], cwd=tmp_path, env=cli_env(),
                         capture_output=True, text=True)
    assert cli.returncode == 2
    assert cli.stderr.strip() == f"error (configuration/data): {got['errors'][0]}"
    assert got["errors"][1] == ("rollout.env: Echo is defined in __main__ (a script, a notebook or a function); the "
                                "pool's workers import it by name: move it to an importable module, or "
                                "rollout.env_workers=0 runs it in this process (no per-call timeout)")
    assert got["errors"][2] == "reward.function is given twice: as an override and as an object (pass one)"
    assert got["errors"][3] == "rlhf.api.run: unknown stage 'rl' (stages: sft, reward, dpo, ppo, evaluate)"
    assert not os.path.exists(tmp_path / "out" / "env" / "summary.json")


def test_the_api_and_the_command_are_the_same_run(tmp_path):
    """`rlhf.api.run("sft", ...)` and `python -m rlhf.sft ...` with the same overrides: the same metrics
    and the same weights (the installed wheel does it for SFT + GRPO: tests/test_install.py)."""
    code = textwrap.dedent(f"""
        from rlhf import api
        api.run("sft", "output_dir=api", *{SFT_SMOKE!r})
    """)
    proc = python(cwd=tmp_path, code=code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_stage("sft", f"output_dir={tmp_path / 'cli'}", *SFT_SMOKE)
    same_run(tmp_path / "api", tmp_path / "cli")


TORCHRUN_SCRIPT = """
import json, os
from rlhf import api
common = {smoke!r}
first = api.run("sft", "output_dir=runs/a", *common)
second = api.run("sft", "output_dir=runs/b", *common)  # the job's group is still up for the next run
with open(f"rank_{{os.environ['RANK']}}.json", "w") as f:  # a file per rank: two ranks' long lines on one pipe interleave
    json.dump([first, second], f)
"""


@pytest.mark.slow
def test_api_under_torchrun_every_rank_gets_each_runs_summary(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "script.py").write_text(TORCHRUN_SCRIPT.format(smoke=SFT_SMOKE))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                           "127.0.0.1", "--master_port", str(port), "script.py"], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = {rank: json.loads((tmp_path / f"rank_{rank}.json").read_text()) for rank in ("0", "1")}
    assert got["0"] == got["1"]
    first, second = got["0"]
    assert first["steps"] == second["steps"] == 2 and first["model_dir"] == "runs/a/model"
    assert first["final_train_loss"] == second["final_train_loss"]  # the same run twice in one job
    assert json.loads((tmp_path / "runs" / "b" / "summary.json").read_text()) == second
