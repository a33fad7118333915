"""Multi-turn RL runs through the command line beyond one plain process (issue #32): GRPO with a deterministic
environment (tests/env_faults.py `Tally`: two observations, then the end; a reward part per episode) on 2 gloo
ranks under ZeRO-3 gives the one-process run's episodes and metrics; and a trainer killed with SIGKILL while its
environment workers hold an episode batch leaves no worker behind, and `train.resume=true` ends with the
uninterrupted run's metrics and weights."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, cli_env, comparable, metrics, run_stage, summary
from test_env_pool import running

# tests/ on the path: the environment workers import env_faults:Tally by name
ENV = {"PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"}
ARGS = ["algorithm=grpo", "reward.sources=[judge]", "rollout.env=env_faults:Tally", "rollout.max_turns=3",
        "rollout.max_new_tokens=6", "rollout.max_episode_tokens=64", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=4",
        "rollout.mini_batch_size=8", "rollout.micro_batch_size=4", "train.eval_every=0", "data.num_eval_prompts=4",
        "eval.max_new_tokens=6", "actor.lr=1e-2",
        "engine.deterministic=true",  # per-row sampling streams: a row's tokens do not depend on its rank
        "engine.precision=fp32"]  # on every host (auto runs bf16 on a CPU with native bf16): the equalities are fp32's
# figures that count episodes, turns and tokens: equal, not close
COUNTS = ("turns", "tool_calls", "obs_tokens", "episodes", "env_errors", "env_timeouts", "template_checked",
          "template_mismatch", "response_len", "dropped_groups", "step")


def args(stages, out, *extra):
    return [f"output_dir={out}", f"actor.model={stages / 'sft'}", f"critic.model={stages / 'reward'}", *ARGS, *extra]


def test_zero3_on_two_ranks_equals_one_process(tiny_stages, tmp_path):
    """The same episodes (turns, tool calls, observation tokens: equal) and the same rewards, KL, losses and
    entropy (to float rounding: the ranks' sums are reduced in another order) at every step, and the same
    greedy tool evaluation at the end."""
    common = ["engine=zero3", "train.max_steps=2", "train.save_every=0", "rollout.env_workers=0"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_stage("ppo", *args(tiny_stages, one, *common), env=ENV)
    run_stage("ppo", *args(tiny_stages, two, *common), torchrun=2, env=ENV)
    a, b = comparable(metrics(one, "train")), comparable(metrics(two, "train"))
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert a[0]["tool_calls"] > 0 and a[0]["obs_tokens"] > 0 and a[0]["turns"] > 1  # the runs were multi-turn
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if k in COUNTS or not isinstance(x[k], float):
                assert x[k] == y[k], (x["step"], k, x[k], y[k])
            else:
                assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-6), (x["step"], k, x[k], y[k])
    sa, sb = summary(one), summary(two)
    for k in ("gold_score_tool_after", "gold_score_after", "turns_eval_after", "tool_calls_eval_after"):
        assert sa[k] == sb[k], k
    assert sa["turns_eval_after"] > 1


def test_a_trainer_killed_during_an_episode_batch_resumes_exactly(tiny_stages, tmp_path):
    """Checkpoints every 2 steps; in step 3 an environment worker (2 workers) hangs in a step call, and the
    test sends SIGKILL to the trainer there: its workers go with it, and the resumed run (from step 2's
    checkpoint) logs the uninterrupted run's metrics for every step and exports its weights."""
    common = ["train.max_steps=4", "train.save_every=2", "rollout.env_workers=2", "rollout.env_timeout_s=600"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run_stage("ppo", *args(tiny_stages, whole, *common), env=ENV)

    marker = tmp_path / "hang"
    # resets before step 3's: 8 per step (2 prompts x 4 samples) + at most 4 of the held-out tool evaluation
    hang = {"TALLY_HANG": str(marker), "TALLY_HANG_AFTER": str(2 * 8 + 4)}
    cmd = [sys.executable, "-m", "rlhf.ppo", *args(tiny_stages, killed, *common)]
    trainer = subprocess.Popen(cmd, cwd=ROOT, env={**cli_env(), **ENV, **hang}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists() and trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), f"no environment hung (trainer exit {trainer.poll()}):\n{trainer.stderr.read()[-3000:]}"
        worker = int(marker.read_text())
        assert worker != trainer.pid and running(worker)
        trainer.send_signal(signal.SIGKILL)
        assert trainer.wait(timeout=30) == -signal.SIGKILL
    finally:
        if trainer.poll() is None:
            trainer.kill()
    gone = time.monotonic() + 15
    while running(worker) and time.monotonic() < gone:
        time.sleep(0.05)
    assert not running(worker), f"environment worker {worker} outlived the killed trainer"
    assert not (killed / "summary.json").exists()
    assert sorted(os.listdir(killed / "checkpoints")) == ["step_0000002"]
    assert len(metrics(killed, "train")) == 2  # steps 1 and 2 logged, step 3 was under way

    run_stage("ppo", *args(tiny_stages, killed, *common), "train.resume=true", env=ENV)
    want, got = comparable(metrics(whole, "train")), comparable(metrics(killed, "train"))
    assert [r["step"] for r in got] == [1, 2, 3, 4] and got == want
    assert got[2]["tool_calls"] > 0
    from safetensors.torch import load_file

    a, b = load_file(whole / "model" / "model.safetensors"), load_file(killed / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
