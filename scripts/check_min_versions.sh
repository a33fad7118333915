#!/usr/bin/env bash
# Install the minimum versions (constraints-min.txt, = pyproject.toml's lower bounds) into a scratch venv
# and run the smoke subset with them: the check behind those lower bounds.
#
#   bash scripts/check_min_versions.sh                 # venv in /tmp/minvenv (reused if it is there)
#   VENV=/tmp/v FRESH=1 bash scripts/check_min_versions.sh
#   QUICK=1 bash scripts/check_min_versions.sh         # skip the smoke pipeline (the pytest subset only)
#
# Needs PyPI (or a mirror). Binary wheels only, except antlr4-python3-runtime (hydra-core's dependency,
# published as a source archive). torch==2.13.0 resolves to a CPU build where one is on pip's find-links.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-/tmp/minvenv}"
if [ "${FRESH:-0}" = 1 ]; then rm -rf "$VENV"; fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
mapfile -t PINS < <(grep -v '^#' constraints-min.txt | grep -v '^$' | grep -v '^vllm==')  # vllm: see the file
"$PY" -m pip install -q --only-binary=:all: --no-binary=antlr4-python3-runtime "${PINS[@]}"
"$PY" -m pip list 2>/dev/null | grep -iE '^(torch|transformers|datasets|peft|hydra-core|wandb|tqdm|matplotlib|pyarrow|pytest|triton|numpy|tokenizers|huggingface.hub|omegaconf) '

export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
# the declared bounds match the pins, and the installed set satisfies pyproject.toml
"$PY" -m pytest -q tests/test_versions.py
# tokenizer, data, SFT and the reward model / PPO stage apps; plots and report; a Triton kernel in the interpreter
"$PY" -m pytest -q tests/test_foundation.py tests/test_sft.py tests/test_report.py -k "not torchrun"
"$PY" -m pytest -q tests/test_kernels_swiglu.py -k "not gpu"
# wandb, offline (the tests log with logger=local, which never imports it)
"$PY" - <<'PY'
import tempfile, wandb
run = wandb.init(project="min-versions", mode="offline", dir=tempfile.mkdtemp())
run.log({"x": 1.0}); run.finish()
print("wandb offline run: ok")
PY
if [ "${QUICK:-0}" != 1 ]; then
  out="$(mktemp -d)"
  PATH="$VENV/bin:$PATH" WANDB_MODE=disabled PRESET=smoke OUTPUT_DIR="$out" bash scripts/run_all.sh
fi
echo "check_min_versions: all passed with $(grep -v '^#' constraints-min.txt | grep -v '^$' | tr '\n' ' ')"
