#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run that fits a short lease (about 9 minutes on one H100):
#   1. the GPU test lane, `pytest -m gpu`: the Triton kernels on the device against their PyTorch
#      references, CUDA-graph decode against eager and transformers, bf16 logits/greedy agreement, and
#      every stage on CUDA (tests/test_gpu_stages.py);
#   2. scripts/bench_generation.py: the injected path (weight refresh included) vs `transformers.generate`
#      on the ~25M Llama shape of issue #31 (batch 64, prompt 64, 128 new tokens, bf16) and a 1.2B Llama;
#   3. scripts/bench_kernels.py: fused log-probs, a train step and the PPO scoring pass, kernels on vs off;
#   4. scripts/bench_rl.py: the default GRPO and PPO steps phase by phase against a baseline tree, with the
#      matmul limit and the step's achieved FLOP rate on the ~25M shape;
#   5. (GPU_PARTS=vllm, where vLLM's CUDA wheel is installed) the vLLM lane and vLLM's generation benchmark;
#   6. (GPU_PARTS=memory) scripts/bench_length.py on the GPU: the GRPO step's peak (torch.cuda.max_memory_allocated)
#      at 128 / 512 / 2048 new tokens, every response full, against `python -m rlhf.plan device=cuda`, each run
#      traced by scripts/cuda_peak.py (what was live at the peak); about 2.5 minutes on an H200.
# Each part has its own time limit and writes its log to $OUT (or ./gpu_checks when OUT is unset); a part
# that fails does not stop the next. Usage, from the repository root on the GPU machine:
#     bash scripts/gpu_checks.sh [baseline]      # baseline: a commit (needs git) or a directory holding one
# The Python packages the machine lacks are installed first from .whl/ when it is there
# (bash ../shared/gpu/wheels.sh makes it).
set -uo pipefail
out=${OUT:-gpu_checks}
mkdir -p "$out"
base=${1:-none}
parts=${GPU_PARTS:-tests generation rl kernels}  # which parts, in order (stages: the stage test files on CUDA)
want() { [[ " $parts " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD HYDRA_FULL_ERROR=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>&1 | tail -3
fi
part() {  # part NAME SECONDS command...: run with a limit, log to $out/NAME.log, report status and time
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$out/summary.txt"
  tail -n "${TAILN:-25}" "$out/$name.log"
}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, triton, peft; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__, 'peft', peft.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$out/summary.txt"
want tests && TAILN=40 part tests 200 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu -rs tests/
want generation && part generation 110 python3 scripts/bench_generation.py --shapes llama-25m llama-1.2b --batch 64 --prompt 64 \
  --new 128 --repeat 3 --out "$out/bench_generation.json"
want rl && TAILN=30 part rl 210 python3 scripts/bench_rl.py --baseline "$base" --reps 2 --steps 8 --work /tmp/bench_rl \
  --json "$out/bench_rl.json"
want kernels && part kernels 60 python3 scripts/bench_kernels.py --steps 3 --out "$out/bench_kernels.json"
# the stage test files with CUDA present (the stages then train and generate on the GPU): device
# mix-ups and CUDA-only failures (RLHF_TESTS_CUDA=1: these tests assert CPU facts too, so read the
# failures one by one); SIGINT at the limit so that pytest still prints what failed
want stages && RLHF_TESTS_CUDA=1 TAILN=60 part stages 240 timeout -s INT 230 python3 -m pytest -q -p no:cacheprovider -n 14 \
  -rfE --tb=short tests/test_kernels_logprobs.py tests/test_kernel_injection.py tests/test_ppo.py \
  tests/test_rl_algorithms.py tests/test_sft.py tests/test_reward.py tests/test_dpo.py tests/test_old_logprobs.py \
  tests/test_sampler_gap.py tests/test_generation_mode.py tests/test_policy_losses.py tests/test_evaluate.py \
  tests/test_online_dpo.py tests/test_distill.py tests/test_kto.py tests/test_reward_ensemble.py
want memory && TAILN=60 part memory 240 python3 scripts/bench_length.py --lengths 128 512 2048 --ways rows --full \
  --steps 3 --trace --work /tmp/bench_length_gpu --json "$out/bench_length_gpu.json"
# the vLLM lane on CUDA (vLLM's CUDA wheel installed: pip install -e ".[vllm]"; too large to carry as .whl/ onto a
# lent machine, so it runs where vLLM is installed) and the generation benchmark with vLLM at 1.2B, 512 and 2048
# new tokens, rows ending between 10% and 100% of the budget; parts: vllm
if want vllm; then
  if python3 -c "import vllm" 2>/dev/null; then
    RLHF_TESTS_CUDA=1 TAILN=40 part vllm 300 python3 -m pytest -q -p no:cacheprovider -rfE tests/vllm_lane
    part vllm_bench 280 python3 scripts/bench_generation.py --shapes llama-1.2b --batch 64 --prompt 64 --new 512 2048 \
      --eos-spread --vllm --repeat 1 --out "$out/bench_vllm.json"
  else
    echo "== vllm: not run: vLLM is not installed on this machine (pip install -e \".[vllm]\")" | tee -a "$out/summary.txt"
  fi
fi
cat "$out/summary.txt"
