"""Every command that README.md, docs/*.md and the scripts' headers show, run at smoke size (issue #18:
a documented command that fails on the defaults is a bug).

The commands are read from the files (the ```bash blocks of README.md and docs/*.md, the comment header of
scripts/run_all.sh, the module docstrings of scripts/*.py), so a command added there is run here too,
or must be listed in NOT_RUN with the reason. Each runs as written plus, per kind, only what makes it
small and local:

- placeholders become local stand-ins (SUBST: /models/... -> a tiny OPT directory with its own
  tokenizer, hub datasets -> the shipped pairs, my_*.jsonl / ds_*.json / mypkg -> files written here);
- a stage command (`python -m rlhf.<stage>`, `torchrun ... -m rlhf.<stage>`) runs in a workspace
  whose outputs/sft, outputs/reward, outputs/ppo, outputs/dpo a tiny pipeline made, into its own
  output_dir unless it names one, with the stage's smoke overrides for keys it does not set;
- a `scripts/run_all.sh` command gets PRESET=smoke, a small model, and an OUTPUT_DIR under the workspace.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys

import pytest

import forkserver
from conftest import ROOT, SMALL_MODEL, cli_env, run_stage, summary

pytestmark = pytest.mark.slow

OWN_MODEL = "tests/test_user_model.py::test_readme_own_model_commands_run runs the block in order, checking each output"
# Commands shown but not run here, and why.
NOT_RUN = {
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 --index-url "
    "https://download.pytorch.org/whl/cpu && pip install -e \".[test]\" "
    "&& bash scripts/run_all.sh": "installs packages; its last command, bash scripts/run_all.sh, is run",
    "python -m pytest -q -n 2 --dist loadfile": "the test suite itself",
    "python -m rlhf.ppo actor.model=outputs/sft algorithm=grpo ppo.kl_loss_coef=0.4 ppo.adaptive_kl=true "
    "ppo.kl_target=0.3 ppo.kl_horizon=64 ppo.kl_coef_min=null train.kl_budget=0.5 rollout.prompts_per_step=16 "
    "rollout.temperature=1.2 reward.sources=[judge] ppo.old_logprobs=recompute engine.generation=vllm": "a measurement "
    "in the vLLM venv (docs/engine.md's table); tests/vllm_lane runs GRPO on vLLM at smoke size, via tests/test_vllm_lane.py",
    ". .venv-vllm/bin/activate": "the vLLM venv (scripts/vllm_cpu_venv.sh), which tests/test_vllm_lane.py builds and runs in",
    "python -m rlhf.ppo algorithm=grpo engine.generation=vllm": "needs vLLM (its own venv): tests/vllm_lane/"
    "test_vllm_rollout.py::test_grpo_on_vllm_samples_under_the_trainers_distribution runs it, via tests/test_vllm_lane.py",
    "torchrun --nproc_per_node 2 -m rlhf.ppo algorithm=grpo engine=zero3 engine.generation=vllm": "needs vLLM (its own "
    "venv): tests/vllm_lane/test_vllm_rollout.py::test_grpo_on_vllm_two_gloo_ranks_zero3 runs it, via tests/test_vllm_lane.py",
    "python scripts/compare_ranks.py --out runs/ranks_long --nproc 2 -- ppo algorithm=grpo actor.model=outputs/sft "
    "critic.model=outputs/reward data.path=data/long/prompts_train.jsonl data.eval_prompts_path=data/long/eval_prompts.jsonl "
    "data.num_eval_prompts=8 eval.max_new_tokens=448 rollout.max_new_tokens=448 ppo.overlong_buffer=40 "
    "ppo.overlong_penalty=1.0 ppo.kl_loss_coef=0.4 rollout.prompts_per_step=4 rollout.temperature=1.2 actor.lr=2e-4 "
    "train.max_steps=2 train.eval_every=2 train.save_every=0 rollout.micro_batch_tokens=2048 engine=zero3 "
    "engine.precision=fp32 engine.deterministic=true seed=1": "the long task's measurement (docs/stages.md), on "
    "TASK=long's SFT and reward outputs; the script's docstring command runs here at smoke size",
    "pip install .": "installs the package: tests/test_install.py builds the wheel, installs it into a fresh venv "
                     "and runs the stages from an empty directory",
    "python scripts/bench_generation.py": "GPU benchmark (its --small form is run)",
    "PYTHONPATH=. python scripts/bench_length.py --lengths 256 --ways rows --steps 8 --small --heap --work "
    "outputs/bench_small_cache": "8 GRPO steps at 256 new tokens under the heap probe (minutes); the script's "
    "--small --heap smoke form runs",
    "PYTHONPATH=. python scripts/bench_length.py --lengths 512 --ways rows --steps 6 --work outputs/bench_cache512 "
    "--extra engine.cpu_kernel_cache=null": "six GRPO steps at 512 new tokens on a ~25M model (minutes)",
    "PYTHONPATH=. python scripts/bench_length.py --lengths 512 --ways rows --steps 6 --work outputs/bench_cache512":
    "six GRPO steps at 512 new tokens on a ~25M model (minutes)",
    "PYTHONPATH=. python scripts/bench_length.py --lengths 2048 --ways rows --steps 3 --work outputs/bench_length_2048":
    "three GRPO steps at 2,048 new tokens on a ~25M model (half an hour)",
    "python scripts/bench_length.py --lengths 128 512 2048 --ways rows --full --steps 3 --trace --work "
    "/tmp/bench_length_gpu": "GPU only (--trace records the CUDA allocator's history): scripts/gpu_checks.sh's memory "
    "part; the same script's --small forms run here",
    "python scripts/heap_probe.py --out /tmp/heap.jsonl -- scripts/bench_rl.py --worker --tree . --result "
    "/tmp/r.json -- output_dir=/tmp/run algorithm=grpo": "a whole default GRPO run under the probe; scripts/"
    "bench_length.py's --small --heap smoke form runs it on tiny runs",
    "python scripts/cuda_peak.py --out outputs/cuda_peak -- scripts/bench_rl.py --worker --tree . --result /tmp/r.json "
    "-- output_dir=/tmp/run algorithm=grpo": "GPU only (the CUDA allocator's history); tests/test_cuda_peak.py checks "
    "its replay of a trace",
    "python scripts/bench_async.py --actor outputs/sft --seeds 1234 1 2 --steps 12": "six torchrun PPO runs, a "
    "measurement (docs/engine.md); tests/test_split.py runs both modes, and the script's 2-step form is run",
    "python scripts/bench_generation.py --device cpu --dtype fp32 --shapes llama-25m --batch 64 --prompt 64 --new 128 "
    "--repeat 3": "a CPU benchmark of tens of minutes on 2 cores (its --small form is run)",
    "python scripts/bench_generation.py --device cpu --dtype fp32 --shapes llama-25m --batch 64 --prompt 64 --new 128 512 "
    "--eos-spread --vllm --repeat 1": "needs vLLM (its own venv) and tens of minutes on 2 cores; the vLLM lane's "
    "venv runs the measurement (docs/engine.md), its --small form is run",
    "OMP_NUM_THREADS=1 python scripts/bench_generation.py --device cpu --dtype fp32 --shapes llama-25m --batch 64 "
    "--prompt 64 --new 128 --eos-spread --compaction --repeat 2": "a CPU benchmark of tens of minutes on 2 cores "
    "(its --small --compaction form is run; tests/test_compaction.py checks the compaction on values)",
    "OMP_NUM_THREADS=1 python scripts/bench_generation.py --device cpu --dtype fp32 --shapes llama-25m --batch 64 "
    "--prompt 64 --new 512 --eos-spread --compaction --no-hf --repeat 1": "a CPU benchmark of tens of minutes on 2 "
    "cores (its --small --compaction form is run)",
    "bash scripts/bench_vs_commit.sh c537a8b": "GRPO stage runs of two trees at the ~25M shape, tens of minutes: "
    "scripts/bench_rl.py with --baseline, whose smoke form tests/test_bench_rl.py runs (and checks its --eos-spread "
    "rule on values)",
    "REPS=2 STEPS=3 bash scripts/bench_vs_commit.sh c537a8b": "as bash scripts/bench_vs_commit.sh c537a8b",
    "BASELINE_OVERRIDES=engine.generation=hf REPS=2 STEPS=3 bash scripts/bench_vs_commit.sh c537a8b": "as bash "
    "scripts/bench_vs_commit.sh c537a8b",
    "python scripts/bench_kernels.py": "GPU benchmark (its --small form is run)",
    "python scripts/bench_memory.py model=llama model.name_or_path=/models/Llama-3.2-1B engine=zero3 "
    "train.micro_batch_size=8 data.max_len=512": "a real training step of a 1.2B model (GPU benchmark); its plain "
                                                 "form (the tiny default) is run",
    "PYTHONPATH=. python scripts/bench_budget.py --max-new-tokens 128 512 --reps 2": "minutes of a ~25M-parameter "
        "model's GRPO scoring and update; its --small form (the script's header) is run",
    "PYTHONPATH=. python scripts/bench_rl.py --reps 3 --steps 5": "a benchmark of whole stage runs against a baseline "
                                                                  "checkout; its smoke form is run by tests/test_bench_rl.py",
    "OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/bench_rl.py --profile outputs/bench_rl/profile.txt --steps 4 "
    "--clock cpu": "profiles whole stage runs; tests/test_bench_rl.py checks its Profiler's tables on values",
    "python scripts/bench_rl.py --baseline none --steps 2 --reps 1 --algos grpo --small --flops-model none":
        "tests/test_bench_rl.py runs it (checking the phases and the counted FLOPs on values)",
    "PYTHONPATH=. python scripts/bench_length.py": "GRPO runs at 128 / 512 / 2048 new tokens on a ~25M model, an hour on "
                                                   "2 cores (docs/algorithms.md's table); its --small form is run",
    "PYTHONPATH=. python scripts/bench_length.py --lengths 2048 --ways rows --full --work outputs/bench_length_full":
        "a GRPO run at 2,048 new tokens on a ~25M model, 20 minutes on 2 cores; its --small --full form is run",
    "PYTHONPATH=. python scripts/bench_length.py --lengths 2048 --ways rows --full --steps 1 --work "
    "outputs/bench_length_full --variants engine.cpu_mmap_threshold_mb=null engine.cpu_mmap_threshold_mb=16 "
    "engine.cpu_mmap_threshold_mb=4": "three GRPO runs at 2,048 new tokens on a ~25M model, 25 minutes on 2 cores; its "
                                      "--small --full --variants form is run",
    "PYTHONPATH=. python scripts/bench_length.py --lengths 512 --ways rows --full --steps 2 --work outputs/bench_trim "
    "--variants engine.cpu_trim_heap=false engine.cpu_trim_heap=true": "two GRPO runs at 512 new tokens on a ~25M model, "
                                                                       "6 minutes on 2 cores; its --small form is run",
    "PYTHONPATH=. python scripts/bench_length.py --lengths 128 512 --ways rows --full --steps 2 --work "
    "outputs/bench_alloc_default --variants engine.cpu_mmap_threshold_mb=16 engine.cpu_mmap_threshold_mb=null":
        "four GRPO runs at 128 and 512 new tokens on a ~25M model, 7 minutes on 2 cores; its --small form is run",
    "PYTHONPATH=. python scripts/bench_length.py --lengths 2048 --ways rows --work outputs/bench_length_2048":
        "two GRPO steps at 2,048 new tokens on a ~25M model, 10 minutes on 2 cores; its --small form is run",
    "PYTHONPATH=. python scripts/bench_length.py --lengths 512 --ways rows --steps 4 --work outputs/bench_diag512":
        "four GRPO steps at 512 new tokens on a ~25M model, 3 minutes on 2 cores; its --small form is run",
    "PYTHONPATH=. python scripts/bench_length.py --lengths 256 --ways rows --steps 8 --small --work "
    "outputs/bench_diag_small": "eight GRPO steps of 256 new tokens (a minute); the header's --small form covers the "
                                "script",
    "PYTHONPATH=. python scripts/bench_length.py --lengths 256 --ways rows --steps 8 --small --full --work "
    "outputs/bench_diag_small_full": "eight GRPO steps of 256 new tokens (a minute); the header's --small --full form "
                                     "covers the script",
    "OMP_NUM_THREADS=1 python scripts/bench_host_memory.py": "forward + backward passes of a ~25M model at 512 and "
        "2,048 tokens in 12 fresh processes, ~10 minutes; its --small form (the script's header) is run",
    "python scripts/make_default_data.py": "rewrites the shipped data; tests/test_foundation.py checks that it "
                                           "reproduces them",
    "python scripts/make_tool_data.py": "rewrites the shipped tool data; tests/test_multiturn.py checks that it "
                                        "reproduces them",
    "python scripts/make_long_data.py": "rewrites the shipped long-task data; tests/test_long_task.py checks that it "
                                        "reproduces them",
    "python scripts/make_long_data.py --lengths": "rewrites the shipped long-task data (tests/test_long_task.py checks "
                                                  "that it reproduces them) and prints the lengths that test asserts",
    "TASK=long bash scripts/run_all.sh": "tests/test_long_task.py::test_run_all_long_task_smoke (PRESET=smoke)",
    "python scripts/report.py outputs --sweep 1 2 3": "what SEEDS= runs last; SEEDS= is run (test_ppo.py)",
    "python scripts/drop_layers.py outputs/sft --keep 0 2 --out outputs/student_init":
        "keeps layers 0 and 2 of the embedded default's 3; the workspace's SFT model has 2: "
        "tests/test_drop_layers.py runs it on a 3-layer model and checks the result on values",
    # run as written (smoke size) by the pipeline tests of tests/test_ppo.py; not twice
    "bash scripts/run_all.sh": "tests/test_ppo.py::test_run_all_smoke and ::test_run_all_skips_finished_stages_...",
    "PRESET=smoke bash scripts/run_all.sh": "tests/test_ppo.py::test_run_all_smoke",
    "FORCE=1 bash scripts/run_all.sh": "tests/test_ppo.py::test_run_all_skips_finished_stages_and_resumes_interrupted_ones",
    "DRY_RUN=1 bash scripts/run_all.sh": "tests/test_ppo.py::test_run_all_pins_the_demo_rl_schedules runs it and "
                                         "checks the commands it prints (and that nothing is written)",
    "OUTPUT_DIR=runs/exp1 bash scripts/run_all.sh": "the plain pipeline (tests/test_ppo.py::test_run_all_smoke) with "
                                                    "its root chosen: every run_all.sh command here runs with its own "
                                                    "OUTPUT_DIR, and the tests of test_ppo.py with theirs",
    # docs/own-model.md's "Your own model" block: one flow, each command reading the last one's output
    "python -m rlhf.sft model.name_or_path=/models/my-model data.path=my_sft.jsonl output_dir=runs/sft": OWN_MODEL,
    "python -m rlhf.reward model.name_or_path=runs/sft data.path=my_pairs.jsonl output_dir=runs/rm": OWN_MODEL,
    "python -m rlhf.sft model.name_or_path=/models/my-model model.lora.r=8 model.lora.merge_on_save=false output_dir=runs/sft_lora": OWN_MODEL,
    "python -m rlhf.reward model.name_or_path=runs/sft_lora model.lora.r=8 model.lora.merge_on_save=false output_dir=runs/rm_lora": OWN_MODEL,
    "python -m rlhf.ppo actor.model=runs/sft_lora critic.model=runs/rm_lora model.lora.r=8 model.lora.merge_on_save=false output_dir=runs/ppo_lora": OWN_MODEL,
    "python -m rlhf.evaluate model.name_or_path=runs/ppo_lora output_dir=runs/eval_ppo": OWN_MODEL,
    "python -m rlhf.evaluate model.name_or_path=runs/rm_lora output_dir=runs/eval_rm": OWN_MODEL,
    "python -m rlhf.ppo reward.ensemble_models=[outputs/reward_2] reward.ensemble_agg=mean_minus_std "
    "reward.ensemble_lambda=1": "reads outputs/reward_2, which the RM_ENSEMBLE=2 command above it trains (that one "
                                "is run); tests/test_reward_ensemble.py runs PPO with a two-model ensemble",
    "RM_ENSEMBLE=2 bash scripts/run_all.sh reward:data.path=/data/a.jsonl reward_2:data.path=/data/b.jsonl":
        "placeholders for your pairs; tests/test_ppo.py::test_run_all_trains_each_ensemble_member_on_pairs_of_its_own "
        "checks that each member gets its own (and RM_ENSEMBLE=2 on the shipped pairs is run)",
    'SEEDS="1234 1 2" bash scripts/run_all.sh': "tests/test_ppo.py::test_run_all_seed_sweep (SEEDS=\"3 4\")",
    # a server runs until stopped; tests/test_serve.py starts real ones and runs PPO against them
    "python -m rlhf.serve reward.model=outputs/reward server.port=8000": "tests/test_serve.py (a server runs until "
                                                                         "stopped: started there on a free port)",
    "python -m rlhf.ppo reward.sources=[http] reward.url=http://127.0.0.1:8000": "needs a running server: "
        "tests/test_serve.py::test_ppo_over_http_equals_in_process_and_combines_with_the_judge",
    "python scripts/bench_serve.py": "a load test of 30 s and more (its --duration 2 form is run)",
    "python scripts/bench_env.py --step outputs/sft --steps 6 --reps 2 --workers 0 2": "a measurement of 4 RL stage "
        "runs of the tool task from a tool-task SFT output (docs/environments.md); tests/test_multiturn.py checks "
        "that it runs run_all.sh's TASK=tools RL stage and that env_overhead_s is what it says",
    "python scripts/bench_serve.py --ppo --sft outputs/sft": "two PPO runs of 3 steps (the PPO comparison is "
        "tests/test_serve.py::test_ppo_over_http_equals_in_process_and_combines_with_the_judge)",
}

# Placeholders in the documented commands -> local stand-ins ({W}: the workspace, {M}: a tiny local model).
SUBST = {
    "/models/opt-1.3b": "{M}", "/models/opt-350m": "{M}", "/models/my-model": "{M}", "/models/Qwen2.5-0.5B": "{M}",
    "Dahoas/rm-static": "{P}", "Anthropic/hh-rlhf": "{P}",
    "/runs/sft": "outputs/sft", "/runs/rm": "outputs/reward",
    "OUTPUT_DIR=runs/": "OUTPUT_DIR={W}/runs/",
    # the shipped tool task's files, named from the checkout's root as docs/environments.md runs them
    "=data/tools/": f"={ROOT}/data/tools/",
}
# model=qwen2 names a hub model: the local one instead (the preset's other settings stay)
AFTER = {"model=qwen2": ["model.name_or_path={M}"]}

SMOKE = {
    "sft": ["train.max_steps=2", "train.eval_every=0", "train.save_every=2", "data.num_eval_prompts=8",
            "train.micro_batch_size=8", "train.global_batch_size=16", "eval.max_new_tokens=6"],
    "reward": ["train.max_steps=2", "train.eval_every=0", "train.save_every=0", "train.micro_batch_size=8",
               "train.global_batch_size=16"],
    "dpo": ["train.max_steps=2", "train.eval_every=0", "data.num_eval_prompts=8", "train.micro_batch_size=8",
            "train.global_batch_size=16", "eval.max_new_tokens=6"],
    "ppo": ["train.max_steps=1", "train.eval_every=0", "train.save_every=0", "data.num_eval_prompts=8",
            "rollout.prompts_per_step=32", "rollout.max_new_tokens=6", "eval.max_new_tokens=6"],
    "evaluate": ["data.num_eval_prompts=8", "eval.max_new_tokens=6"],
}
SMOKE_GROUPED = {"rollout.prompts_per_step=32": "rollout.prompts_per_step=4"}  # grpo/rloo: 4 prompts x 8 samples
TINY_ALL = [*(f"sft:{o}" for o in SMALL_MODEL), "sft:train.max_steps=4", "sft:data.num_eval_prompts=8",
            "reward:train.max_steps=4", "ppo:train.max_steps=1", "ppo:data.num_eval_prompts=8",
            "dpo:train.max_steps=2", "dpo:data.num_eval_prompts=8"]  # after PRESET=smoke's, so they win


# ----------------------------------------------------------------------------- reading the commands


def _strip_comment(line: str) -> str:
    return re.sub(r"\s+#\s.*$", "", line).strip()


def doc_files() -> list:
    """README.md, then every page of docs/ (by name)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def doc_commands() -> list[str]:
    """The lines of every ```bash block of README.md and docs/*.md (continued lines joined)."""
    out = []
    for path in doc_files():
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = _strip_comment(line)
                if line and not line.startswith("#"):
                    out.append(re.sub(r"\s+", " ", line))
    return out


