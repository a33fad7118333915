"""The environment pool's overhead: round trips of `ProcessRunner.step` for a batch of episodes against the
in-process runner (rollout.env_workers=0) on a trivial calculator-like environment (CalcLike below: a
regex and a sum, microseconds a call), so what is measured is the pool itself: pickling, the socket
round trip per worker, the workers' loop.

    python scripts/bench_env.py                          # 64 episodes, 1/2/4 workers, 3 interleaved reps
    python scripts/bench_env.py --episodes 256 --rounds 10 --reps 1 --workers 1 8

Per rep, in turn: the inline runner, then each pool size (all pools are started once, before the reps);
each runs --rounds steps of all episodes (a round = one `step` call of the batch, one message per worker
each way). Printed: ms per round and calls/s (median over reps), the ratio to inline, and the overhead
per round in ms (pool - inline). Also the cost of starting a pool and of a worker's replacement (a
fresh interpreter: the time from a worker's death to its replacement answering). Ratios measured in the
same run are the figures to compare across machines; the absolute ms depend on the load.

With --compare-start it also times starting one child that imports the pool and answers on a pipe, 5
interleaved times each, from a main module that imports torch at its top as a trainer's does: fork+exec
of `python -c` (the pool's way) against multiprocessing's spawn and forkserver (its server already
running, the pool preloaded), which re-import that main module, torch included, in every child.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # the workers import this file as scripts.bench_env (they get this sys.path)

from rlhf.rl.environments import Environment, ProcessRunner, Step
from rlhf.rl.environments.base import InlineRunner

SPEC = "scripts.bench_env:CalcLike"
CALL = re.compile(r"<call>([0-9+ ]+)</call>")


class CalcLike(Environment):
    """`<call>12 + 30</call>` -> `<result>42</result>`; a turn without a call ends the episode; `die`
    ends its worker (for the replacement timing)."""

    def step(self, text):
        if text == "die":
            os._exit(1)
        match = CALL.search(text)
        if match is None:
            return Step(None, {"tool": 1.0})
        return Step(f"<result>{sum(int(x) for x in match.group(1).split('+'))}</result>")


def rounds(runner, episodes: list[int], n: int) -> float:
    """Seconds per round of `step` over all episodes (after their reset)."""
    runner.reset(episodes, [{"i": e} for e in episodes])
    texts = [f"The sum: <call>{e} + {e * 7} + 12345</call>" for e in episodes]
    start = time.perf_counter()
    for _ in range(n):
        replies = runner.step(episodes, texts)
    seconds = (time.perf_counter() - start) / n
    assert [r.observation for r in replies] == [f"<result>{e + e * 7 + 12345}</result>" for e in episodes], replies
    runner.close(episodes)
    return seconds


# The start-cost comparison runs as its own script, written to a temporary file: a trainer's main module
# (python -m rlhf.ppo) imports torch at its top, and spawn / forkserver re-import the main module in each
# child, so the comparison's main must do the same (this file's top does not import torch).
START_SCRIPT = """
import multiprocessing as mp, statistics, subprocess, sys, time
import torch  # the trainer's imports, at the top of its main module

def child(conn):
    import rlhf.rl.environments.pool
    conn.send("ok")

def via_mp(ctx):
    a, b = ctx.Pipe()
    t = time.perf_counter()
    p = ctx.Process(target=child, args=(b,))
    p.start()
    a.recv()
    dt = time.perf_counter() - t
    p.join()
    return dt

def via_exec():
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import rlhf.rl.environments.pool"], check=True)
    return time.perf_counter() - t

if __name__ == "__main__":
    reps = int(sys.argv[1])
    spawn, forkserver = mp.get_context("spawn"), mp.get_context("forkserver")
    forkserver.set_forkserver_preload(["rlhf.rl.environments.pool"])
    via_mp(forkserver)  # the server's own start is not counted
    times = {"fork+exec": [], "spawn": [], "forkserver": []}
    for _ in range(reps):
        times["fork+exec"].append(via_exec())
        times["spawn"].append(via_mp(spawn))
        times["forkserver"].append(via_mp(forkserver))
    for name, ts in times.items():
        print(f"start {name:<10} {statistics.median(ts) * 1e3:8.0f} ms (median of {reps})")
"""


def compare_start(reps: int = 5) -> None:
    """Median time to start a child that imports the pool, from a main module that imports torch:
    fork+exec vs multiprocessing spawn vs forkserver."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trainer_like_main.py")
        with open(path, "w") as f:
            f.write(START_SCRIPT)
        subprocess.run([sys.executable, path, str(reps)], check=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--compare-start", action="store_true", help="also time fork+exec vs spawn vs forkserver")
    args = parser.parse_args()
    episodes = list(range(args.episodes))

    t0 = time.perf_counter()
    pools = {w: ProcessRunner(SPEC, w, timeout_s=10.0) for w in args.workers}
    start_s = (time.perf_counter() - t0) / len(pools)
    inline = InlineRunner(CalcLike)
    times: dict[str, list[float]] = {"inline": [], **{f"pool x{w}": [] for w in args.workers}}
    for _ in range(args.reps):
        times["inline"].append(rounds(inline, episodes, args.rounds))
        for w, pool in pools.items():
            times[f"pool x{w}"].append(rounds(pool, episodes, args.rounds))

    # replacement: a worker dies, the next call on a new episode waits for the fresh interpreter
    pool = pools[args.workers[0]]
    replace = []
    for i in range(3):
        pool.reset([10_000 + i], [{}])
        pool.step([10_000 + i], ["die"])
        t = time.perf_counter()
        pool.reset([20_000 + i], [{}])
        pool.step([20_000 + i], ["<call>1 + 1</call>"])
        replace.append(time.perf_counter() - t)
    for p in pools.values():
        p.shutdown()

    base = statistics.median(times["inline"])
    print(f"{args.episodes} episodes, {args.rounds} rounds x {args.reps} interleaved reps; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'runner':<10} {'ms/round':>9} {'calls/s':>10} {'x inline':>9} {'+ms/round':>10}")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:<10} {t * 1e3:9.3f} {args.episodes / t:10.0f} {t / base:9.2f} {(t - base) * 1e3:10.3f}")
    print(f"pool start: {start_s * 1e3:.0f} ms per pool (workers started in parallel); "
          f"a worker's replacement: {statistics.median(replace) * 1e3:.0f} ms (median of 3)")
    if args.compare_start:
        compare_start()


if __name__ == "__main__":
    main()
