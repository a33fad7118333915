#!/usr/bin/env bash
# The GRPO step of this tree against an earlier commit, in one run: scripts/bench_rl.py with the commit checked
# out into a temporary git worktree (the same venv, PYTHONPATH at each tree), one run per tree and round, the
# order alternating between rounds (A B, B A, ...), medians of the steps after each run's first; prints the
# step-time ratio (commit / this tree: > 1 = this tree faster) and each phase's.
#
#   bash scripts/bench_vs_commit.sh c537a8b
#   REPS=3 STEPS=4 bash scripts/bench_vs_commit.sh c537a8b -- rollout.temperature=0.8
#   BASELINE_OVERRIDES=engine.generation=hf bash scripts/bench_vs_commit.sh c537a8b
#   GENERATION=hf THIS_OVERRIDES=rollout.micro_batch_tokens=1408 bash scripts/bench_vs_commit.sh c537a8b
#
# Defaults: the ~25M-parameter Llama shape (SHAPE=25m; bench_rl.py --shape), algorithm=grpo (8 prompts x 8
# samples), NEW_TOKENS=128 new tokens whose EOS falls uniformly between 10% and 100% of them (bench_rl.py
# --eos-spread, the same rule in both trees), GENERATION=injected (engine.generation; CPU's auto is
# transformers), REPS=2 rounds of STEPS=3 steps, CLOCK=cpu: each phase in the process's CPU seconds, one thread
# (OMP_NUM_THREADS=1), which other jobs on a shared machine barely move (CLOCK=wall: seconds, the default
# threads). BASELINE_OVERRIDES / THIS_OVERRIDES: overrides for the commit's / this tree's runs only
# (space-separated: keys the commit does not have yet go in THIS_OVERRIDES). Extra overrides after
# `--` go to both. Stage outputs and the JSON report: outputs/bench_vs_commit/.
set -euo pipefail
commit=${1:?usage: bash scripts/bench_vs_commit.sh COMMIT [-- overrides]}
shift
if [ "${1:-}" = "--" ]; then shift; fi
root=$(cd "$(dirname "$0")/.." && pwd)
work=$root/outputs/bench_vs_commit
json=$work/vs_$commit.json
mkdir -p "$work"
clock=${CLOCK:-cpu}
if [ "$clock" = cpu ]; then export OMP_NUM_THREADS=1; fi
cd "$root"
PYTHONPATH=$root python scripts/bench_rl.py --baseline "$commit" --algos grpo --shape "${SHAPE:-25m}" --eos-spread \
    --reps "${REPS:-2}" --steps "${STEPS:-3}" --clock "$clock" --flops-model none --work "$work" --json "$json" \
    --baseline-overrides "${BASELINE_OVERRIDES:-}" --this-overrides "${THIS_OVERRIDES:-}" -- \
    "rollout.max_new_tokens=${NEW_TOKENS:-128}" "engine.generation=${GENERATION:-injected}" "$@"
python - "$json" "$commit" "$clock" <<'PY'
import json
import sys

path, commit, clock = sys.argv[1:]
unit = "CPU s" if clock == "cpu" else "s"
med = json.load(open(path))["medians"]
this, base = med["grpo/this"], med["grpo/baseline"]
print(f"\nGRPO step: {commit} {base['step']:.3f} {unit}, this tree {this['step']:.3f} {unit} (medians); "
      f"{commit} / this = {base['step'] / this['step']:.2f}x")
print("per phase (" + commit + " / this): " + ", ".join(
    f"{p} {base[p] / this[p]:.2f}x" for p in ("generate", "score", "advantages", "update", "overhead") if this[p] > 0))
PY
