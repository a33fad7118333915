"""Tiny environments for tests/test_env_pool.py, in an importable module so the pool's workers (spawned /
forkserver processes) can import them by `tests.env_faults:Name` (tests/ is on sys.path as `env_faults`).

Each env's step(text) reads a command from the text; `Echo` answers deterministically from the row and
the turn, the others fault in one way when the text asks them to and behave like Echo otherwise."""
from __future__ import annotations

import os
import signal
import socket
import time

from rlhf.rl.environments import Environment, Step
from rlhf.rl.environments.python_tool import PythonTool


class Echo(Environment):
    """Deterministic: reset -> 'start <id>'; step(text) -> 'turn <n>: <text reversed>' for 3 turns, then
    done with reward {'len': total characters seen}."""

    def reset(self, row):
        self.id, self.turn, self.seen = row["id"], 0, 0
        return f"start {self.id}"

    def step(self, text):
        self.turn += 1
        self.seen += len(text)
        if self.turn >= 3 or text == "stop":
            return Step(None, {"len": float(self.seen)}, {"turns": self.turn})
        return Step(f"turn {self.turn}: {text[::-1]} ({self.id})", {"turn": 1.0})


class Faulty(Echo):
    """Echo, except a step text naming a fault does it: raise, hang, garbage, nan, unpicklable, exit,
    sigkill, forkbomb, memhog, network, spin, pid, nap (0.4 s, then as Echo) (returns the worker's pid as the observation)."""

    def step(self, text):
        if text == "raise":
            raise RuntimeError("the environment broke")
        if text == "hang":
            time.sleep(3600)
        if text == "garbage":
            return {"observation": "not a Step"}
        if text == "nan":
            return Step("x", {"score": float("nan")})
        if text == "unpicklable":
            return Step("x", info={"lock": (lambda: None)})
        if text == "exit":
            os._exit(3)
        if text == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if text == "forkbomb":
            pids = []
            try:
                for _ in range(10_000):
                    pid = os.fork()
                    if pid == 0:
                        time.sleep(30)
                        os._exit(0)
                    pids.append(pid)
            finally:  # the children it did get: kill and reap them (the error still propagates)
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
        if text == "memhog":
            hog = bytearray(8 << 30)  # 8 GiB, past the test's memory limit
            return Step(f"allocated {len(hog)}")
        if text == "network":
            with socket.create_connection(("1.1.1.1", 53), timeout=1):
                return Step("connected")
        if text == "spin":
            while True:
                pass
        if text == "nap":
            time.sleep(0.4)
        if text == "hang at close":
            self.hang_at_close = True
            return Step("noted")
        if text == "pid":
            return Step(str(os.getpid()))
        return super().step(text)

    def close(self):
        if getattr(self, "hang_at_close", False):
            time.sleep(3600)


class SmallPythonTool(PythonTool):
    """The Python tool with test-sized limits."""

    timeout_s = 1.0
    max_output_chars = 200
    max_calls = 2


class Tally(Environment):
    """Deterministic, for whole RL runs (tests/test_multiturn_ranks.py): the first two turns are answered with
    the turn's length in characters, the third ends the episode; reward part `distinct` = distinct characters
    of every turn / 10 (episodes of one prompt differ, so GRPO's advantages are not all zero).

    With TALLY_HANG=<path> set, every reset appends a byte to <path>.resets, and a step taken after more than
    TALLY_HANG_AFTER resets writes this process's pid to <path> (the first one to get there) and sleeps: the
    trainer waits on an episode batch, for a test to kill it."""

    def reset(self, row):
        self.turn = 0
        hang = os.environ.get("TALLY_HANG")
        if hang:
            with open(hang + ".resets", "ab") as f:
                f.write(b".")

    def step(self, text):
        hang = os.environ.get("TALLY_HANG")
        if hang and os.path.getsize(hang + ".resets") > int(os.environ["TALLY_HANG_AFTER"]):
            try:
                fd = os.open(hang + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                os.rename(hang + ".tmp", hang)
            except FileExistsError:
                pass
            time.sleep(600)
        self.turn += 1
        reward = {"distinct": len(set(text)) / 10}
        return Step(str(len(text)) if self.turn <= 2 else None, reward)
