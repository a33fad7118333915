"""The RL stage's algorithms side by side from one SFT (and reward) output: a markdown table of gold
score before/after, KL, wall time and time per step, one row per command (the table of docs/algorithms.md).

    python scripts/compare_rl.py --sft outputs/sft --reward outputs/reward --out runs/compare [--rows grpo_judge,...]

Each row is one `python -m rlhf.ppo` run into <out>/<row>; a row whose summary.json exists is read,
not run again (delete the directory to measure it again). Writes <out>/compare.md and prints it.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

# row -> (algorithm, reward source, extra overrides); every row samples 64 responses per step
ROWS = {
    "ppo_rm": ("ppo", "reward model", ["ppo.kl_coef=0.3"]),
    "grpo_rm": ("grpo", "reward model", []),
    "grpo_judge": ("grpo", "judge", ["reward.sources=[judge]"]),
    "rloo_judge": ("rloo", "judge", ["reward.sources=[judge]"]),
    "reinforce_pp_judge": ("reinforce_pp", "judge", ["reward.sources=[judge]"]),
}


def command(row: str, sft: str, reward: str, out: str, extra: list[str]) -> list[str]:
    algo, source, over = ROWS[row]
    models = [f"actor.model={sft}"] + ([f"critic.model={reward}"] if source == "reward model" or algo == "ppo" else [])
    return [sys.executable, "-m", "rlhf.ppo", f"algorithm={algo}", *models, f"output_dir={out}", *over, *extra]


def figures(out: str) -> dict:
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    steps = s.get("steps") or 1
    return {"gold_before": s.get("gold_score_before"), "gold_after": s.get("gold_score_after"), "kl": s.get("kl"),
            "time_s": s.get("time_s"), "step_s": sum(s.get(f"step_{k}_s", 0.0) for k in ("generation", "scoring",
                                                                                         "training")),
            "steps": steps}


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", required=True)
    ap.add_argument("--reward", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("extra", nargs="*", help="overrides added to every row (e.g. seed=1)")
    args = ap.parse_args()
    lines = ["| algorithm | reward | gold before | gold after | KL | wall time (s) | s / step | command |",
             "|---|---|---|---|---|---|---|---|"]
    for row in args.rows.split(","):
        out = os.path.join(args.out, row)
        cmd = command(row, args.sft, args.reward, out, args.extra)
        if not os.path.exists(os.path.join(out, "summary.json")):
            t0 = time.time()
            proc = subprocess.run(cmd + ["train.overwrite=true"], capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{row} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            print(f"{row}: {time.time() - t0:.0f} s", file=sys.stderr)
        f = figures(out)
        algo, source, _ = ROWS[row]
        shown = "python -m rlhf.ppo " + " ".join(shlex.quote(a) for a in cmd[3:])
        lines.append(f"| {algo} | {source} | {fmt(f['gold_before'], '.1f')} | {fmt(f['gold_after'], '.1f')} | "
                     f"{fmt(f['kl'], '.3f')} | {fmt(f['time_s'], '.0f')} | {fmt(f['step_s'], '.2f')} | `{shown}` |")
    text = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
