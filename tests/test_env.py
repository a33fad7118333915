"""python -m rlhf.env: the report names every kernel and the decoder; --check passes on CPU (kernels
skipped without the interpreter, run in it with TRITON_INTERPRET=1); a forced failure is a FAIL line
and exit code 1."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import ROOT, cli_env
from rlhf import env

CHECKED = ("rms_norm", "layer_norm", "silu_mul", "apply_rotary", "sample", "fused_logprobs_entropy")


def run_env(*args: str, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf.env", *args], cwd=ROOT, env={**cli_env(), **extra_env},
                          capture_output=True, text=True, timeout=600)


def lines_of(out: str, status: str) -> list[str]:
    return [line.strip() for line in out.splitlines() if line.strip().startswith(status)]


def test_report_and_check_on_cpu():
    proc = run_env("--check")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.splitlines()[0].startswith("rlhf-pipeline ")  # our version first (tests/test_api.py: its commit)
    for name in ("python", "torch", "transformers", "peft", "datasets", "hydra-core", "triton", "wandb", "CUDA"):
        assert f"{name} " in out.splitlines()[1] and out.splitlines()[1].startswith("versions: ")
    assert "device for a run: cpu" in out and "gloo yes" in out
    from engine.config import cpu_has_bf16

    want = "bf16; this CPU has native" if cpu_has_bf16() else "fp32; this CPU has no native"
    assert f"precision: engine.precision=auto -> {want} bf16" in out
    assert "generation path (sft, model: llama): hf (engine.generation=auto runs transformers generate off CUDA (device cpu)" in out
    assert "on cpu each op runs: PyTorch reference" in out
    skips = lines_of(out, "SKIP")
    assert [s.split()[1] for s in skips] == list(CHECKED) and all("no CUDA" in s for s in skips)
    passes = lines_of(out, "PASS")
    assert [p.split()[3][1:-1] + " " + p.split()[4] for p in passes] == [
        "llama float32", "llama bfloat16", "opt float32", "opt bfloat16"]
    assert all("greedy tokens = transformers'" in p for p in passes)
    assert "4 passed, 0 failed, 6 skipped" in out


def test_generation_path_follows_the_config():
    proc = run_env("engine.generation=injected")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "generation path (sft, model: llama): injected (engine.generation=injected, llama is supported)" in proc.stdout
    assert run_env("stage=bogus").returncode == 2


@pytest.mark.slow  # Triton's CPU interpreter: ~1 min on 2 cores
def test_kernels_checked_in_the_interpreter():
    proc = run_env("--check", TRITON_INTERPRET="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    passes = lines_of(proc.stdout, "PASS")
    for name in CHECKED:
        assert any(p.split()[1] == name and "float32" in p for p in passes), name
    assert "15 passed, 0 failed, 1 skipped" in proc.stdout  # bf16 log-probs: not in the interpreter


def test_forced_failures_are_reported(monkeypatch, capsys):
    from engine.inference.model import InferenceModel
    from kernels import dispatch

    forward = InferenceModel.forward
    monkeypatch.setattr(InferenceModel, "forward", lambda self, *a, **k: forward(self, *a, **k).flip(-1))
    # one kernel whose Triton path is wrong by +1 (the case's reference is the real reference)
    x = torch.randn(4, 8)
    # "Triton is usable" for the kernel checks only: the injected decoder calls kernels/ ops too, and
    # there a faked Triton would launch real kernels on the CPU
    check_kernels = env.check_kernels

    def check_kernels_with_triton(*args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(dispatch, "use_triton", lambda *t: True)
            return check_kernels(*args, **kwargs)

    monkeypatch.setattr(env, "check_kernels", check_kernels_with_triton)
    monkeypatch.setattr(env, "kernel_cases", lambda device, dtype, small: {
        "rms_norm": (lambda impl: torch.nn.functional.rms_norm(x, (8,)) + (impl == "triton"), ("y",))})
    assert env.main(["--check"]) == 1
    out = capsys.readouterr().out
    fails = lines_of(out, "FAIL")
    assert any(f.startswith("FAIL  rms_norm (small)") and "y: relative error" in f and "> tolerance 1e-05" in f
               for f in fails)
    decoder = [f for f in fails if "injected decoder" in f]
    assert len(decoder) == 4 and all("transformers' choice" in f and "log-prob gap" in f for f in decoder)
    assert "0 passed, 6 failed, 0 skipped" in out
