"""Training throughput with padded vs packed (padding-free) micro-batches, pairs with their prompt run once
(data.shared_prompts), and engine.compile off/on, measured in one run.

    PYTHONPATH=. python scripts/bench_train.py                       # tiny default + 25M Llama, CPU
    PYTHONPATH=. python scripts/bench_train.py --models 25m --reps 5 --device cuda
    PYTHONPATH=. python scripts/bench_train.py --models tiny --compile off   # packing only
    PYTHONPATH=. python scripts/bench_train.py --models tiny --compile off --steps reward,dpo --pack-lengths none

Precision: `--precision auto` (default) resolves as the stages do (bf16 on CUDA and on a CPU with
native bf16, else fp32). With `--compile off,on` (default) each variant is also run with every
transformer block torch.compiled (engine.compile=true); its warm-up pass over all batches builds the
graphs, and that compile time is reported in its own column, not in tokens/s.

For each model and each kind of step, the same micro-batches run padded and packed in turn
(interleaved, `--reps` rounds, median reported), so machine load hits both alike:
    sft     TrainEngine.train_step with rlhf.sft.sft_loss (forward + backward + AdamW), a Policy
    reward  TrainEngine.train_step with rlhf.reward's pairwise loss (chosen + rejected rows), a ValueModel
    dpo     TrainEngine.train_step with rlhf.dpo's loss (sigmoid, beta 0.1, the default RPO term; a fixed
            reference table), a Policy
    score   the RL stage's scoring pass: no-grad log-probs of every row's tokens under the Policy
            (what rlhf/rl/rollout.py computes; that stage itself still runs padded batches)
    head    (only with --steps head) the reward step of reward.head_only_fraction's phase, padded pairs: the
            backbone in the graph with a zero-scaled gradient (DDP / FSDP2 ranks) vs run without a graph
            (one process: the backbone gets zero gradients, the same update bit for bit)
The pair steps (reward, dpo) also run the "shared prompts" layout (rlhf/data/tokenize.py
collate_shared_pairs; the stages take it where it computes the fewest positions): each pair's prompt once,
both responses on its KV cache.
Columns: real tokens/s (`--clock cpu`: per CPU-second of this process; the rows' real tokens, a pair's prompt
counted in both rows in every layout, so the same work), padding fraction (pad slots / computed slots), memory (CUDA: peak allocated;
CPU: bytes of tensors saved for backward, deduplicated by storage, the activation memory that
padding inflates; '-' for the no-grad pass), the ratio of tokens/s to the padded run of the first `--compile` value (off by default),
and the compile time (torch._dynamo's, during the warm-up).

Models and data:
    tiny  the embedded default (conf/model/tiny.yaml, ~1.3M params) on the shipped data
          (data/default), micro-batch 32 rows (SFT) / 32 pairs (reward), as the stages' defaults
    25m   a Llama with hidden 512, 6 layers, 8 heads, intermediate 1408, vocab 8000, tied
          embeddings (~23M params), random tokens; row lengths long-tailed over 16..1024:
          round(exp(N(ln 128, 0.9))) clipped to [16, 1024] (median 128, mean ~190, ~1% at 1024);
          SFT rows: prompt = the first 30% (no loss); pairs: a shared prompt of 30% of the chosen
          length + two responses drawn independently; micro-batch `--micro` rows (default 8)
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from engine import EngineConfig, OptimConfig, TrainEngine, compile_seconds  # noqa: E402
from engine.config import resolve_precision  # noqa: E402
from rlhf.config.schema import DPOAlgoConfig  # noqa: E402
from rlhf.data import collate_pairs, collate_sft, collate_shared_pairs  # noqa: E402
from rlhf.dpo import make_loss as make_dpo_loss, pair_batch  # noqa: E402
from rlhf.data.packing import batch_tokens, pack_pairs, pack_sft  # noqa: E402
from rlhf.data.tokenize import IGNORE_INDEX  # noqa: E402
from rlhf.modeling.forward import sft_loss
from rlhf.modeling.roles import Policy, ValueModel
from rlhf.reward import make_loss  # noqa: E402


# ----------------------------------------------------------------------------- data


def long_tail_lengths(n: int, g: torch.Generator, lo: int = 16, hi: int = 1024) -> list[int]:
    x = torch.exp(math.log(128) + 0.9 * torch.randn(n, generator=g))
    return x.round().clamp(lo, hi).long().tolist()


def synthetic(n_rows: int, vocab: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    g = torch.Generator().manual_seed(seed)
    sft = []
    for n in long_tail_lengths(n_rows, g):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        p = max(1, int(0.3 * n))
        sft.append({"input_ids": ids, "labels": [IGNORE_INDEX] * p + ids[p:]})
    pairs = []
    for i, (a, b) in enumerate(zip(long_tail_lengths(n_rows, g), long_tail_lengths(n_rows, g))):
        p = max(1, int(0.3 * a))
        prompt = torch.randint(3, vocab, (p,), generator=g).tolist()
        c = prompt + torch.randint(3, vocab, (max(1, a - p),), generator=g).tolist()
        r = prompt + torch.randint(3, vocab, (max(1, min(b, 1024) - p),), generator=g).tolist()
        pairs.append({"chosen_ids": c[:1024], "rejected_ids": r[:1024], "prompt_len": p, "index": i})
    return sft, pairs


def default_data() -> tuple[object, list[dict], list[dict]]:
    """The tiny model's config, tokenizer and the shipped SFT rows / reward pairs, as the stages read them."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from rlhf.config import RewardConfig, SFTConfig
    from rlhf.data import parse_pairs, parse_sft, tokenize_pairs, tokenize_sft
    from rlhf.data.stage import stage_rows
    from rlhf.modeling.load import load_tokenizer

    conf = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "conf"))
    with initialize_config_dir(config_dir=conf, version_base=None):
        s = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SFTConfig), compose("sft")))
        r = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RewardConfig), compose("reward")))
    tok = load_tokenizer(s.model)
    d = s.data
    sft, _ = tokenize_sft(parse_sft(stage_rows(d, stage=0)[0], tok), tok, d.max_len, d.max_prompt_len)
    d = r.data
    pairs, _ = tokenize_pairs(parse_pairs(stage_rows(d, stage=1)[0], tok), tok, d.max_len, d.max_prompt_len)
    return (s.model, tok), sft, pairs


