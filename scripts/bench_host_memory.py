"""The host allocator's threshold (`engine.cpu_mmap_threshold_mb`) against a training micro-batch's time and the
process's peak resident memory, on the CPU: a ~25M Llama's scoring forward (no gradient) and forward + backward
at `--lengths` tokens per row, each setting in a fresh process, rounds interleaved.

    OMP_NUM_THREADS=1 python scripts/bench_host_memory.py                          # 512 and 2,048 tokens, 4 rows
    python scripts/bench_host_memory.py --lengths 64 --rows 2 --small --reps 1 --iters 2

1. Per round, per length and per threshold of `--thresholds` (MiB; `none` = glibc's own, the reference of the
   ratios): a fresh Python process (a process's heap has a history) sets the threshold as the engine does
   (engine.memory.set_mmap_threshold), builds the model (hidden 512, 8 layers, 8 heads, 2 KV heads, MLP 1408,
   4k vocabulary; `--small`: the tests' tiny shape) in fp32, and runs `--iters` iterations of: two no-grad
   forwards under bf16 autocast (log-softmax's max kept, as scoring keeps log-probs), then two forward +
   backward passes. Time: the process's CPU seconds per iteration (one thread), the median after the first;
   memory: the process's VmHWM (peak resident set) at the end.
2. Printed per length and threshold: the medians over `--reps` rounds, time and peak as ratios to `none`'s.
Ratios are what a shared machine measures well; absolute seconds move with its load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

WORKER = """
import json, statistics, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from engine.memory import process_memory, set_mmap_threshold
thr, length, rows, iters, small = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
applied = set_mmap_threshold(float(thr)) if thr != "none" else False
torch.set_num_threads(1)
torch.manual_seed(0)
shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2) if small else dict(vocab_size=4096, hidden_size=512, intermediate_size=1408,
             num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2)
model = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=max(length, 128)))
ids = torch.randint(0, shape["vocab_size"], (rows, length))
times = []
for _ in range(iters):
    t = time.process_time()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        kept = [torch.log_softmax(model(input_ids=ids).logits.float(), -1).amax(-1) for _ in range(2)]
    for _ in range(2):
        with torch.autocast("cpu", torch.bfloat16):
            logits = model(input_ids=ids).logits
        torch.log_softmax(logits.float(), -1).amax(-1).mean().backward()
        del logits
    times.append(time.process_time() - t)
print(json.dumps({"applied": applied, "s": statistics.median(times[1:] or times), "peak_gib": process_memory("VmHWM") / 2**30}))
"""


def run(thr: str, length: int, a: argparse.Namespace) -> dict:
    out = subprocess.run([sys.executable, "-c", WORKER, thr, str(length), str(a.rows), str(a.iters), str(int(a.small))],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    if out.returncode != 0:
        raise SystemExit(f"the worker failed ({thr} MiB, {length} tokens):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 2048])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--thresholds", nargs="+", default=["none", "4", "16"], help="MiB, or none (glibc's own): the first "
                    "is the reference of the ratios")
    ap.add_argument("--reps", type=int, default=2, help="interleaved rounds (a fresh process per setting each)")
    ap.add_argument("--iters", type=int, default=3, help="iterations per process (the first left out)")
    ap.add_argument("--small", action="store_true", help="the tests' tiny model shape (a smoke run)")
    ap.add_argument("--json")
    a = ap.parse_args()
    got: dict[tuple[int, str], list[dict]] = {}
    for r in range(a.reps):
        for length in a.lengths:
            order = a.thresholds if r % 2 == 0 else a.thresholds[::-1]
            for thr in order:
                res = run(thr, length, a)
                if thr != "none" and not res["applied"]:
                    raise SystemExit("this C library is not glibc: engine.cpu_mmap_threshold_mb does nothing here")
                got.setdefault((length, thr), []).append(res)
    print("| tokens per row | threshold MiB | CPU s per iteration | time / none's | peak RSS GiB | peak / none's |")
    print("|---|---|---|---|---|---|")
    rows = []
    for length in a.lengths:
        med = {thr: {k: statistics.median(x[k] for x in got[(length, thr)]) for k in ("s", "peak_gib")}
               for thr in a.thresholds}
        ref = med[a.thresholds[0]]
        for thr in a.thresholds:
            m = med[thr]
            rows.append({"length": length, "threshold": thr, **m, "time_ratio": m["s"] / ref["s"],
                         "peak_ratio": m["peak_gib"] / ref["peak_gib"]})
            print(f"| {length} | {thr} | {m['s']:.2f} | {m['s'] / ref['s']:.3f} | {m['peak_gib']:.2f} | "
                  f"{m['peak_gib'] / ref['peak_gib']:.3f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
