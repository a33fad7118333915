"""Asynchronous RL on split ranks (1 generation + 1 training rank) against the synchronous run on 2 colocated
ranks: the same seed, prompts and number of samples trained; steps per second and the final gold score, per
seed, the runs interleaved (sync, async, sync, async, ...).

    python scripts/bench_async.py --actor outputs/sft --seeds 1234 1 2 --steps 12
    python scripts/bench_async.py --actor outputs/sft --seeds 1234 --steps 2 --extra data.num_eval_prompts=16

Each run: `torchrun --nproc_per_node 2 -m rlhf.ppo algorithm=grpo reward.sources=[judge]` (critic-free, the
gold judge as the reward) with `actor.model`, `train.max_steps`, `seed`; async adds engine.placement=split
rollout.mode=async rollout.max_staleness=1 ppo.is_correction=tis. Step time: the median over the steps but the
first of the loop's phases (generation_s + scoring_s + training_s: in async mode generation_s is the trainer's
wait for the rollout); gold: summary.json gold_score_after. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ASYNC = ["engine.placement=split", "rollout.mode=async", "rollout.max_staleness=1", "ppo.is_correction=tis"]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def one(actor: str, seed: int, steps: int, extra: list[str], mode: str, out: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", free_port(), "-m", "rlhf.ppo", f"output_dir={out}", "train.overwrite=true",
           f"actor.model={actor}", "algorithm=grpo", "reward.sources=[judge]", f"train.max_steps={steps}",
           f"seed={seed}", "train.save_every=0", "train.eval_every=0", *extra, *(ASYNC if mode == "async" else [])]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{mode} seed {seed} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        train = [r for r in map(json.loads, f) if r["kind"] == "train"]
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    rows = train[1:] or train
    step_s = statistics.median(r["generation_s"] + r["scoring_s"] + r["training_s"] for r in rows)
    phases = {k: statistics.median(r[k] for r in rows) for k in ("generation_s", "scoring_s", "training_s", "sampler_s")
              if all(k in r for r in rows)}  # sampler_s: the generation rank's own time per rollout (async)
    return {"mode": mode, "seed": seed, "step_s": step_s, "steps_per_s": 1 / step_s, "phases": phases,
            "gold_before": s.get("gold_score_before"), "gold_after": s.get("gold_score_after"),
            "staleness_counts": s.get("staleness_counts"), "weights_gb_per_s": s.get("weights_gb_per_s"),
            "samples": len(train) * s["samples_per_step"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--actor", default="outputs/sft")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for both runs")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in a.seeds:
            for mode in ("sync", "async"):
                rows.append(one(os.path.abspath(a.actor), seed, a.steps, a.extra, mode, os.path.join(tmp, f"{mode}_{seed}")))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    by = {(r["mode"], r["seed"]): r for r in rows}
    speed = [by["async", s]["steps_per_s"] / by["sync", s]["steps_per_s"] for s in a.seeds]
    gold = [by["async", s]["gold_after"] - by["sync", s]["gold_after"] for s in a.seeds
            if by["async", s]["gold_after"] is not None]
    out = {"runs": rows, "speedup_per_seed": speed, "speedup_median": statistics.median(speed),
           "gold_async_minus_sync": gold, "gold_diff_mean": statistics.mean(gold) if gold else None,
           "load_average": os.getloadavg()}
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