# ----------------------------------------------------------------------------- models


def build(which: str, head: str, model_cfg=None, tok=None) -> torch.nn.Module:
    if which == "tiny":
        from rlhf.modeling.load import load_causal_lm, load_value_model

        return (load_causal_lm if head == "lm" else load_value_model)(model_cfg, tok, seed=0)
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                                   num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024,
                                   tie_word_embeddings=True, pad_token_id=0, num_labels=1)
    torch.manual_seed(0)
    cls = transformers.LlamaForCausalLM if head == "lm" else transformers.LlamaForSequenceClassification
    return cls(cfg)


# ----------------------------------------------------------------------------- measuring


class SavedBytes:
    """Bytes of the tensors autograd saves for backward (unique storages): CPU's activation memory."""

    def __enter__(self):
        self.seen: dict[int, int] = {}

        def pack(t):
            try:
                s = t.untyped_storage()
                self.seen[s.data_ptr()] = s.nbytes()
            except (RuntimeError, NotImplementedError):
                pass
            return t

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self.bytes = sum(self.seen.values())


SHARED = "shared"  # the layouts' mark for collate_shared_pairs


def computed_slots(batch: dict) -> int:
    """Token positions a forward computes: the padded/packed batch's, or a shared-prompt pair batch's
    prompts once (half its rows' prompt columns) and every row's response columns."""
    if batch.get("shared_prompts"):
        rows, P = batch["input_ids"].shape[0], batch["prompt_len"]
        return rows // 2 * P + batch["input_ids"][:, P:].numel()
    return batch["input_ids"].numel()


