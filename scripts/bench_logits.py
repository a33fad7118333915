"""Log-probs and entropy of a policy's response tokens, with and without the [rows, length, vocab] logits:
time (forward + backward) and the memory each way takes, per size - the measurement behind the default of
`engine.max_logits_mb` (docs/engine.md).

    PYTHONPATH=. python scripts/bench_logits.py                       # 25M (h 512, V 4k) and 1B-like (h 2048, V 32k)
    python scripts/bench_logits.py --shapes 64x512 --tokens 256 4096 --repeat 1    # seconds: a smoke run

For each shape (hidden x vocabulary) and token count N (rows x response length), two ways, each in a fresh
subprocess (so that its peak resident memory is its own):
    logits   the model's way: logits = h @ W.T in float32 ([N, V]), log_softmax, gather, entropy from the logits
    chunked  kernels.fused_logprobs_entropy(impl="chunked"): [chunk, V] at a time, recomputed in backward
Reported: the median time of `--repeat` forward + backward passes, the peak RSS above the process's RSS
before the inputs were made, and the [N, V] fp32 logits' own size. Ratios are what a shared machine
measures well; absolute seconds move with its load.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def rss_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(h: int, v: int, n: int, way: str, repeat: int) -> dict:
    import torch

    sys.path.insert(0, ROOT)
    from kernels import fused_logprobs_entropy
    torch.manual_seed(0)
    base = rss_peak_mib()
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(v, h) / h**0.5).requires_grad_(True)
    targets = torch.randint(0, v, (n,))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        if way == "logits":
            logits = (hidden @ weight.T).float()
            logp = torch.log_softmax(logits, -1)
            tok = logp.gather(-1, targets[:, None])[:, 0]
            ent = -(logp.exp() * logp).sum(-1)
        else:
            tok, ent = fused_logprobs_entropy(hidden, weight, targets, impl="chunked")
        (tok.sum() + 0.01 * ent.sum()).backward()
        times.append(time.perf_counter() - t0)
        hidden.grad = weight.grad = None
        del tok, ent
    return {"seconds": statistics.median(times), "peak_mib": rss_peak_mib() - base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["512x4096", "2048x32000"], help="hidden x vocabulary")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096, 16384, 65536])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", nargs=5, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        h, v, n, way, rep = a.worker
        print(json.dumps(worker(int(h), int(v), int(n), way, int(rep))))
        return
    rows = []
    print("| hidden x vocab | tokens | logits MiB | logits: s | chunked: s | time chunked/logits | "
          "peak MiB logits | peak MiB chunked |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in a.shapes:
        h, v = (int(x) for x in shape.split("x"))
        for n in a.tokens:
            out = {}
            for way in ("logits", "chunked"):
                res = subprocess.run([sys.executable, __file__, "--worker", str(h), str(v), str(n), way, str(a.repeat)],
                                     capture_output=True, text=True, check=True)
                out[way] = json.loads(res.stdout.strip().splitlines()[-1])
            mib = n * v * 4 / 2**20
            row = {"hidden": h, "vocab": v, "tokens": n, "logits_mib": mib, **{f"{w}_{k}": x for w, r in out.items()
                                                                             for k, x in r.items()}}
            rows.append(row)
            print(f"| {h} x {v} | {n} | {mib:,.0f} | {out['logits']['seconds']:.3f} | {out['chunked']['seconds']:.3f} | "
                  f"{out['chunked']['seconds'] / out['logits']['seconds']:.2f} | {out['logits']['peak_mib']:,.0f} | "
                  f"{out['chunked']['peak_mib']:,.0f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
