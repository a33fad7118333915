"""Generation throughput: `transformers` `generate` vs the injected model (engine/inference), same run.

    python scripts/bench_generation.py                       # GPU: Llama-1.2B and OPT-1.3B shapes, bf16
    python scripts/bench_generation.py --small --device cpu  # tiny shapes: checks the script itself

Random weights; prompts of `--prompt` tokens (every row full length), `--new` new tokens with EOS
disabled (both paths run the full length), greedy decoding on both paths. For each shape and batch
size: tokens/s of each path and their ratio, ms per decode step of the injected path (total minus
a 1-token prefill run, over new-1 steps), and the bandwidth floor of one decode step: bytes read
per step (all weights + the KV cache at mid-generation) / the device-copy bandwidth measured here.
Writes a Markdown table to stdout and JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = {
    "llama-1.2b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                       max_position_embeddings=4096),
    "opt-1.3b": dict(model_type="opt", hidden_size=2048, ffn_dim=8192, num_hidden_layers=24, num_attention_heads=32,
                     vocab_size=50272, word_embed_proj_dim=2048, max_position_embeddings=2048),
}
SMALL = {
    "llama-small": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True),
    "opt-small": dict(model_type="opt", hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=300, word_embed_proj_dim=64, max_position_embeddings=1024),  # >= prompt + new tokens
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeat: int) -> float:
    """Best wall time of `repeat` runs after one warm-up (CUDA graphs are captured in the warm-up)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    n = (1 << 28) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), device, 5)
    return 2 * n / t


def bench_shape(name: str, spec: dict, batches: list[int], P: int, N: int, dtype, device, repeat: int) -> list[dict]:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from engine.inference import InferenceModel, SamplingParams, generate

    spec = dict(spec)
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    inj = InferenceModel(hf.config, hf.state_dict().items(), dtype=dtype, device=device)
    weight_bytes = inj.memory_bytes()["weights"]
    bw = copy_bandwidth(device)
    greedy = SamplingParams(greedy=True)
    rows = []
    for B in batches:
        ids = torch.randint(3, cfg.vocab_size, (B, P), device=device)
        mask = torch.ones_like(ids)
        gen_cfg = GenerationConfig(max_new_tokens=N, min_new_tokens=N, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)

        def run_hf():
            with torch.no_grad():
                return hf.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)

        def run_inj(n=N):
            return generate(inj, ids, mask, n, eos_token_id=None, pad_token_id=0, sampling=greedy)

        t_hf = timed(run_hf, device, repeat)
        t_inj = timed(run_inj, device, repeat)
        t_prefill = timed(lambda: run_inj(1), device, repeat)
        assert run_inj().sequences.shape[1] == P + N
        kv_per_token = 2 * inj.args.n_layers * inj.args.n_kv_heads * inj.args.head_dim * torch.tensor([], dtype=dtype).element_size()
        step_bytes = weight_bytes + B * (P + N // 2) * kv_per_token
        row = {
            "shape": name, "batch": B, "prompt": P, "new_tokens": N,
            "hf_tokens_per_s": B * N / t_hf, "injected_tokens_per_s": B * N / t_inj, "speedup": t_hf / t_inj,
            "injected_ms_per_decode_step": 1e3 * (t_inj - t_prefill) / max(N - 1, 1),
            "floor_ms_per_step": 1e3 * step_bytes / bw, "weights_only_floor_ms": 1e3 * weight_bytes / bw,
            "copy_bandwidth_GBps": bw / 1e9,
        }
        row["step_over_floor"] = row["injected_ms_per_decode_step"] / row["floor_ms_per_step"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    inj.release()  # (the HF model is freed on return)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=None, help=f"subset of {list(SHAPES)}")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a check of the script, e.g. on CPU)")
    ap.add_argument("--out", default="bench_generation.json")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_generation.py: no CUDA device here (use --device cpu --small to check the script)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    table = SMALL if a.small else SHAPES
    names = a.shapes or list(table)
    rows = []
    for name in names:
        rows += bench_shape(name, table[name], a.batch, a.prompt, a.new, dtype, device, a.repeat)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else str(device),
                   "dtype": a.dtype, "rows": rows}, f, indent=1)
    print("\n| shape | batch | hf tok/s | injected tok/s | speedup | ms/step | floor ms/step | step/floor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['batch']} | {r['hf_tokens_per_s']:,.0f} | {r['injected_tokens_per_s']:,.0f} | "
              f"{r['speedup']:.1f}x | {r['injected_ms_per_decode_step']:.2f} | {r['floor_ms_per_step']:.2f} | "
              f"{r['step_over_floor']:.2f} |")


if __name__ == "__main__":
    main()