def real_computed(batch: dict) -> int:
    """Real tokens among `computed_slots` (a shared prompt's once)."""
    if batch.get("shared_prompts"):
        rows, P, m = batch["input_ids"].shape[0], batch["prompt_len"], batch["attention_mask"]
        return int(m[: rows // 2, :P].sum() + m[:, P:].sum())
    return batch_tokens(batch)


def timed(fn, device: torch.device, clock) -> tuple[float, float | None]:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, torch.cuda.max_memory_allocated() / 2**20
    with SavedBytes() as sb:
        t0 = clock()
        fn()
        dt = clock() - t0
    return dt, sb.bytes / 2**20 if sb.bytes else None


def bench_model(which: str, args, device: torch.device) -> list[dict]:
    if which == "tiny":
        (model_cfg, tok), sft, pairs = default_data()
        pad, micro, max_len = tok.pad_token_id, 32, 64
    else:
        model_cfg = tok = None
        sft, pairs = synthetic(args.micro * args.batches, 8000)
        pad, micro, max_len = 0, args.micro, 1024
    g = torch.Generator().manual_seed(1)
    pick = lambda rows: [[rows[i] for i in torch.randperm(len(rows), generator=g)[:micro].tolist()]  # noqa: E731
                         for _ in range(args.batches)]
    sft_mbs, pair_mbs = pick(sft), pick(pairs)
    layouts = {"padded": None}
    for L in args.pack_lengths.split(","):
        if L == "none":
            continue
        L = max_len if L == "max" else int(L)
        layouts["packed 1 row" if L == 0 else f"packed {L}"] = L
    layouts["shared prompts"] = SHARED  # the pair steps only
    compiles = [c == "on" for c in args.compile.split(",")]
    optim = OptimConfig(lr=1e-5)
    reward_loss = make_loss(0.0, 0.0)
    dpo_loss = make_dpo_loss(DPOAlgoConfig(), None)
    engines = {}  # compile flag -> (policy, critic): both alive, so their runs interleave
    for comp in compiles:
        ecfg = resolve_precision(EngineConfig(stage=0, precision=args.precision, kernels=args.kernels, compile=comp), device)
        engines[comp] = (TrainEngine(Policy(build(which, "lm", model_cfg, tok), fused=args.kernels), ecfg, optim, total_steps=10**6),
                         TrainEngine(ValueModel(build(which, "value", model_cfg, tok)), ecfg, optim, total_steps=10**6))

    def collate_s(rows, L):
        return collate_sft(rows, pad) if L is None else pack_sft(rows, pad, L)

    def collate_p(rows, L):
        if L is SHARED:
            return collate_shared_pairs(rows, pad)
        return collate_pairs(rows, pad) if L is None else pack_pairs(rows, pad, L)

    def collate_d(rows, L):  # DPO's batch with a reference table of zeros (a fixed reference)
        return pair_batch(rows, list(range(len(rows))), pad, torch.zeros(len(rows), 2), None if L is SHARED else L,
                          shared=L is SHARED)

    def score(policy, batch):
        with torch.no_grad():
            policy.model(batch["input_ids"].to(device), None if batch["attention_mask"] is None else
                         batch["attention_mask"].to(device),
                         None if batch.get("position_ids") is None else batch["position_ids"].to(device),
                         targets=batch["labels"][:, 1:].to(device))

    def head_step(comp, b):  # the reward stage's head-only phase, its backbone without (fast) or in the graph
        engine = engines[comp][1]
        engine.unwrapped.backbone_grad, engine.unwrapped.head_only_without_graph = 0.0, b["no_graph"]
        try:
            engine.train_step([b], reward_loss)
        finally:
            engine.unwrapped.backbone_grad, engine.unwrapped.head_only_without_graph = 1.0, True

    steps = {
        "head": (pair_mbs, lambda rows, L: {**collate_pairs(rows, pad), "no_graph": L}, head_step),
        "sft": (sft_mbs, collate_s, lambda comp, b: engines[comp][0].train_step([b], sft_loss)),
        "reward": (pair_mbs, collate_p, lambda comp, b: engines[comp][1].train_step([b], reward_loss)),
        "dpo": (pair_mbs, collate_d, lambda comp, b: engines[comp][0].train_step([b], dpo_loss)),
        "score": (sft_mbs, collate_s, lambda comp, b: score(engines[comp][0], b)),
    }
    rows = []
    for step, (mbs, collate, fn) in steps.items():
        if step not in args.steps.split(","):
            continue
        step_layouts = {n: L for n, L in layouts.items() if L is not SHARED or step in ("reward", "dpo")}
        if step == "head":  # padded pairs, the backbone in the graph (zero-scaled gradient) vs run without one
            step_layouts = {"padded": False, "padded, no graph": True}
        variants = [(comp, name) for comp in compiles for name in step_layouts]
        batches = {name: [collate(mb, L) for mb in mbs] for name, L in step_layouts.items()}
        compile_s = {}
        for comp in compiles:
            # warm-up: every batch of every layout once (with compile: its graphs, dynamic shapes included)
            c0, t0 = compile_seconds(), time.perf_counter()
            for name in step_layouts:
                for b in batches[name]:
                    fn(comp, b)
            compile_s[comp] = (compile_seconds() - c0, time.perf_counter() - t0)
        times = {v: [] for v in variants}
        mem = {v: 0.0 for v in variants}
        for _ in range(args.reps):
            for v in variants:  # interleaved: padded, packed, (compiled) padded, packed, padded, ...
                dt_total = 0.0
                for b in batches[v[1]]:
                    dt, m = timed(lambda: fn(v[0], b), device, args.clock_fn)
                    dt_total += dt
                    mem[v] = max(mem[v], m or 0.0) if step != "score" or device.type == "cuda" else 0.0
                times[v].append(dt_total)
        real = sum(batch_tokens(b) for b in batches["padded"])
        base = statistics.median(times[(compiles[0], "padded")])
        for comp, name in variants:
            slots = sum(computed_slots(b) for b in batches[name])
            t = statistics.median(times[(comp, name)])
            r = dict(model=which, step=step, layout=name, compile="on" if comp else "off", tokens_s=real / t,
                     pad=1 - sum(real_computed(b) for b in batches[name]) / slots, mem=mem[(comp, name)], time=t, ratio=base / t,
                     compile_s=compile_s[comp][0] if comp else None, warmup_s=compile_s[comp][1])
            rows.append(r)
            extra = f"  (compile {r['compile_s']:.1f} s of a {r['warmup_s']:.1f} s warm-up)" if comp else ""
            print(f"{which:5} {step:7} {name:13} compile {r['compile']:3} {r['tokens_s']:10,.0f} tok/s  pad {r['pad']:5.1%}  "
                  f"mem {r['mem']:8.1f} MiB  {r['ratio']:.2f}x{extra}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,25m")
    ap.add_argument("--reps", type=int, default=3, help="interleaved rounds (median reported)")
    ap.add_argument("--batches", type=int, default=4, help="micro-batches per round")
    ap.add_argument("--micro", type=int, default=8, help="rows per micro-batch of the 25m model")
    ap.add_argument("--pack-lengths", default="max",
                    help="data.pack_length values to run: max (= the model's data.max_len, the stages' default), "
                         "N >= max_len, 0 (the micro-batch in one row [1, sum(len)]), none; comma-separated")
    ap.add_argument("--steps", default="sft,reward,dpo,score",
                    help="which steps to run, comma-separated (also: head, the reward stage's head-only step)")
    ap.add_argument("--compile", default="off,on",
                    help="engine.compile values to run, comma-separated (off, on): each compiled variant's graphs are "
                         "built in its warm-up, whose compile time is reported apart from the timed rounds")
    ap.add_argument("--precision", default="auto", help="engine.precision (auto: as the stages resolve it)")
    ap.add_argument("--kernels", action="store_true", help="engine.kernels (fused log-probs from hidden states)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="CPU only: cpu = this process's CPU time (with --threads 1: the work done, nearly blind "
                         "to other processes on a loaded machine, where wall time swung 2x between identical runs)")
    args = ap.parse_args()
    args.clock_fn = time.process_time if args.clock == "cpu" and args.device == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    precision = resolve_precision(EngineConfig(precision=args.precision), device).precision
    print(f"device {device}, {precision}, torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for which in args.models.split(","):
        rows += bench_model(which, args, device)
    mem_label = "peak MiB" if device.type == "cuda" else "saved-for-backward MiB"
    base = f"vs padded, compile {args.compile.split(',')[0]}"  # the ratio's baseline: the first --compile value
    print(f"\n| model | step | layout | compile | tokens/s | padding | {mem_label} | {base} | compile time (s) |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mem = "-" if not r["mem"] else f"{r['mem']:.1f}"
        comp = "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        print(f"| {r['model']} | {r['step']} | {r['layout']} | {r['compile']} | {r['tokens_s']:,.0f} | {r['pad']:.1%} | {mem} | "
              f"{r['ratio']:.2f}x | {comp} |")


if __name__ == "__main__":
    main()
