"""The RL step against response length: step time and peak memory of GRPO at `--lengths` new tokens on a ~25M
Llama (CPU), each length in a fresh process, with the memory `python -m rlhf.plan` predicts beside it, and the
growth exponent of the step's cost in length.

    PYTHONPATH=. python scripts/bench_length.py                                  # 128 / 512 / 2048 tokens
    PYTHONPATH=. python scripts/bench_length.py --lengths 128 512 --rows 8 --json outputs/bench_length.json

1. Stage outputs built once in `--work` (scripts/bench_rl.py build_models): an SFT model and a reward model of one
   step each in the ~25M shape (hidden 512, 8 layers, 8 heads, 2 KV heads, MLP 1408, the shipped 4k vocabulary),
   with 4,096 positions.
2. Per length L: `python -m rlhf.ppo algorithm=grpo rollout.max_new_tokens=L` with `--rows` rows per step
   (`--rows / 4` prompts x 4 samples, one mini-batch), `--steps` steps (the first left out), `--extra` overrides
   added (e.g. rollout.micro_batch_size=2). Each step's generation_s, scoring_s and training_s come from its
   metrics.jsonl, the peak resident memory of each phase from mem_generation_peak_gib / mem_training_peak_gib
   (the process's VmHWM, reset at each phase's start).
3. The plan: `python -m rlhf.plan stage=ppo device=cpu` with the same overrides (rlhf/run/plan.py), its peak
   against the measured peak of the run, as plan / measured.
4. The growth exponent between consecutive lengths: log(t2 / t1) / log(L2 / L1) of the step's time (1 = linear).
Responses run to the full length where the model does not stop (a one-step SFT model of a 4k vocabulary rarely
samples EOS): the worst case of memory, which is what the plan predicts. Ratios are what a shared machine measures
well; absolute seconds move with its load.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from scripts.bench_rl import QUIET, SHAPE_25M, build_models  # noqa: E402


def overrides(sft: str, reward: str, length: int, rows: int, steps: int, extra: list[str]) -> list[str]:
    return [f"actor.model={sft}", f"critic.model={reward}", "algorithm=grpo", f"rollout.max_new_tokens={length}",
            f"rollout.prompts_per_step={rows // 4}", "rollout.n_samples_per_prompt=4", f"rollout.mini_batch_size={rows}",
            f"rollout.micro_batch_size={rows}", f"train.max_steps={steps}", *QUIET, *extra]


def measure(out: str, args: list[str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "rlhf.ppo", f"output_dir={out}", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if r.get("kind", r.get("split")) == "train" or "generation_s" in r]
    steps = [r for r in rows if "generation_s" in r][1:] or [r for r in rows if "generation_s" in r]
    peak = max(max(r.get("mem_generation_peak_gib", 0.0), r.get("mem_training_peak_gib", 0.0)) for r in rows)
    return {"step_s": statistics.median(r["generation_s"] + r["scoring_s"] + r["training_s"] for r in steps),
            **{k: statistics.median(r[k] for r in steps) for k in ("generation_s", "scoring_s", "training_s",
                                                                   "response_len")},
            "peak_gib": peak}


def planned(args: list[str]) -> dict:
    from rlhf.run import plan
    report, _ = plan.run_plan(["stage=ppo", "device=cpu", *args])
    return {"plan_peak_gib": report["peak_bytes"] / 2**30, "plan_phases_gib": {k: v / 2**30 for k, v in
                                                                               report["phases"].items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="outputs/bench_length")
    ap.add_argument("--lengths", nargs="+", type=int, default=[128, 512, 2048])
    ap.add_argument("--rows", type=int, default=8, help="rows per step (a multiple of 4: prompts x 4 samples)")
    ap.add_argument("--steps", type=int, default=2, help="RL steps per run (the first left out when there are more)")
    ap.add_argument("--extra", nargs="*", default=[], help="more rlhf.ppo overrides for every run")
    ap.add_argument("--json")
    a = ap.parse_args()
    work = os.path.abspath(a.work)
    # a context long enough for the longest response (the shipped shape's is 128 positions)
    sft, reward = build_models(os.path.join(work, "25m_long"), [*SHAPE_25M, "model.config.max_position_embeddings=4096"])
    sft, reward = os.path.join(sft, "model"), os.path.join(reward, "model")
    results = []
    print("| new tokens | mean length | step s | generation s | scoring s | training s | peak GiB | plan GiB | "
          "plan / peak | exponent |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for length in a.lengths:
        args = overrides(sft, reward, length, a.rows, a.steps, a.extra)
        row = {"new_tokens": length, **measure(os.path.join(work, f"len{length}"), args), **planned(args)}
        if results:
            prev = results[-1]
            row["exponent"] = math.log(row["step_s"] / prev["step_s"]) / math.log(length / prev["new_tokens"])
        results.append(row)
        print(f"| {length} | {row['response_len']:.0f} | {row['step_s']:.1f} | {row['generation_s']:.1f} | "
              f"{row['scoring_s']:.1f} | {row['training_s']:.1f} | {row['peak_gib']:.2f} | {row['plan_peak_gib']:.2f} | "
              f"{row['plan_peak_gib'] / row['peak_gib']:.2f} | {row.get('exponent', float('nan')):.2f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
