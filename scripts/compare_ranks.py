"""One stage's command run in one process and under torchrun on N ranks, and its metrics compared step by step:
the same numbers to rounding, whatever the world size (the loss normalisation of issue #57; docs/stages.md,
the long-answer task). Exit 0 when every float of every record agrees within --rel/--abs and every other value
is equal, 1 otherwise; prints the largest relative difference per key.

    python scripts/compare_ranks.py --out runs/ranks --nproc 2 -- ppo algorithm=grpo actor.model=outputs/sft \
        critic.model=outputs/reward engine=zero3 engine.precision=fp32 engine.deterministic=true train.max_steps=2

The stage's arguments after `--` (the stage name, then Hydra overrides; output_dir is set per run: <out>/1 and
<out>/<nproc>). A run whose summary.json exists is read, not run again (delete its directory to measure it
again). Wall-clock and memory fields (`*_s`, `*time*`, `mem*`) are not compared; nor are the per-rank batching
counts (`*_micro_batches`, `*_computed_per_real`), which describe each rank's own micro-batches.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

PER_RANK = ("_micro_batches", "_computed_per_real")
SIGNIFICANT = 1e-3  # the relative differences printed are of values at least this large


def compared(key: str) -> bool:
    return not (key.endswith("_s") or "time" in key or key.startswith("mem") or key.endswith(PER_RANK))


def records(out: Path) -> list[dict]:
    with open(out / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r.get("kind") in ("train", "eval")]


def run(stage: str, overrides: list[str], out: Path, nproc: int) -> None:
    if (out / "summary.json").exists():
        return
    launch = [sys.executable, "-m", "rlhf." + stage] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "rlhf." + stage]
    cmd = [*launch, f"output_dir={out}", "train.overwrite=true", *overrides]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def compare(a: list[dict], b: list[dict], rel: float, abs_: float) -> tuple[dict[str, float], list[str]]:
    """(largest relative difference per float key, the differences beyond tolerance or in kind)."""
    worst: dict[str, float] = {}
    bad: list[str] = []
    if [(r["kind"], r["step"]) for r in a] != [(r["kind"], r["step"]) for r in b]:
        return worst, ["the runs logged different steps: " + str([(r["kind"], r["step"]) for r in a]) + " vs " +
                       str([(r["kind"], r["step"]) for r in b])]
    for x, y in zip(a, b):
        where = f"{x['kind']} step {x['step']}"
        for key in sorted(set(x) | set(y)):
            if not compared(key):
                continue
            if key not in x or key not in y:
                bad.append(f"{where}: {key} only in {'the 1-process run' if key in x else 'the torchrun run'}")
                continue
            u, v = x[key], y[key]
            if isinstance(u, float) or isinstance(v, float):
                if isinstance(u, (int, float)) and isinstance(v, (int, float)) and math.isfinite(u) and math.isfinite(v):
                    if max(abs(u), abs(v)) >= SIGNIFICANT:  # a relative difference of values near 0 is noise
                        worst[key] = max(worst.get(key, 0.0), abs(u - v) / max(abs(u), abs(v)))
                    if abs(u - v) > abs_ + rel * max(abs(u), abs(v)):
                        bad.append(f"{where}: {key} {u!r} vs {v!r}")
                elif not (u == v or (u != u and v != v)):
                    bad.append(f"{where}: {key} {u!r} vs {v!r}")
            elif u != v:
                bad.append(f"{where}: {key} {u!r} vs {v!r}")
    return worst, bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rel", type=float, default=1e-4, help="relative tolerance of a float (default 1e-4)")
    ap.add_argument("--abs", type=float, default=1e-6, help="absolute tolerance of a float (default 1e-6)")
    ap.add_argument("stage", nargs=argparse.REMAINDER, help="-- <stage> <overrides...>")
    args = ap.parse_args()
    rest = args.stage[1:] if args.stage[:1] == ["--"] else args.stage
    if not rest:
        ap.error("give the stage and its overrides after --, e.g. -- ppo algorithm=grpo ...")
    stage, overrides = rest[0], rest[1:]
    if any(o.startswith("output_dir=") for o in overrides):
        ap.error("output_dir is set per run (<out>/1, <out>/<nproc>): drop it")
    one, many = args.out / "1", args.out / str(args.nproc)
    for out, n in ((one, 1), (many, args.nproc)):
        run(stage, overrides, out, n)
    a, b = records(one), records(many)
    worst, bad = compare(a, b, args.rel, args.abs)
    steps = sorted({r["step"] for r in a if r["kind"] == "train"})
    print(f"{stage}: 1 process vs {args.nproc} ranks, {len(a)} records (train steps {steps}), "
          f"{len(worst)} float keys with values >= {SIGNIFICANT:g}")
    for key, d in sorted(worst.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {key:32s} largest relative difference {d:.2e}")
    print(f"  (relative differences of values >= {SIGNIFICANT:g}; every float is held to the tolerances below)")
    if bad:
        print(f"{len(bad)} differences beyond rel={args.rel:g}, abs={args.abs:g}:")
        for line in bad[:20]:
            print("  " + line)
        return 1
    print(f"equal to rel={args.rel:g}, abs={args.abs:g}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
