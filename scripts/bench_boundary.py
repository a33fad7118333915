"""The cost of the weight check on every switch to generation (`engine.check_weights`), in one run.

    PYTHONPATH=. python scripts/bench_boundary.py                     # PPO default, 2 rounds x 3 steps (docs/engine.md)
    PYTHONPATH=. python scripts/bench_boundary.py --reps 3 --steps 4 --paths auto,injected

1. Stage runs: `python -m rlhf.ppo` on the default config (the tiny model, the shipped data), from an
   SFT and a reward model of a few steps built once in `--work` (their learning does not matter to
   the timing), with `engine.check_weights=never` and `every` in turn (interleaved, `--reps` rounds,
   so machine load hits both alike), for each `engine.generation` of `--paths` (auto: the default;
   on CPU that is transformers generate on the training module itself at stage 0, where the check has
   nothing to compare; injected: the fused slots, where it fingerprints every tensor). Per-step time
   = generation_s + scoring_s + training_s of metrics.jsonl, median over the steps and rounds; the
   ratio every / never is reported.
2. The check alone, in this process: a TrainEngine over the same actor (the SFT model), entering and
   leaving `generation()` with `never` and `every` interleaved (`--enters` times each); the median
   difference is the check's cost, reported also as a fraction of the stage's median step (never).
The second figure is the precise one: on a shared machine the stage runs' noise (a few %) is larger
than the check's cost.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from engine import EngineConfig, OptimConfig, TrainEngine, init_distributed  # noqa: E402
from engine.config import resolve_precision  # noqa: E402

QUIET = ["train.eval_every=0", "train.save_every=0", "data.num_eval_prompts=4"]


def stage(module: str, out: str, *overrides: str) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", f"rlhf.{module}", f"output_dir={out}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")


def step_times(out: str) -> list[float]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["generation_s"] + r["scoring_s"] + r["training_s"] for r in rows if r.get("kind") == "train"]


def check_alone(model_dir: str, path: str, enters: int) -> tuple[float, float]:
    """(median seconds of a generation() enter+exit with check_weights=never, median extra with every)."""
    from transformers import AutoModelForCausalLM

    info = init_distributed()
    engines = {}
    for mode in ("never", "every"):
        cfg = resolve_precision(EngineConfig(generation=path, check_weights=mode), info.device)
        engines[mode] = TrainEngine(AutoModelForCausalLM.from_pretrained(model_dir), cfg, OptimConfig(),
                                    total_steps=1, info=info)
    times: dict[str, list[float]] = {"never": [], "every": []}
    for i in range(enters + 1):
        for mode, engine in engines.items():
            start = time.perf_counter()
            with engine.generation():
                pass
            if i:  # the first entry builds the injected model
                times[mode].append(time.perf_counter() - start)
    never = statistics.median(times["never"])
    extra = statistics.median([e - n for e, n in zip(times["every"], times["never"])])
    return never, extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="outputs/bench_boundary", help="stage outputs (SFT/reward built once)")
    ap.add_argument("--reps", type=int, default=2, help="interleaved rounds of never/every stage runs")
    ap.add_argument("--steps", type=int, default=3, help="PPO steps per stage run")
    ap.add_argument("--paths", default="auto,injected", help="engine.generation values to measure")
    ap.add_argument("--enters", type=int, default=20, help="generation() entries per mode for the check alone")
    args = ap.parse_args()
    work = os.path.abspath(args.work)
    sft, reward = os.path.join(work, "sft"), os.path.join(work, "reward")
    if not os.path.exists(os.path.join(sft, "summary.json")):
        stage("sft", sft, "train.max_steps=2", *QUIET)
    if not os.path.exists(os.path.join(reward, "summary.json")):
        stage("reward", reward, f"model.name_or_path={sft}", "train.max_steps=1", *QUIET)
    rows = []
    for path in args.paths.split(","):
        steps: dict[str, list[float]] = {"never": [], "every": []}
        for rep in range(args.reps):
            for mode in ("never", "every") if rep % 2 == 0 else ("every", "never"):
                out = os.path.join(work, f"ppo_{path}_{mode}_{rep}")
                stage("ppo", out, f"actor.model={sft}", f"critic.model={reward}", f"train.max_steps={args.steps}",
                      f"engine.generation={path}", f"engine.check_weights={mode}", *QUIET)
                steps[mode] += step_times(out)
                print(f"  {path:9s} {mode:5s} round {rep}: steps {[round(s, 2) for s in step_times(out)]}", flush=True)
        never, every = statistics.median(steps["never"]), statistics.median(steps["every"])
        enter, extra = check_alone(os.path.join(sft, "model"), path, args.enters)
        rows.append((path, never, every, every / never, enter, extra, extra / never))
    print(f"\nPPO default, {args.reps} rounds x {args.steps} steps per mode, device "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}:")
    print(f"{'path':9s} {'step never s':>13s} {'step every s':>13s} {'every/never':>12s} {'enter s':>9s} "
          f"{'check s':>9s} {'check/step':>11s}")
    for path, never, every, ratio, enter, extra, frac in rows:
        print(f"{path:9s} {never:13.3f} {every:13.3f} {ratio:12.4f} {enter:9.4f} {extra:9.4f} {100 * frac:10.3f}%")


if __name__ == "__main__":
    main()
