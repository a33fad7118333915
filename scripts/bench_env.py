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

With --step ACTOR (a tool-task SFT output, e.g. `TASK=tools bash scripts/run_all.sh`'s outputs/sft) it
measures the environment's share of a whole RL step instead: the tool task's RL stage (TOOLS_RL below, as
run_all.sh runs it) for --steps steps per run, once per --workers value and rep, interleaved, each a
`python -m rlhf.ppo` subprocess. Per step, from its metrics.jsonl record: the step = generation_s +
scoring_s + training_s; the environment's overhead = env_overhead_s (every second the episodes cost outside
the model's generate calls: the calculator's calls and the pool's round trips (env_s), inserting the
observations' ids, re-batching the open episodes, the chat-template check). The same step without the
environment is the step less that overhead: printed is step / (step - overhead) - 1, median and worst over
the steps after each run's first (warm-up), and the split of the step.

    python scripts/bench_env.py --step outputs/sft --steps 6 --reps 2 --workers 0 2
"""
from __future__ import annotations

import argparse
import json
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


# the tool task's RL stage: scripts/run_all.sh's TASK=tools PPO overrides (tests/test_multiturn.py checks them)
TOOLS_RL = ["algorithm=grpo", "data.path=data/tools/prompts_tools.jsonl", "data.eval_prompts_path=data/tools/eval_tools.jsonl",
            "reward.sources=[judge]", "rollout.env=rlhf.rl.environments.calculator:Calculator", "rollout.max_turns=3",
            "rollout.max_new_tokens=16", "rollout.max_episode_tokens=64"]


def step_overhead(actor: str, steps: int, reps: int, workers: list[int], work: str) -> None:
    """The environment's overhead as a fraction of the tool task's RL step (see the module docstring)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false"}
    per: dict[int, list[dict]] = {w: [] for w in workers}
    for rep in range(reps):
        for w in workers if rep % 2 == 0 else workers[::-1]:
            out = os.path.join(work, f"w{w}_rep{rep}")
            cmd = [sys.executable, "-m", "rlhf.ppo", f"output_dir={out}", f"actor.model={actor}", f"critic.model={actor}",
                   *TOOLS_RL, f"rollout.env_workers={w}", f"train.max_steps={steps}", "train.eval_every=0",
                   "train.save_every=0", "data.num_eval_prompts=8", "train.overwrite=true", f"seed={1234 + rep}"]
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
            with open(os.path.join(out, "metrics.jsonl")) as f:
                train = [r for r in map(json.loads, f) if r["kind"] == "train"]
            per[w] += train[1:]  # the first step is the warm-up
            print(f"  rep {rep}, rollout.env_workers={w}: {len(train)} steps", flush=True)
    print(f"the tool task's RL step with the calculator, from {actor}: {steps} steps x {reps} reps per row "
          f"(the first of each run left out); load average {os.getloadavg()[0]:.1f}")
    print(f"{'env_workers':>11} {'step s':>8} {'generate':>9} {'score':>7} {'train':>7} {'env calls':>10} "
          f"{'overhead':>9} {'tool calls':>10} {'+% median':>10} {'+% worst':>9}")
    for w, rows in per.items():
        step = [r["generation_s"] + r["scoring_s"] + r["training_s"] for r in rows]
        over = [r["env_overhead_s"] for r in rows]
        extra = [100 * (o / (s - o)) for s, o in zip(step, over)]
        med = statistics.median
        print(f"{w:>11} {med(step):8.3f} {med(r['generation_s'] for r in rows):9.3f} "
              f"{med(r['scoring_s'] for r in rows):7.3f} {med(r['training_s'] for r in rows):7.3f} "
              f"{med(r['env_s'] for r in rows):10.4f} {med(over):9.4f} {med(r['tool_calls'] for r in rows):10.2f} "
              f"{med(extra):10.2f} {max(extra):9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--compare-start", action="store_true", help="also time fork+exec vs spawn vs forkserver")
    parser.add_argument("--step", metavar="ACTOR", help="the environment's share of the tool task's RL step, from "
                        "this tool-task SFT output (--workers: rollout.env_workers values; default 0 2)")
    parser.add_argument("--steps", type=int, default=6, help="--step: RL steps per run")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "bench_env_step"),
                        help="--step: where the runs write")
    args = parser.parse_args()
    if args.step:
        workers = args.workers if args.workers != parser.get_default("workers") else [0, 2]
        step_overhead(args.step, args.steps, args.reps, workers, args.work)
        return
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
