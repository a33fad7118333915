"""The weight stream (engine/weight_stream.py) against the wire's limit: a plain `broadcast` of one flat buffer
of the same size, in the same run, rounds interleaved (stream, plain, stream, plain, ...).

    torchrun --nproc_per_node 2 scripts/bench_weight_stream.py                       # 1 trainer + 1 generator, gloo on CPU
    torchrun --nproc_per_node 2 scripts/bench_weight_stream.py --hidden 1024 --layers 12 --bucket-mb 64 --out bench.json

Rank 0 (trainer) streams a Llama-architecture model's parameters (fp32, from a config) to rank 1 (generator),
whose copy of the model receives them in place; then rank 0 broadcasts one flat buffer of the same number of
bytes. Each transfer is timed on the receiver, from a barrier both ranks leave together to the last byte
received (the stream's packing on the sender included). The last round also runs the fingerprint check
(the sender's fingerprints taken while its buckets travel, the receiver's after): its seconds are reported
apart (`check_s`), and the check's time on the sender is inside that round's stream_s (CPU contention
with the wire on this machine). At the end every tensor's fingerprint is compared across the ranks.
Prints one JSON object: per round the bytes, seconds and GB/s of both, and the median ratio stream / plain.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this tree's engine/

from engine.distributed import exit_process, init_distributed, split_world
from engine.weight_check import fingerprint
from engine.weight_stream import WeightReceiver, WeightSender


def build(hidden: int, layers: int, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                      num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 128, 1),
                      vocab_size=32000, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the JSON here (rank 1)")
    a = ap.parse_args()
    init_distributed(timeout_s=600)
    placement = split_world(1)
    me = placement.world_rank
    model = build(a.hidden, a.layers, seed=1 + me)  # the generator starts from other weights
    params = dict(model.named_parameters())
    n_bytes = sum(p.numel() * p.element_size() for p in params.values())
    flat = torch.zeros(n_bytes // 4, dtype=torch.float32)
    if me == 0:
        flat.normal_()
        sender = WeightSender(placement.stream_group, src=0, bucket_bytes=int(a.bucket_mb * (1 << 20)))
    else:
        receiver = WeightReceiver(placement.stream_group, src=0)
    rows = []
    for r in range(a.rounds + 1):  # round 0 warms up (and carries the manifest); not reported
        row = {}
        dist.barrier()
        start = time.perf_counter()
        checked = r == a.rounds  # the last round also runs the check (its cost reported apart, not in stream_s)
        if me == 0:
            sender.send(params.items(), version=r, blocking=True, check=checked)
        else:
            with torch.no_grad():
                stats = receiver.receive(params, check=checked)  # every tensor's fingerprint against the sender's
            row["check_s"] = stats.check_s if checked else None
            row["stream_s"] = time.perf_counter() - start - stats.check_s
            row["bytes"] = stats.bytes
            row["buckets"] = stats.buckets
        dist.barrier()
        start = time.perf_counter()
        dist.broadcast(flat, src=0, group=placement.stream_group)
        if me == 1:
            row["plain_s"] = time.perf_counter() - start
            row["stream_gb_per_s"] = row["bytes"] / row["stream_s"] / 1e9
            row["plain_gb_per_s"] = n_bytes / row["plain_s"] / 1e9
            row["ratio"] = row["stream_gb_per_s"] / row["plain_gb_per_s"]
            if r:
                rows.append(row)
    # the generator's copy now holds the trainer's weights: every tensor's fingerprint, compared across the ranks
    got = {n: fingerprint(p).tolist() for n, p in params.items()}
    box = [got]
    dist.broadcast_object_list(box, src=0)
    if me == 1:
        equal = box[0] == got
        out = {"params": sum(p.numel() for p in params.values()), "bytes": n_bytes, "bucket_mb": a.bucket_mb,
               "rounds": rows, "median_ratio": statistics.median(x["ratio"] for x in rows),
               "median_stream_gb_per_s": statistics.median(x["stream_gb_per_s"] for x in rows),
               "median_plain_gb_per_s": statistics.median(x["plain_gb_per_s"] for x in rows),
               "fingerprints_equal": equal}
        print(json.dumps(out, indent=1))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
    exit_process(0)


if __name__ == "__main__":
    main()