def header_commands() -> list[str]:
    """scripts/run_all.sh's comment header and the `python scripts/...` lines of scripts/*.py docstrings
    (an optional `[...]` part dropped, `...` for 'more overrides' dropped)."""
    out = []
    for line in (ROOT / "scripts/run_all.sh").read_text().split("\nset -euo")[0].splitlines():
        line = _strip_comment(line.removeprefix("#"))
        if re.match(r"^([A-Z_]+=\S+ )*bash scripts/run_all.sh", line) or line.startswith(("LAUNCH=", "SEEDS=")):
            out.append(line)
    for path in sorted((ROOT / "scripts").glob("*.py")):
        doc = path.read_text().split('"""')[1]
        for line in doc.replace("\\\n", " ").splitlines():
            if line.strip().startswith("python scripts/"):
                line = re.sub(r"\s*\[.*?\]", "", _strip_comment(line)).replace(" ...", "")
                out.append(re.sub(r"\s+", " ", line))
    return out


def documented_commands() -> list[str]:
    seen: list[str] = []
    for c in doc_commands() + header_commands():
        if c not in seen:
            seen.append(c)
    return seen


def test_the_commands_are_read():
    """The reader finds the commands it must (a change in the docs' layout must not make this test vacuous)."""
    commands = documented_commands()
    assert "bash scripts/run_all.sh" in commands
    assert 'LAUNCH="torchrun --nproc_per_node 2" bash scripts/run_all.sh all:engine=zero3' in commands
    assert "torchrun --nproc_per_node 2 -m rlhf.ppo engine=zero3 rollout.micro_batch_size=16 reference.offload=true" \
        in commands
    assert "python -m rlhf.sft model.name_or_path=/models/opt-1.3b data.path=my_sft.jsonl train.lr=1e-5 " \
           "train.epochs=2 train.micro_batch_size=8 train.global_batch_size=64" in commands  # a continued line
    assert "python scripts/compare_rl.py --sft outputs/sft --reward outputs/reward --out runs/compare" in commands
    assert len(commands) >= 50, len(commands)
    assert set(NOT_RUN) <= set(commands), set(NOT_RUN) - set(commands)  # no stale entries


