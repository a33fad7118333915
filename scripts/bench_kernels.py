"""Fused kernels vs the plain PyTorch/transformers path, measured in the same run.

    python scripts/bench_kernels.py                  # GPU: the issue's shapes (bf16)
    python scripts/bench_kernels.py --small          # tiny shapes on whatever device (checks the script)

1. log-probs + entropy from hidden states: vocab 128,256, 16 x 512 tokens, hidden 2048, forward +
   backward: peak memory and time of `kernels.fused_logprobs_entropy` vs `lm_head` -> logits ->
   log_softmax/gather + entropy.
2. a Llama-1.2B training step (micro batch 16 x 512, bf16, ZeRO stage 3 on one device) through
   TrainEngine with engine.kernels=false/true: tokens/s, MFU (model FLOPs 6N + attention per token
   over --peak-tflops), peak memory.
3. the PPO scoring pass: actor and reference log-probs, critic values and reward scores for one
   batch, four models of the same shape, kernels off vs on.
Prints a Markdown table, writes JSON to --out.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

BIG = dict(vocab=128256, hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, batch=16, seq=512)
SMALL = dict(vocab=1000, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, batch=4, seq=32)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, device, repeat: int = 3) -> tuple[float, int | None]:
    """(best seconds, peak bytes allocated during one run) after a warm-up."""
    fn()
    sync(device)
    best, peak = float("inf"), None
    for _ in range(repeat):
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) - base
    return best, peak


def bench_logprobs(s: dict, dtype, device) -> dict:
    from kernels import fused_logprobs_entropy

    N, H, V = s["batch"] * s["seq"], s["hidden"], s["vocab"]
    g = torch.Generator(device=device).manual_seed(0)
    h = (torch.randn(N, H, device=device, generator=g) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(V, H, device=device, generator=g) * H**-0.5).to(dtype).requires_grad_()
    t = torch.randint(0, V, (N,), device=device, generator=g)

    def plain():
        z = (h @ w.T).float()
        lp = torch.log_softmax(z, -1)
        ent = -(lp.exp() * lp).sum(-1)
        (lp.gather(-1, t[:, None]).sum() + ent.sum()).backward()
        h.grad = w.grad = None

    def fused():
        lp, ent = fused_logprobs_entropy(h, w, t, compute_entropy=True)
        (lp.sum() + ent.sum()).backward()
        h.grad = w.grad = None

    tp, mp = measure(plain, device)
    tf, mf = measure(fused, device)
    return {"op": "logprobs+entropy fwd+bwd", "tokens": N, "vocab": V, "plain_s": tp, "fused_s": tf,
            "speedup": tp / tf, "plain_peak_bytes": mp, "fused_peak_bytes": mf,
            "memory_ratio": (mp / mf) if mp and mf else None}


def llama(s: dict, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                      tie_word_embeddings=True, max_position_embeddings=max(2048, s["seq"]), pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def flops_per_token(model, s: dict) -> float:
    n = sum(p.numel() for p in model.parameters())
    return 6 * n + 12 * s["layers"] * s["hidden"] * s["seq"]  # + attention scores (fwd+bwd, causal ~ half x2)


def bench_train_step(s: dict, device, kernels_on: bool, precision: str, peak_tflops: float, steps: int) -> dict:
    from engine import EngineConfig, OptimConfig, TrainEngine, init_distributed
    from rlhf.modeling.forward import sft_loss
    from rlhf.modeling.roles import Policy

    info = init_distributed()
    model = llama(s, torch.float32)
    fpt = flops_per_token(model, s)
    eng = TrainEngine(Policy(model, fused=kernels_on), EngineConfig(stage=3, precision=precision, kernels=kernels_on),
                      OptimConfig(lr=1e-5, scheduler="constant"), total_steps=steps + 2, info=info)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, s["vocab"], (s["batch"], s["seq"]), generator=g).to(device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    loss_fn = sft_loss  # summed NLL through the Policy role (fused from hidden states with kernels on)

    eng.train_step([batch], loss_fn)  # warm-up
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.train_step([batch], loss_fn)
    sync(device)
    dt = (time.perf_counter() - t0) / steps
    tok_s = s["batch"] * s["seq"] / dt
    out = {"op": f"train step stage 3 {precision}", "kernels": kernels_on, "step_s": dt, "tokens_per_s": tok_s,
           "mfu": tok_s * fpt / (peak_tflops * 1e12),
           "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    del eng, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_scoring(s: dict, device, kernels_on: bool, precision: str) -> dict:
    from transformers import LlamaForSequenceClassification

    from engine import EngineConfig, FrozenEngine, init_distributed

    info = init_distributed()
    cfg = EngineConfig(stage=3, precision=precision, kernels=kernels_on)
    from rlhf.modeling.roles import Policy, ValueModel

    actor = FrozenEngine(Policy(llama(s, torch.float32), fused=kernels_on), cfg, info)
    ref = FrozenEngine(Policy(llama(s, torch.float32), fused=kernels_on), cfg, info)
    lcfg = llama(s, torch.float32).config
    lcfg.num_labels = 1
    critic = LlamaForSequenceClassification(lcfg)
    reward = LlamaForSequenceClassification(lcfg)
    critic, reward = FrozenEngine(ValueModel(critic), cfg, info), FrozenEngine(ValueModel(reward), cfg, info)
    from rlhf.modeling.forward import position_ids_from_mask, token_logprobs

    g = torch.Generator().manual_seed(2)
    seqs = torch.randint(3, s["vocab"], (s["batch"], s["seq"]), generator=g).to(device)
    mask = torch.ones_like(seqs)
    P = s["seq"] // 2
    mb = {"sequences": seqs, "attention_mask": mask, "position_ids": position_ids_from_mask(mask), "prompt_len": P}

    @torch.no_grad()
    def score():
        token_logprobs(actor.model, mb, 1.0)
        token_logprobs(ref.model, mb, 1.0)
        critic.model(seqs, mask)
        reward.model(seqs, mask)

    t, peak = measure(score, device, repeat=2)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"op": "PPO scoring pass (4 models)", "kernels": kernels_on, "seconds": t, "peak_bytes": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the device (H100 SXM: 989)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip", nargs="*", default=[], choices=["logprobs", "train", "scoring"])
    ap.add_argument("--out", default="bench_kernels.json")
    a = ap.parse_args()
    s = SMALL if a.small else BIG
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = "bf16" if device.type == "cuda" else "fp32"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    if "logprobs" not in a.skip:
        rows.append(bench_logprobs(s, dtype, device))
        print(json.dumps(rows[-1]), flush=True)
    if "train" not in a.skip:
        for k in (False, True):
            rows.append(bench_train_step(s, device, k, precision, a.peak_tflops, a.steps))
            print(json.dumps(rows[-1]), flush=True)
    if "scoring" not in a.skip:
        for k in (False, True):
            rows.append(bench_scoring(s, device, k, precision))
            print(json.dumps(rows[-1]), flush=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "shape": s, "rows": rows}, f, indent=1)
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    print("\n| measurement | plain / kernels off | fused / kernels on | ratio |\n|---|---|---|---|")
    for r in rows:
        if r["op"].startswith("logprobs"):
            print(f"| {r['op']} time | {r['plain_s'] * 1e3:.1f} ms | {r['fused_s'] * 1e3:.1f} ms | {r['speedup']:.2f}x |")
            ratio = "-" if r["memory_ratio"] is None else f"{r['memory_ratio']:.2f}x lower"
            print(f"| {r['op']} peak memory | {gib(r['plain_peak_bytes'])} | {gib(r['fused_peak_bytes'])} | {ratio} |")
    pairs = [(x, y) for x, y in zip(rows, rows[1:]) if x.get("kernels") is False and y.get("kernels") is True]
    for off, on in pairs:
        if "tokens_per_s" in off:
            print(f"| {off['op']} tokens/s | {off['tokens_per_s']:,.0f} | {on['tokens_per_s']:,.0f} | "
                  f"{on['tokens_per_s'] / off['tokens_per_s']:.2f}x |")
            print(f"| {off['op']} MFU | {off['mfu']:.1%} | {on['mfu']:.1%} | |")
            print(f"| {off['op']} peak memory | {gib(off['peak_bytes'])} | {gib(on['peak_bytes'])} | |")
        else:
            print(f"| {off['op']} | {off['seconds'] * 1e3:.1f} ms | {on['seconds'] * 1e3:.1f} ms | "
                  f"{off['seconds'] / on['seconds']:.2f}x |")


if __name__ == "__main__":
    main()
