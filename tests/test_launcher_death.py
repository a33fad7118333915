"""`kill -9` on the torchrun launcher ends its workers (issue #29): they arm a parent-death signal in
`engine.distributed.init_distributed`; without it (the control case) they train on, orphaned."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT, cli_env

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")]

WORKER = """
import os, sys, time
import engine.distributed as D
if sys.argv[2] == "unarmed":
    D.die_with_launcher = lambda: False  # the control: what a worker did before
info = D.init_distributed()
open(os.path.join(sys.argv[1], f"pid{info.rank}"), "w").write(str(os.getpid()))
time.sleep(120)  # "training"
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line for line in f if line.startswith("State:")).split()[1] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def _launch(tmp_path, mode: str) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                 "--master_addr", "127.0.0.1", "--master_port", str(port), str(script), str(tmp_path),
                                 mode], cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not all((tmp_path / f"pid{r}").exists() for r in (0, 1)):
        assert time.time() < deadline and launcher.poll() is None, "the workers did not start"
        time.sleep(0.2)
    time.sleep(0.2)  # the pid files are written whole
    return launcher, [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]


def _after_kill(launcher: subprocess.Popen, pids: list[int], wait_s: float) -> list[int]:
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + wait_s
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def test_killing_the_launcher_ends_its_workers(tmp_path):
    launcher, pids = _launch(tmp_path, "armed")
    assert _after_kill(launcher, pids, wait_s=20) == []


def test_unarmed_workers_outlive_a_killed_launcher(tmp_path):
    """The control: the same workers without the parent-death signal are still running 5 s later."""
    launcher, pids = _launch(tmp_path, "unarmed")
    try:
        assert _after_kill(launcher, pids, wait_s=5) == pids
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