# ----------------------------------------------------------------------------- the workspace


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A directory with outputs/{sft,reward,ppo,dpo} from tiny runs, a tiny local model and the files
    the commands name."""
    from test_user_model import user_model_dir

    w = tmp_path_factory.mktemp("docs")
    out = {st: f"output_dir={w / 'outputs' / st}" for st in ("sft", "reward", "ppo", "dpo")}
    run_stage("sft", out["sft"], *SMALL_MODEL, *SMOKE["sft"])  # with a checkpoint, for train.resume=true
    run_stage("reward", out["reward"], f"model.name_or_path={w / 'outputs/sft'}", *SMOKE["reward"])
    run_stage("ppo", out["ppo"], f"actor.model={w / 'outputs/sft'}", f"critic.model={w / 'outputs/reward'}",
              *SMOKE["ppo"])
    run_stage("dpo", out["dpo"], f"model.name_or_path={w / 'outputs/sft'}", *SMOKE["dpo"])
    model = user_model_dir(w / "models")
    rows = [json.loads(line) for line in open(ROOT / "data/default/sft_train.jsonl")][:256]  # > a global batch of 64
    with open(w / "my_sft.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"prompt": r["prompt"], "response": r["response"]}) + "\n")
    with open(w / "qa.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"prompt": r["prompt"], "answer": r["response"].strip()}) + "\n")
    with open(ROOT / "data/default/pairs_train.jsonl") as src, open(w / "my_pairs.jsonl", "w") as f:
        f.writelines(line for _, line in zip(range(256), src))
    shutil.copy(ROOT / "data/default/eval_prompts.jsonl", w / "my_prompts.jsonl")
    with open(ROOT / "data/default/pairs_train.jsonl") as src, open(w / "my_feedback.jsonl", "w") as f:
        for _, line in zip(range(128), src):  # KTO's rows as TRL writes them: 256 labelled rows
            r = json.loads(line)
            for side in ("chosen", "rejected"):
                f.write(json.dumps({"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}) + "\n")
    (w / "mypkg").mkdir()
    (w / "mypkg" / "__init__.py").write_text("")
    (w / "mypkg" / "rewards.py").write_text(
        "def brevity(prompt, response, row):\n    return -len(response) / 16\n")
    # DeepSpeed's own examples of the two files docs/deepspeed.md names
    (w / "ds_zero2.json").write_text(json.dumps({
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4,
        "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
        "gradient_clipping": 1.0}))
    (w / "ds_chat_actor.json").write_text(json.dumps({
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 16, "steps_per_print": 10,
        "zero_optimization": {"stage": 3}, "gradient_clipping": 1.0, "prescale_gradients": False}))
    # the planner's examples: a Llama-3.2-1B-shaped config.json (what docs/deepspeed.md's output shows) and a tokenizer
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                max_position_embeddings=131072, torch_dtype="bfloat16").save_pretrained(w / "llama-1b")
    for f in (ROOT / "data/tokenizer").iterdir():
        shutil.copy(f, w / "llama-1b")
    return {"W": str(w), "M": str(model), "P": str(ROOT / "data/default/pairs_train.jsonl"), "L": str(w / "llama-1b")}


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _keys(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0].lstrip("+~") for a in args if "=" in a}


def _stage_args(module: str, args: list[str], out: str) -> list[str]:
    """`args` + this stage's smoke overrides for the keys `args` leaves alone + an own output_dir
    (before a `--cfg job`: Hydra reads overrides only ahead of it). The planner writes nothing: as is."""
    if module == "plan":
        return args
    smoke = SMOKE[module]
    if any(a in ("algorithm=grpo", "algorithm=rloo") for a in args):
        smoke = [SMOKE_GROUPED.get(o, o) for o in smoke]
    if "engine.ds_config=ds_zero2.json" in args:  # the file sets the batch sizes
        smoke = [o for o in smoke if "batch_size" not in o]
    given = _keys(args)
    extra = [o for o in smoke if o.split("=", 1)[0] not in given]
    extra += [] if "output_dir" in given else [f"output_dir={out}"]
    if module != "evaluate" and "train.resume" not in given and "--cfg" not in args:  # evaluate has no train.*
        extra.append("train.overwrite=true")
    if "--cfg" in args:
        i = args.index("--cfg")
        return args[:i] + extra + args[i:]
    return args + extra


def _argv(command: str, ws: dict[str, str], out: str) -> tuple[list[str], dict[str, str]]:
    if "rlhf.plan" in command:  # as the docs' output: every model a Llama-3.2-1B-shaped config, no weights
        for path in ("/models/llama-1b", "outputs/sft", "outputs/reward"):
            command = command.replace(path, "{L}")
    for a, b in SUBST.items():
        command = command.replace(a, b)
    for key, more in AFTER.items():
        command += "".join(f" {m}" for m in more) if key in command.split() else ""
    command = command.format(**ws)
    words = shlex.split(command)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    if words[0] == "bash":  # scripts/run_all.sh
        env.setdefault("OUTPUT_DIR", out)
        env.setdefault("PRESET", "smoke")
        if "LAUNCH" in env:
            env["LAUNCH"] = env["LAUNCH"].replace("torchrun", f"torchrun --master_addr 127.0.0.1 --master_port "
                                                              f"{_free_port()}")
        return [words[0], str(ROOT / words[1]), *words[2:], *TINY_ALL], env
    if words[0] == "torchrun":
        i = words.index("-m")
        module = words[i + 1].removeprefix("rlhf.")
        launcher = [sys.executable, "-m", "torch.distributed.run", *words[1:i], "--master_addr", "127.0.0.1",
                    "--master_port", _free_port()]
        return [*launcher, "-m", words[i + 1], *_stage_args(module, words[i + 2:], out)], env
    if words[0] == "rlhf":  # the console command: `python -m rlhf <command>` runs the same entry (rlhf/__main__.py)
        return [sys.executable, "-m", "rlhf", words[1], *_stage_args(words[1], words[2:], out)], env
    if words[:3] == ["python", "-m", "rlhf.report"]:  # reads the workspace's runs, writes one page: as written
        return [sys.executable, *words[1:]], env
    if words[:2] == ["python", "-m"]:
        module = words[2].removeprefix("rlhf.")
        return [sys.executable, "-m", words[2], *_stage_args(module, words[3:], out)], env
    if words[0] == "python" and words[1].startswith("scripts/"):
        args = words[2:]
        if words[1].endswith("compare_rl.py"):  # one row, at smoke size
            args += ["--rows", "ppo_rm", "train.max_steps=1", "train.eval_every=0", "train.save_every=0",
                     "data.num_eval_prompts=8", "rollout.prompts_per_step=32", "rollout.max_new_tokens=6"]
        if words[1].endswith("compare_ranks.py"):  # two GRPO runs of 2 steps at smoke size (exit 1 unless equal)
            args += ["train.max_steps=2", "train.eval_every=0", "train.save_every=0", "data.num_eval_prompts=4",
                     "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "rollout.mini_batch_size=16",
                     "rollout.micro_batch_size=4", "rollout.max_new_tokens=8"]
        return [sys.executable, str(ROOT / words[1]), *args], env
    raise AssertionError(f"a documented command this test does not know how to run: {command}")


# ----------------------------------------------------------------------------- running them


def python_cells(path) -> list[str]:
    """The ```python blocks of a page, in order: a notebook's cells."""
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def test_the_python_api_page_runs_as_a_notebook(tmp_path):
    """docs/python-api.md's cells, as written, one after the other in one process from an empty directory:
    the stages' summaries and the error they show."""
    cells = python_cells(ROOT / "docs" / "python-api.md")
    assert len(cells) == 3 and "api.run(" in cells[0]
    proc = subprocess.run([sys.executable, "-c", "\n".join(cells)], cwd=tmp_path, env=cli_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    sft, grpo = summary(tmp_path / "runs" / "sft"), summary(tmp_path / "runs" / "grpo")
    assert (sft["steps"], grpo["steps"], grpo["reward_sources"]) == (30, 4, ["judge", "function"])
    printed = proc.stdout.splitlines()
    assert f"sft 30 {sft['eval_loss_before']} -> {sft['eval_loss_after']} {sft['version']}" in printed
    assert f"['judge', 'function'] {grpo['kl']}" in printed
    assert printed[-1].startswith("unknown config key 'train.lrr' (in 'train.lrr=1e-4'); did you mean 'train.lr'?")


@pytest.mark.parametrize("command", [c for c in documented_commands() if c not in NOT_RUN])
def test_documented_command_runs(command, workspace, tmp_path):
    out = str(tmp_path / "out")
    if "train.resume=true" in command:  # "continue from the last checkpoint": of a run that has one
        shutil.copytree(os.path.join(workspace["W"], "outputs", "sft"), out)
        command += f" output_dir={out} " + " ".join(SMALL_MODEL)  # that run's model
    argv, env = _argv(command, workspace, out)
    env_all = {**cli_env(), "PYTHONPATH": f"{ROOT}{os.pathsep}{workspace['W']}", **env}
    if argv[:2] == [sys.executable, "-m"]:  # through the fork server, as run_stage does
        proc = forkserver.run(argv[2], argv[3:], cwd=workspace["W"], env=env_all, timeout=900)
    else:  # run_all.sh's stages through it too (its `python -m`), the rest as is
        env_all = forkserver.shim_env(env_all) if argv[0] == "bash" else env_all
        proc = subprocess.run(argv, cwd=workspace["W"], env=env_all, capture_output=True, text=True, timeout=900)
    planner = "rlhf.plan" in argv
    # the planner's documented examples do not fit their budget: exit code 1 and the change that would
    assert proc.returncode == (1 if planner else 0), f"{shlex.join(argv)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    # what the command is for, checked on its output
    if "--cfg" in argv:
        assert "output_dir:" in proc.stdout
    elif argv[0] == "bash":
        root = env["OUTPUT_DIR"]
        if "SEEDS" in env:
            assert os.path.isfile(os.path.join(root, "sweep.md"))
            root = os.path.join(root, f"seed_{env['SEEDS'].split()[0]}")
        last = "dpo" if env.get("PIPELINE") == "dpo" else "ppo"
        assert os.path.isfile(os.path.join(root, "report.md"))
        assert os.path.isfile(os.path.join(root, "report.json")) == (last == "ppo")  # the headline figures: SFT -> RM -> PPO
        assert summary(os.path.join(root, last))["steps"] >= 1
    elif "rlhf.report" in argv:
        page = argv[argv.index("--out") + 1] if "--out" in argv else os.path.join(argv[3], "report.html")
        assert "run explorer:" in proc.stdout and os.path.getsize(os.path.join(workspace["W"], page)) > 4_000_000
    elif "stage_plan.py" in argv[1]:
        assert proc.stdout.split()[0] in ("skip", "resume", "run")
    elif "report.py" in argv[1]:
        assert os.path.isfile(os.path.join(workspace["W"], "outputs", "report.md"))
    elif "compare_rl.py" in argv[1]:
        assert "| ppo | reward model |" in proc.stdout  # the row it was asked for
    elif "compare_ranks.py" in argv[1]:
        assert "1 process vs 2 ranks" in proc.stdout and "equal to rel=" in proc.stdout  # (exit 1 otherwise)
    elif planner:
        assert "plan: stage" in proc.stdout and "cheapest change that fits:" in proc.stdout, proc.stdout
        shown = "".join(path.read_text() for path in doc_files())
        assert proc.stdout.strip().splitlines()[-1].strip() in shown  # as the docs show (docs/deepspeed.md)
    elif "bench_" in argv[1]:
        assert proc.stdout.strip()
    else:
        given = [a for a in argv if a.startswith("output_dir=")][-1].split("=", 1)[1]
        path = given if os.path.isabs(given) else os.path.join(workspace["W"], given)
        s = summary(path)
        assert s.get("steps", 1) >= 1 or "gold_score" in s or "eval_accuracy" in s, s
