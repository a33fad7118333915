"""The RL step against response length: step time and peak memory of GRPO at `--lengths` new tokens on a ~25M
Llama (on the CPU, or on the GPU where one is visible), with row-count micro-batches and with a token budget, each
run in a fresh process, the memory `python -m rlhf.plan` predicts beside it, and the growth exponent of the step's
cost in length.

    PYTHONPATH=. python scripts/bench_length.py                                  # 128 / 512 / 2048 tokens
    python scripts/bench_length.py --lengths 16 32 --rows 8 --micro 4 --small --heap --work outputs/bench_length_smoke
    python scripts/bench_length.py --lengths 16 --ways rows --rows 8 --micro 4 --small --full --work outputs/bench_length_smoke --variants engine.cpu_mmap_threshold_mb=null engine.cpu_mmap_threshold_mb=4
    PYTHONPATH=. python scripts/bench_length.py --lengths 2048 --ways rows --full --steps 1 --work outputs/bench_length_full --variants engine.cpu_mmap_threshold_mb=null engine.cpu_mmap_threshold_mb=16 engine.cpu_mmap_threshold_mb=4
    python scripts/bench_length.py --lengths 128 512 2048 --ways rows --full --steps 3 --trace --work /tmp/bench_length_gpu   # on a GPU

1. Stage outputs built once in `--work` (scripts/bench_rl.py build_models): an SFT model and a reward model of one
   step each in the ~25M shape (hidden 512, 8 layers, 8 heads, 2 KV heads, MLP 1408, the shipped 4k vocabulary),
   with 4,096 positions (`--small`: the tests' tiny shape, for a smoke run).
2. Per length L and way of batching, `python -m rlhf.ppo algorithm=grpo rollout.max_new_tokens=L` with `--rows`
   rows per step (`--rows / 4` prompts x 4 samples, one mini-batch), `--steps` steps (the first left out), run by
   scripts/bench_rl.py's worker with its `--eos-spread` rule, strict (the model's own EOS never drawn): responses
   end uniformly between 10% and 100% of L, as an RL step's do, whatever the model would say (`--full`: every
   response L tokens, the plan's worst case). The ways: `rows` = `rollout.micro_batch_size=--micro` rows per forward at the step's
   width; `tokens` = `rollout.micro_batch_tokens` = --micro x (data.max_prompt_len + L), the same worst case.
   The step's phases are the worker's timers (generate, score, advantages, update, the rest; `--clock cpu`, the
   default on the CPU (wall on a GPU): the process's CPU seconds on one thread, which a shared machine's other jobs barely move); the peak resident
   memory is the largest mem_generation_peak_gib / mem_training_peak_gib of the run's metrics.jsonl (on the CPU the
   process's VmHWM, on a GPU torch.cuda.max_memory_allocated, reset at each phase's start; each step's in the
   JSON). Generation runs on the injected decoder (`--generation`).
3. The plan: `python -m rlhf.plan stage=ppo device=cpu` (device=cuda on a GPU) with the same overrides
   (rlhf/run/plan.py, a plan of the worst case: every response L tokens), against the measured peak, as plan / measured.
   `--trace` (GPU): each run under scripts/cuda_peak.py, which prints what was live at its peak by the line that
   allocated it (what a plan that is off has left out). `--heap` (CPU, glibc): each run under scripts/heap_probe.py,
   which records after each heap trim the resident memory by kind and glibc's bytes in use (in the JSON: `heap`;
   printed: the bytes in use at each trim).
4. The growth exponent between consecutive lengths: log(t2 / t1) / log(L2 / L1) of the step's time (1 = linear).
Ratios are what a shared machine measures well; absolute seconds move with its load.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from scripts.bench_rl import PHASES, QUIET, SHAPE_25M, SHAPE_SMALL, build_models, run_worker  # noqa: E402


def overrides(sft: str, reward: str, length: int, a: argparse.Namespace, way: str) -> list[str]:
    batching = (f"rollout.micro_batch_tokens={a.micro * (a.prompt + length)}" if way == "tokens" else
                "rollout.micro_batch_tokens=null")
    return [f"actor.model={sft}", f"critic.model={reward}", "algorithm=grpo", f"rollout.max_new_tokens={length}",
            f"data.max_prompt_len={a.prompt}", f"rollout.prompts_per_step={a.rows // 4}", "rollout.n_samples_per_prompt=4",
            f"rollout.mini_batch_size={a.rows}", f"rollout.micro_batch_size={a.micro}", batching,
            f"train.max_steps={a.steps}", f"engine.generation={a.generation}", *QUIET, *a.extra]


def measure(out: str, args: list[str], length: int, clock: str, low: float = 0.1, trace: bool = False,
            heap: bool = False) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    wrap = ([os.path.join(ROOT, "scripts", "cuda_peak.py"), "--out", out + "_trace", "--"] if trace else
            [os.path.join(ROOT, "scripts", "heap_probe.py"), "--out", out + "_heap.jsonl", "--"] if heap else [])
    res = run_worker(ROOT, out, args, plant=length, plant_strict=True, clock=clock, plant_low=low, wrap=wrap)
    steps = res["steps"][1:] or res["steps"]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if r.get("kind") == "train"]
    per_step = [max(r.get("mem_generation_peak_gib", 0.0), r.get("mem_training_peak_gib", 0.0)) for r in rows]
    return {"step_s": statistics.median(sum(s[p] for p in PHASES) for s in steps),
            **{f"{p}_s": statistics.median(s[p] for s in steps) for p in PHASES},
            "mean_length": statistics.mean(r["response_len"] for r in rows), "peak_gib": max(per_step),
            "step_peaks_gib": per_step, **({"trace": read(os.path.join(out + "_trace", "peak.txt"))} if trace else {}),
            **({"heap": [json.loads(line) for line in read(out + "_heap.jsonl").splitlines()]} if heap else {})}


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def planned(args: list[str], device: str) -> float:
    from rlhf.run import plan
    report, _ = plan.run_plan(["stage=ppo", f"device={device}", *args])
    return report["peak_bytes"] / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="outputs/bench_length")
    ap.add_argument("--lengths", nargs="+", type=int, default=[128, 512, 2048])
    ap.add_argument("--ways", nargs="+", default=["rows", "tokens"], choices=("rows", "tokens"))
    ap.add_argument("--rows", type=int, default=16, help="rows per step (a multiple of 4: prompts x 4 samples)")
    ap.add_argument("--micro", type=int, default=4, help="rows per forward (rows), or the budget's rows of full width")
    ap.add_argument("--prompt", type=int, default=48, help="data.max_prompt_len")
    ap.add_argument("--steps", type=int, default=2, help="RL steps per run (the first left out when there are more)")
    ap.add_argument("--generation", default="injected")
    ap.add_argument("--small", action="store_true", help="the tests' tiny model shape (a smoke run)")
    ap.add_argument("--extra", nargs="*", default=[], help="more rlhf.ppo overrides for every run")
    ap.add_argument("--clock", default=None, choices=("cpu", "wall"), help="cpu (the default on the CPU): the "
                    "process's CPU seconds, one thread (OMP_NUM_THREADS=1), which other jobs on a shared machine "
                    "barely move; wall (the default on a GPU): seconds")
    ap.add_argument("--full", action="store_true", help="every response the full L tokens (the plan's worst case) "
                    "instead of ends spread between 10%% and 100%% of L")
    ap.add_argument("--variants", nargs="+", default=[""], help="run each length and way once per variant: a "
                    "space-separated string of rlhf.ppo overrides each (e.g. 'engine.cpu_mmap_threshold_mb=null' "
                    "'engine.cpu_mmap_threshold_mb=16'), in turn, the first the reference of the ratios")
    ap.add_argument("--trace", action="store_true", help="GPU: run each worker under scripts/cuda_peak.py and print "
                    "what was live at its peak, by the line that allocated it (<run>_trace/peak.txt)")
    ap.add_argument("--heap", action="store_true", help="CPU (glibc): run each worker under scripts/heap_probe.py and "
                    "print glibc's bytes in use at each heap trim (each switch between generation and training)")
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the runs train (engine/distributed.py's rule)
    a.clock = a.clock or ("wall" if device == "cuda" else "cpu")
    if a.trace and device != "cuda":
        raise SystemExit("--trace needs a GPU (the CUDA allocator's history)")
    if a.heap and (device != "cpu" or a.trace):
        raise SystemExit("--heap is for runs on the CPU, without --trace")
    if a.clock == "cpu":
        os.environ["OMP_NUM_THREADS"] = "1"
    work = os.path.abspath(a.work)
    # a context long enough for the longest response (the shipped shape's is 128 positions)
    shape = [*(SHAPE_SMALL if a.small else SHAPE_25M), f"model.config.max_position_embeddings={a.prompt + max(a.lengths)}"]
    sft, reward = build_models(os.path.join(work, f"{'small' if a.small else '25m'}_{a.prompt + max(a.lengths)}"), shape)
    sft, reward = os.path.join(sft, "model"), os.path.join(reward, "model")
    results: list[dict] = []
    variants = len(a.variants) > 1
    print("| new tokens | batching |" + " variant | step / first's | peak / first's |" * variants + " mean length | "
          "step s | generate s | score s | update s | peak GiB | plan GiB | plan / peak | exponent |")
    print("|---" * (11 + 3 * variants) + "|")
    for length in a.lengths:
        for way in a.ways:
            for v, variant in enumerate(a.variants):
                args = overrides(sft, reward, length, a, way) + variant.split()
                low = 1.0 if a.full else 0.1
                row = {"new_tokens": length, "batching": way, "variant": variant,
                       **measure(os.path.join(work, f"{way}_{length}" + (f"_v{v}" if variants else "")), args, length,
                                 a.clock, low, a.trace, a.heap), "plan_gib": planned(args, device), "device": device}
                prev = [r for r in results if r["batching"] == way and r["variant"] == variant]
                if prev:
                    row["exponent"] = (math.log(row["step_s"] / prev[-1]["step_s"])
                                       / math.log(length / prev[-1]["new_tokens"]))
                first = next(r for r in [*results, row] if r["new_tokens"] == length and r["batching"] == way)
                results.append(row)
                cols = (f" {variant or '(none)'} | {row['step_s'] / first['step_s']:.3f} | "
                        f"{row['peak_gib'] / first['peak_gib']:.3f} |" if variants else "")
                print(f"| {length} | {way} |{cols} {row['mean_length']:.0f} | {row['step_s']:.1f} | "
                      f"{row['generate_s']:.1f} | {row['score_s']:.1f} | {row['update_s']:.1f} | {row['peak_gib']:.2f} | "
                      f"{row['plan_gib']:.2f} | {row['plan_gib'] / row['peak_gib']:.2f} | "
                      f"{row.get('exponent', float('nan')):.2f} |", flush=True)
                if a.trace:
                    print("\n".join(row["trace"].splitlines()[:14]), flush=True)
                if a.heap:
                    print("  glibc bytes in use at each trim, MiB: " + ", ".join(
                        f"{h['in_use'] / 2**20:.0f}" for h in row["heap"]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
