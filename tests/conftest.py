"""Shared helpers: running a stage app through its real command line, and reading its outputs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import forkserver

# The suite is two lanes. The tests not marked `gpu` state CPU facts (fp32 rounding, bitwise repeats of a
# run, gloo ranks on one machine), so on a machine with GPUs they run with the GPUs hidden, as in CI; the
# GPU lane, `pytest -m gpu`, runs the tests marked `gpu` on CUDA. RLHF_TESTS_CUDA=1 leaves the GPUs visible
# to every test (the stages then train on CUDA: a way to look for CUDA-only failures, not a lane that passes).
CPU_SUITE = False


def pytest_configure(config):
    global CPU_SUITE
    expr = config.getoption("markexpr", "") or ""
    gpu_lane = "gpu" in expr and "not gpu" not in expr
    if not gpu_lane and os.environ.get("RLHF_TESTS_CUDA") != "1":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything initialises CUDA; children inherit it
        CPU_SUITE = True


ROOT = Path(__file__).resolve().parents[1]

# A smaller model than the shipped default, so that a CLI run of a few steps takes seconds.
SMALL_MODEL = [
    "model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2",
]


# No test may depend on whether this machine reaches huggingface.co (CI does not; a laptop may):
# every stage run sees a hub that does not answer, as CI does.
CLOSED_PORT = "http://127.0.0.1:9"


def cli_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled",
           "HF_ENDPOINT": CLOSED_PORT}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_stage(module: str, *overrides: str, torchrun: int = 0, check: bool = True, timeout: int = 600,
              env: dict[str, str] | None = None, fresh: bool = False):
    """`python -m rlhf.<module> overrides...` (or under torchrun with N ranks; `env` added to the
    environment); returns the process. One process runs through the fork server (tests/forkserver.py:
    a fresh process's behaviour without its ~8 s of imports) unless `fresh` (a test timing the start)."""
    if torchrun:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(torchrun),
               "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", f"rlhf.{module}", *overrides]
        proc = subprocess.run(cmd, cwd=ROOT, env={**cli_env(), **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)
    else:
        cmd = [sys.executable, "-m", f"rlhf.{module}", *overrides]
        proc = forkserver.run(f"rlhf.{module}", list(overrides), cwd=ROOT, env={**cli_env(), **(env or {})},
                              timeout=timeout, fresh=fresh)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}")
    return proc


def metrics(out_dir, kind: str | None = None) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if kind is None or r["kind"] == kind]


def killed_at(module: str, out_dir, point: str, *overrides: str) -> subprocess.CompletedProcess:
    """A stage run SIGKILLed by itself at `point` (engine.checkpoint.kill_point, "name[:n]"): it must
    really have died there, leaving a `.tmp-` leftover and no summary.json."""
    from engine.checkpoint import KILL_ENV

    proc = run_stage(module, f"output_dir={out_dir}", *overrides, check=False, env={KILL_ENV: point})
    assert proc.returncode == -9, f"not killed at {point} (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert leftovers(out_dir), f"killed at {point} but nothing was half-written"
    assert not os.path.exists(os.path.join(out_dir, "summary.json"))
    return proc


def leftovers(out_dir) -> list[str]:
    """`.tmp-` entries in a run's output_dir and its checkpoints/."""
    found = []
    for d in (out_dir, os.path.join(out_dir, "checkpoints")):
        if os.path.isdir(d):
            found += [os.path.join(d, n) for n in os.listdir(d) if ".tmp-" in n]
    return found


def comparable(rows: list[dict]) -> list[dict]:
    """metrics.jsonl records without wall-clock fields (what two runs of the same seed must share)."""
    return [{k: v for k, v in r.items() if not (k.endswith("_s") or "time" in k or k.startswith("mem"))} for r in rows]


def same_run(out_a, out_b) -> None:
    """Two runs of one stage gave the same numbers: metrics.jsonl equal without its wall-clock fields,
    summary.json equal but for its times and paths, and the exported weights equal bit for bit."""
    from safetensors.torch import load_file

    assert comparable(metrics(out_a)) == comparable(metrics(out_b))
    assert len(metrics(out_a, "train")) >= 1
    a, b = summary(out_a), summary(out_b)
    assert a.keys() == b.keys()
    for key in a:
        if not (key.endswith("_s") or key.endswith(("_dir", "_file")) or "source" in key):
            assert a[key] == b[key], key
    wa, wb = load_file(os.path.join(out_a, "model", "model.safetensors")), load_file(os.path.join(out_b, "model", "model.safetensors"))
    assert wa.keys() == wb.keys() and wa
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def summary(out_dir) -> dict:
    with open(os.path.join(out_dir, "summary.json")) as f:
        return json.load(f)


def gpu(test):
    """GPU lane: marked `gpu`, skipped cleanly without CUDA (and in the CPU suite: see pytest_configure)."""
    why = "needs CUDA (none here, or hidden: on a machine with GPUs the GPU lane is `pytest -m gpu`)" if CPU_SUITE \
        else "needs CUDA"
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason=why)(test))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models (more only add overhead, and stall on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def interp():
    """Run a function in a child Python with TRITON_INTERPRET=1 (Triton kernels on the CPU)."""
    pytest.importorskip("triton", reason="triton not installed: interpreter tests need it")
    pytest.importorskip("numpy", reason="Triton's interpreter needs numpy")
    from kernels.testing import run_in_interpreter

    return run_in_interpreter


@pytest.fixture(autouse=True)
def _hub_does_not_answer(monkeypatch):
    """In-process code sees the same unanswering hub as the stage runs of `cli_env`."""
    monkeypatch.setenv("HF_ENDPOINT", CLOSED_PORT)


@pytest.fixture(scope="session")
def tiny_stages(tmp_path_factory):
    """SFT and reward outputs of a few steps on the small model: models for PPO runs whose learning
    does not matter (reward sources, alarms). Session-scoped: built once for every test file."""
    root = tmp_path_factory.mktemp("tiny_stages")
    run_stage("sft", f"output_dir={root / 'sft'}", *SMALL_MODEL, "train.max_steps=2", "train.eval_every=0",
              "train.save_every=0", "data.num_eval_prompts=4")
    run_stage("reward", f"output_dir={root / 'reward'}", f"model.name_or_path={root / 'sft'}",
              "model.fallback_to_config=false", "train.max_steps=1", "train.eval_every=0", "train.save_every=0",
              "data.num_eval_prompts=4")
    return root
