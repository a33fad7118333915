"""Plan a run's device memory per rank before any weights load: `python -m rlhf.plan`.

    python -m rlhf.plan stage=sft world_size=8 budget_gib=80 model=llama model.name_or_path=/models/Llama-3.2-1B
    python -m rlhf.plan stage=ppo world_size=2 budget_gib=24 actor.model=outputs/sft critic.model=outputs/reward

Planner keys: stage (sft | reward | dpo | ppo), world_size (1), budget_gib (device memory of one rank;
0 = no verdict), device (cuda, where precision auto is bf16 | cpu), rank (0, which holds the largest
FSDP shards). Every other key is the stage's own (`python -m rlhf.<stage> --help`). Exit code: 0 (fits,
or no budget), 1 (does not fit), 2 (a bad input: one line naming it).

Each model is built on the meta device from its config alone (a local HF or stage output directory's
config.json, which is all the directory needs to hold: no weights, no tokenizer; or model.config, whose
vocabulary comes from the tokenizer), so parameter counts are exact, and parameter / gradient / optimizer
bytes are the engine's layout exactly (engine.memory.planned_bytes: what a run's memory report logs
at its first step). The rest are estimates, with b rows per micro-batch (PPO with rollout.micro_batch_tokens:
b*s = the budget; SFT / reward / DPO packed, data.packing: the micro-batch's rows of data.max_len in rows of
s = data.pack_length, or one row of them all at 0, as the stage packs them; pairs under data.shared_prompts=true:
rows of a prompt and a response at their longest, `row_layout`), s tokens, h hidden, i MLP width,
L layers, kv = KV heads x head dim, V vocabulary, e bytes of the compute dtype (2 or 4):
    activations          L*b*s*(7h + 2kv + 4i)*e: what autograd keeps per decoder block with SDPA
                         attention (block input, two norm outputs, q, k, v, attention output, MLP
                         input, gate, up, silu(gate), their product); under autocast (ZeRO stage 0/1 in
                         bf16/fp16: fp32 parameters, so the residual stream and the norms' internals
                         are fp32) 27h instead of 7h (measured on CPU: scripts/bench_length.py)
                         + eager attention (model.attn_implementation=eager): L*b*H*s^2*(4 + e), the fp32
                         softmax and the probabilities kept for the backward (H attention heads)
    + checkpointing      L*b*s*h*e (block inputs) + one block's share above, recomputed in backward
    attention (phase)    b*H*s^2*e on CPU with SDPA (one layer's scores, a moment in each forward and
                         backward: measured), b*H*s^2*(4 + e) with eager attention; 0 with SDPA on CUDA
    logits (policies)    b*s*V*(e + 8): the head's output, its fp32 copy, log_softmax's output;
                         engine.kernels=true: two chunks of at most 256 MiB (no [b, s, V] logits);
                         past engine.max_logits_mb of fp32 logits: two chunks of at most that size
    gathered params      stage 2: Psi*e for forward + backward (no reshard after forward); stage 3:
                         2 blocks*e (one computing, one prefetched); stage 0/1 in bf16: Psi*e
                         (autocast's cached casts); an offloaded frozen model at stage 0/1: + its
                         stored bytes (moved to the device for each forward)
    KV cache (RL)        2*L*B*(P + T)*kv*e, B = prompts_per_step / N * n_samples_per_prompt; multi-turn
                         (rollout.env): s = P + E (E = the episode's budget, rollout.max_episode_tokens) and
                         the injected decoder's cache P + turns*T + (turns - 1)*E (every turn's new
                         tokens, resumed; the hf path re-prefills: P + E)
    generation weights   the injected path keeps a fused Psi*e copy; the hf path gathers Psi*e at stage 2/3
                         (the injected copy and its KV cache stay resident through training too, unless
                         engine.release_inference_cache=true frees them after each generation phase)
    kept buffers         on CUDA cuBLAS's workspaces, one per (thread, stream) that runs matmuls, kept for the
                         process's life (32 MiB on compute capability 9-12, 8.125 MiB before, CUBLAS_WORKSPACE_CONFIG's
                         where set; no GPU to ask: 32 MiB): the forward's thread and autograd's backward thread, + the
                         injected decoder's graph stream; RL with engine.check_weights on: the check's 16 MiB of
                         position weights (traced on an H200 with scripts/cuda_peak.py: docs/algorithms.md)
Peak = model states on the device (offloaded: 0) + kept buffers + the largest phase: training (activations + logits +
gathered params of the trained model that needs most), scoring (logits + gathered params of one
no-grad forward) or generation (KV cache + generation weights; resident instead where the injected
model keeps them between phases); device=cpu adds the process itself
(Python with torch and transformers loaded: the planner's own resident memory, as it imports what a
stage does), so the plan is of the run's peak RSS: of what is live. Where rows reach
engine.cpu_mmap_min_row_tokens (512) the training engines' host threshold (engine.cpu_mmap_threshold_mb=16) gives
freed blocks of 16 MiB or more back to the system; smaller ones, and every block of shorter rows (glibc's own
threshold), stay in glibc's heap, which keeps what it frees: the measured peak RSS of GRPO at 128 / 512 / 2,048
new tokens, every response full, was 1.12x / 1.13x / 1.06x this plan (docs/algorithms.md); the printed plan names
the threshold that applies. At engine.cpu_mmap_threshold_mb=null freed blocks of up to 32 MiB stay in the heap
at any length: 2,048-token responses measured 1.22x this plan, which the printed plan says on the CPU.
Over steps with response lengths that vary, two things grew the CPU's peak past the plan, and the training engines
now bound both: oneDNN's and ideep's caches of bf16 kernels, one per matrix shape (engine.cpu_kernel_cache=64),
and the heap's blocks that one micro-batch frees and the next does not reuse (engine.cpu_trim_heap also trims after
each micro-batch where rows reach engine.cpu_mmap_min_row_tokens). Ends spread, the plan / the run's peak was then
0.93 at 512 tokens over 6 steps and 0.98 at 2,048 over 3 (docs/algorithms.md); the printed plan notes the
growth where engine.cpu_kernel_cache=null or engine.cpu_trim_heap=false lifts a bound.
Not counted: the CUDA context (~0.5 GiB), the allocator's fragmentation, communication buffers.
"""
from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf

from engine.config import host_mmap_threshold, long_rows, resolve_precision
from engine.generation import choose_generation_path
from engine.inference import cache_slots
from engine.lora import lora_layers
from engine.memory import (
    ZERO_FORMULAS, cublas_workspace_bytes, fmt_bytes, layout_bytes, planned_bytes, process_memory, zero_formula_bytes,
)
from engine.optim import param_groups
from engine.parallelize import find_blocks
from engine.weight_check import CACHED_BYTES as WEIGHT_CHECK_BYTES
from rlhf.algos.rl import ADVANTAGE_ESTIMATORS
from rlhf.config import SCHEMAS, cli, compose, to_config
from rlhf.config.validate import pair_shared_prompts, trained_row_tokens, unused_sources
from rlhf.core.errors import ConfigError
from rlhf.core.hub import check_local
from rlhf.core.paths import CONF_DIR
from rlhf.data.packing import widest_row
from rlhf.modeling.load import (
    adapter_chain, apply_lora, from_config_kwargs, load_tokenizer, packing_support, resolve_model_path, stage_pack_length,
)
from rlhf.rl.models import model_cfg

STAGES = ("sft", "reward", "dpo", "ppo")
PLANNER_KEYS = {"stage": "sft", "world_size": "1", "budget_gib": "0", "device": "cuda", "rank": "0"}
GiB = 2**30


@dataclass
class Arch:
    """One model as the planner needs it: parameter shapes (from the meta device) and its sizes."""

    shapes: list[tuple[tuple[int, ...], bool]]  # (shape, trainable), tied parameters once
    groups: list[list[int]]  # numels of the AdamW param groups (engine.optim.param_groups)
    block: int  # parameters of the largest decoder block (one FSDP unit)
    layers: int
    hidden: int
    inter: int
    kv: int
    vocab: int
    storage_bytes: int  # per parameter of a frozen copy (model.dtype, else the checkpoint's dtype)
    config: object  # the HF config (generation path)
    adapters: bool
    heads: int = 1  # attention heads
    attn: str = "sdpa"  # model.attn_implementation (null: transformers' default, sdpa)
    packing: str | None = None  # why the model cannot train on packed rows (rlhf.modeling.load.packing_support)

    @property
    def total(self) -> int:
        return sum(math.prod(s) for s, _ in self.shapes)

    @property
    def trainable(self) -> int:
        return sum(math.prod(s) for s, t in self.shapes if t)


_MEMO: dict[str, object] = {}  # models and tokenizers: re-planning a changed engine / batch config builds none again


def build_arch(mcfg, tok: Callable[[], Any], key: str, *, value: bool, lora: bool) -> Arch:
    """`mcfg` (a ModelConfig) built on the meta device: no weights read, exact parameter shapes. `tok()`
    gives the tokenizer, asked for only by a model built from `mcfg.config` (its vocabulary size and
    special ids); a model directory's config.json has its own, so a directory holding only config.json
    is planned without a tokenizer."""
    memo = repr((mcfg, key, value, lora))
    if memo not in _MEMO:
        _MEMO[memo] = _build_arch(mcfg, tok, key, value=value, lora=lora)
    return _MEMO[memo]


def _build_arch(mcfg, tok: Callable[[], Any], key: str, *, value: bool, lora: bool) -> Arch:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    path = mcfg.name_or_path
    if path is not None:
        check_local(path, f"{key}.name_or_path")
        source, _ = adapter_chain(resolve_model_path(path) if os.path.isdir(path) else path)
        try:
            hf = AutoConfig.from_pretrained(source, trust_remote_code=mcfg.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}.name_or_path={path!r}: cannot read a model config ({e})") from None
    else:
        kw = from_config_kwargs(mcfg, tok())
        hf = AutoConfig.for_model(kw.pop("model_type"), **kw)
    if value:
        hf.num_labels = 1
    with torch.device("meta"):
        model = (AutoModelForSequenceClassification if value else AutoModelForCausalLM).from_config(hf)
        model = apply_lora(model, mcfg, key, 0, "SEQ_CLS" if value else "CAUSAL_LM") if lora else model
    # parameters() yields a tied tensor once, as the engine counts it
    shapes = [(tuple(p.shape), p.requires_grad) for p in model.parameters()]
    block = max((sum(p.numel() for p in b.parameters()) for b in find_blocks(model)), default=0)
    groups = [[p.numel() for p in g["params"]] for g in param_groups(model, 0.0)]
    saved = getattr(hf, "dtype", None)
    dtype = mcfg.dtype if mcfg.dtype != "auto" else {"bfloat16": "bf16", "float16": "fp16"}.get(
        str(saved).replace("torch.", "") if path is not None else "", "fp32")
    heads = getattr(hf, "num_attention_heads", 1)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    return Arch(shapes, groups, block, hf.num_hidden_layers, hf.hidden_size,
                getattr(hf, "intermediate_size", None) or getattr(hf, "ffn_dim", 4 * hf.hidden_size),
                (getattr(hf, "num_key_value_heads", None) or heads) * head_dim, hf.vocab_size,
                {"fp32": 4, "bf16": 2, "fp16": 2}[dtype], hf,
                # adapters the injected model cannot take merged (engine/lora.py: plain LoRA it can)
                lora and mcfg.lora.r > 0 and lora_layers(model) is None, heads, mcfg.attn_implementation or "sdpa",
                packing_support(model))


def _tokenizer(mcfg, key: str):
    memo = repr((mcfg.tokenizer, mcfg.name_or_path, key))
    if memo not in _MEMO:
        _MEMO[memo] = load_tokenizer(mcfg, key)
    return _MEMO[memo]


@dataclass
class Role:
    name: str
    arch: Arch
    trained: bool
    offload: bool
    rows: float  # per micro-batch forward (a token budget / the row width: a fraction)
    seq: int
    logits: bool  # a policy (LM head) rather than a value head
    row_tokens: int | None = None  # the longest row its training engine is told of (None: not known ahead)


def row_layout(stage: str, cfg, arch: Arch, rows: int) -> tuple[float, int, int | None]:
    """A forward of SFT / reward / DPO at its largest, as the stage batches it: (rows, width) with every row
    data.max_len tokens, and the row width the stage gives its training engine (rlhf.data.packing.widest_row).
    Packed (data.packing where the model packs, not under data.shared_prompts=true) the same tokens fill rows of up
    to data.pack_length (0: one row of them all), whose attention grows with the width: rows x width^2 per head.
    data.shared_prompts=true (pairs): each pair's prompt once, left-padded to the micro-batch's longest (P <=
    data.max_prompt_len), and both responses on it, right-padded to the longest (R <= data.max_len - 1): the
    longest prompt and the longest response may be in different pairs, so rows of P + R; their tokens B*P + 2B*R as
    rows of width P + R (which bounds the scores, B*P^2 + 2B*R*(P + R)). At null (auto) a micro-batch runs shared
    only where that computes fewer token slots than padded rows, so the padded plan bounds it."""
    d = cfg.data
    shared = pair_shared_prompts(d, cfg.engine) if stage in ("reward", "dpo") else False
    if shared is True:
        prompt, response = min(d.max_prompt_len, d.max_len - 1), d.max_len - 1
        width = prompt + response
        return (rows // 2 * prompt + rows * response) / width, width, widest_row(d, None)
    pack_len = stage_pack_length(d, arch.packing, shared)
    tokens = rows * d.max_len
    width = d.max_len if pack_len is None else min(pack_len or tokens, tokens)
    return tokens / width, width, widest_row(d, pack_len)


def roles(stage: str, cfg, world: int) -> tuple[list[Role], int, int]:
    """The models a `stage` run holds, and (generation rows per rank, generation length) for PPO."""
    if stage != "ppo":
        tok = lambda: _tokenizer(cfg.model, "model")  # noqa: E731 (only a model built from model.config asks)
        rows = cfg.train.micro_batch_size * (1 if stage == "sft" else 2)  # chosen + rejected in one forward
        arch = build_arch(cfg.model, tok, "model", value=stage == "reward", lora=True)
        b, width, row_tokens = row_layout(stage, cfg, arch, rows)
        out = [Role("model", arch, True, cfg.engine.offload, b, width, stage != "reward", row_tokens)]
        d = getattr(cfg, "dpo", None)
        if d and d.reference == "online" and d.loss_type != "simpo" and cfg.model.lora.r == 0:
            out.append(Role("reference", build_arch(cfg.model, tok, "model", value=False, lora=False), False,
                            cfg.engine.offload, b, width, True))
        return out, 0, 0
    r, est = cfg.rollout, ADVANTAGE_ESTIMATORS.get(cfg.ppo.advantage_estimator)
    if est is None:
        raise ConfigError(f"ppo.advantage_estimator={cfg.ppo.advantage_estimator!r} is not registered")
    tok = lambda: _tokenizer(model_cfg(cfg, cfg.actor.model), "actor")  # noqa: E731
    seq = gen_len = trained_row_tokens(cfg)  # multi-turn (rollout.env): the prompt + the episode's token budget
    if r.env:  # the injected decoder's KV cache holds every turn's new tokens at once (generate_episodes' reserve)
        budget = seq - cfg.data.max_prompt_len
        gen_len = cfg.data.max_prompt_len + r.max_turns * r.max_new_tokens + (r.max_turns - 1) * budget
    unused = unused_sources(cfg)
    wanted = [("actor", cfg.actor.model, cfg.actor.lora, True, False, False),
              ("critic", cfg.critic.model, cfg.critic.lora, True, True, False),
              ("reference", cfg.reference.model or cfg.actor.model, None, False, False, cfg.reference.offload),
              ("reward_model", cfg.reward_model.model or cfg.critic.model, None, False, True, cfg.reward_model.offload)]
    distill = cfg.ppo.objective == "distill"  # the teacher in the reference's place, no reward model
    if distill:
        wanted[2] = ("teacher", cfg.teacher.model, None, False, False, cfg.teacher.offload)
    out = []
    for name, path, lora, trained, value, offload in wanted:
        if (name == "critic" and (not est.needs_critic or "critic.model" in unused)) or (
                name == "reward_model" and ("model" not in cfg.reward.sources or distill)):
            continue  # not loaded by this algorithm / reward source (rlhf/rl/models.py Models)
        arch = build_arch(model_cfg(cfg, path, lora), tok, name, value=value, lora=trained)
        # rollout.micro_batch_tokens: a forward holds at most that many tokens (rows x width), whatever the rows
        rows = r.micro_batch_size if r.micro_batch_tokens is None else r.micro_batch_tokens / seq
        out.append(Role(name, arch, trained, offload or (trained and cfg.engine.offload), rows, seq, not value, seq))
    return out, r.prompts_per_step // world * r.n_samples_per_prompt, gen_len


def plan(stage: str, cfg, *, world: int, rank: int = 0, device: str = "cuda", budget_gib: float = 0.0) -> dict:
    """Bytes per rank of every model a `stage` run holds, the phases' transient memory, and the peak."""
    ecfg = resolve_precision(cfg.engine, torch.device(device))
    e = 4 if ecfg.precision == "fp32" else 2
    split = stage == "ppo" and ecfg.placement == "split"
    if split:  # the models below live on the training ranks only, sharded over their own group
        n_gen = ecfg.generation_ranks
        if not 1 <= n_gen < world:
            raise ConfigError(f"engine.placement=split: engine.generation_ranks={n_gen} must leave at least one "
                              f"training rank of world_size={world}")
        if rank >= world - n_gen:
            raise ConfigError(f"rank={rank} is a generation rank (the last {n_gen} of {world}); the plan is of a "
                              f"training rank (0..{world - n_gen - 1}) and of a generation rank, both printed")
        world -= n_gen
    models, gen_rows, gen_len = roles(stage, cfg, world)
    report = {"stage": stage, "world_size": world, "rank": rank, "device": device, "precision": ecfg.precision,
              "zero_stage": ecfg.stage, "models": {}, "budget_bytes": budget_gib * GiB}
    phases = {"training": 0.0, "scoring": 0.0, "generation": 0.0}
    for m in models:
        a = m.arch
        b = planned_bytes(a.shapes, a.groups, stage=ecfg.stage, world=world, rank=rank,
                          frozen_bytes_per_param=None if m.trained else a.storage_bytes)
        state = sum(b.values())
        tokens = m.rows * m.seq
        # a frozen model's forwards run under no_grad: nothing is kept for a backward
        # autocast (ZeRO stage 0/1 in bf16/fp16: fp32 parameters, the residual stream and the norms in fp32)
        # keeps fp32 copies of the h-sized tensors besides the half-precision ones: 27h per token and layer
        autocast = e == 2 and ecfg.stage < 2
        per_token = (27 if autocast else 7) * a.hidden + 2 * a.kv + 4 * a.inter
        # attention's scores, b x heads x s^2 per layer (`attention_bytes`): eager attention keeps its fp32 softmax
        # and the probabilities in the compute dtype for the backward, in every layer; SDPA keeps none, but on CPU
        # one layer's block in the compute dtype exists for a moment (measured: 4 rows of 2,096 tokens, 8 heads:
        # the training phase's peak ~0.26 GiB over the linear formula's; CUDA's kernels make no such block)
        block = m.rows * a.heads * m.seq ** 2
        eager = a.attn == "eager"
        transient = block * (4 + e) if eager else (block * e if device == "cpu" else 0)
        act = 0 if not m.trained else a.layers * (tokens * per_token * e + (block * (4 + e) if eager else 0))
        act_ckpt = 0 if not m.trained else a.layers * tokens * a.hidden * e + act / a.layers
        logits = 0 if not m.logits else logits_bytes(tokens, a.vocab, e, ecfg)
        gathered = {2: a.total * e, 3: 2 * a.block * e}.get(ecfg.stage, a.total * e if e == 2 else 0)
        if m.offload and not m.trained and ecfg.stage < 2:  # stage 0/1 moves the whole model in for each forward
            gathered += a.total * a.storage_bytes
        entry = {**b, "model_state_bytes": state, "device_bytes": 0 if m.offload else state, "trained": m.trained,
                 "offload": m.offload, "total_params": a.total, "trainable_params": a.trainable if m.trained else 0,
                 "zero_formula": ZERO_FORMULAS[ecfg.stage],
                 "zero_formula_bytes": zero_formula_bytes(ecfg.stage, a.trainable, world) if m.trained else 0,
                 # a frozen model: its storage dtype, sharded at stage 2/3 (the engine's formula is for trained ones)
                 "layout_bytes": layout_bytes(ecfg.stage, a.trainable, a.total - a.trainable, world) if m.trained
                 else a.total * a.storage_bytes / (world if ecfg.stage >= 2 else 1),
                 "activation_bytes": act, "activation_ckpt_bytes": act_ckpt, "logits_bytes": logits,
                 "gathered_bytes": gathered, "attention_bytes": transient, "rows": m.rows, "seq": m.seq}
        report["models"][m.name] = entry
        if m.trained:
            phases["training"] = max(phases["training"], (act_ckpt if ecfg.activation_checkpointing else act)
                                     + logits + gathered + transient)
        phases["scoring"] = max(phases["scoring"], logits + gathered + transient)
        if m.name == "actor":
            path, why = choose_generation_path(ecfg.generation, device, a.config, adapters=a.adapters)
            # (the hf path re-prefills each multi-turn turn: its cache is one row's length, m.seq; the injected
            # decoder's holds every turn's new tokens, gen_len; both P + T for single-turn rollouts)
            kv = 2 * a.layers * gen_rows * (cache_slots(gen_len) if path == "injected" else m.seq) * a.kv * e
            weights = a.total * e if path == "injected" or ecfg.stage >= 2 else 0
            # the injected model's weights and cache stay between phases unless engine.release_inference_cache
            kept = kv + weights if path == "injected" and not ecfg.release_inference_cache else 0
            report.update(generation_path=path, generation_why=why, kv_cache_bytes=kv, generation_weight_bytes=weights,
                          inference_kept_bytes=kept)
            phases["generation"] = kv + weights - kept
            actor = a
    # buffers kept for the run's life besides the models: the weight check's cached position weights (RL, unless
    # engine.check_weights=never), and on CUDA cuBLAS's workspaces, one per (thread, stream) that runs matmuls: the
    # forward's thread and autograd's backward thread on the default stream, and the injected decoder's graph stream
    # (traced on an H200, scripts/cuda_peak.py: 32 MiB each)
    buffers = {}
    if stage == "ppo" and ecfg.check_weights != "never":
        buffers["weight check"] = WEIGHT_CHECK_BYTES
    if device == "cuda":
        streams = 2 + (report.get("generation_path") == "injected")
        capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        report["cublas"] = {"workspaces": streams, "bytes_each": cublas_workspace_bytes(capability)}
        buffers["cuBLAS workspaces"] = streams * report["cublas"]["bytes_each"]
    report["buffers"] = buffers
    resident = (sum(m["device_bytes"] for m in report["models"].values()) + report.get("inference_kept_bytes", 0)
                + sum(buffers.values()))
    # on CPU the process's own memory counts too: Python with torch and transformers loaded (this planner's, which
    # imports what a stage does); on CUDA the context is left out (see the module's notes)
    runtime = (process_memory("VmRSS") or 0) if device == "cpu" else 0
    report.update(phases=phases, resident_bytes=resident, runtime_bytes=runtime,
                  peak_bytes=runtime + resident + max(phases.values()))
    # the longest row a training engine is told of (its row_tokens; None: one pack of a micro-batch, not known ahead)
    row = next(m.row_tokens for m in models if m.trained)
    if device == "cpu":  # the host threshold the training engines set (engine.config.host_mmap_threshold)
        report["host_mmap"] = {"threshold_mb": host_mmap_threshold(ecfg, row), "row_tokens": row,
                               "min_row_tokens": ecfg.cpu_mmap_min_row_tokens}
    if device == "cpu" and ecfg.cpu_mmap_threshold_mb is None:  # glibc's own threshold: freed blocks stay resident
        report["allocator_note"] = ("engine.cpu_mmap_threshold_mb=null: glibc keeps freed blocks of up to 32 MiB in its "
                                    "heap, which this plan does not count (2,048-token responses: peak RSS 1.22x the "
                                    "plan); the default, engine.cpu_mmap_threshold_mb=16, returns those of 16 MiB or "
                                    "more where rows reach engine.cpu_mmap_min_row_tokens (1.06x; docs/engine.md)")
    if device == "cpu" and ecfg.precision == "bf16":  # what varying lengths add over steps (docs/algorithms.md)
        if ecfg.cpu_kernel_cache is None:
            report["shapes_note"] = (
                "engine.cpu_kernel_cache=null: oneDNN and ideep keep up to 1,024 bf16 kernels each, one per matrix "
                "shape, so with row lengths that vary between steps the process grows step after step past this "
                "plan (the tests' tiny model at 256 tokens: 1.8x by the eighth step; docs/engine.md)")
        elif not ecfg.cpu_trim_heap and long_rows(ecfg, row):
            report["shapes_note"] = (
                "engine.cpu_trim_heap=false: the heap keeps what each micro-batch frees, so with response lengths "
                "that vary between steps the training phase's peak grows past this plan (2,048 tokens: 1.34x by "
                "the third step; docs/algorithms.md)")
    worst = report["peak_bytes"]
    if split:
        report["generation_rank"] = g = split_generation_rank(cfg, actor, trainers=world, e=e, gen_len=gen_len)
        report["training_ranks"] = world
        worst = max(worst, g["peak_bytes"])
    report["fits"] = None if budget_gib <= 0 else worst <= budget_gib * GiB
    return report


def logits_bytes(tokens: int, vocab: int, e: int, ecfg) -> float:
    """A policy forward's log-prob memory: the head's [tokens, V] output, its fp32 copy and log_softmax's
    output; or, from the hidden states (engine.kernels=true: chunks of at most 256 MiB; past engine.max_logits_mb:
    chunks of at most that size), two [chunk, V] fp32 buffers."""
    full = tokens * vocab * 4
    if ecfg.kernels:
        return min(full, 256 * 2**20) * 2
    if ecfg.max_logits_mb is not None and full > ecfg.max_logits_mb * 2**20:
        return min(full, ecfg.max_logits_mb * 2**20) * 2
    return tokens * vocab * (e + 8)


def split_generation_rank(cfg, a: Arch, *, trainers: int, e: int, gen_len: int) -> dict:
    """A generation rank of engine.placement=split: the whole actor in the layout dtype (transformers generate on
    its own copy), the KV cache of the rows it samples (each of its trainers' rows: rollout rows / trainers x
    ceil(trainers / generation_ranks)), one bucket of the weight stream being received."""
    r, n_gen = cfg.rollout, cfg.engine.generation_ranks
    rows = r.prompts_per_step // trainers * r.n_samples_per_prompt * math.ceil(trainers / n_gen)
    weights = a.total * e
    kv = 2 * a.layers * rows * gen_len * a.kv * e
    bucket = min(cfg.engine.weight_bucket_mb * 2**20, weights)
    return {"ranks": n_gen, "rows": rows, "weight_bytes": weights, "kv_cache_bytes": kv, "bucket_bytes": bucket,
            "peak_bytes": weights + kv + bucket}


def candidates(stage: str, cfg, world: int) -> list[tuple[int, list[str]]]:
    """Changes that lower memory, cheapest first: (cost, overrides). Costs: +1 per ZeRO stage (more
    communication), +2 per halving of the micro-batch (more, smaller steps; same math; PPO with
    rollout.micro_batch_tokens: of the token budget, down to one whole row), +3 activation
    checkpointing (~1/3 more compute), +2 per frozen RL model offloaded, +10 CPU offload (stage 3)."""
    e = cfg.engine
    key = "rollout.micro_batch_size" if stage == "ppo" else "train.micro_batch_size"
    micro = cfg.rollout.micro_batch_size if stage == "ppo" else cfg.train.micro_batch_size
    micros = [micro >> k for k in range(micro.bit_length()) if (micro >> k) << k == micro]  # exact halvings
    if stage == "ppo" and cfg.rollout.micro_batch_tokens is not None:  # a token budget: its halvings, down to one row
        key, micro = "rollout.micro_batch_tokens", cfg.rollout.micro_batch_tokens
        longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
        micros = [micro >> k for k in range(micro.bit_length()) if micro >> k >= longest] or [micro]
    frozen = [k for k in ("reference.offload", "reward_model.offload") if stage == "ppo"]
    out = []
    for st, ac, mi, off, nf in itertools.product(range(e.stage, 4), (e.activation_checkpointing, True), micros,
                                                 (e.offload, True), range(len(frozen) + 1)):
        if off and st < 2:
            continue
        cost = (st - e.stage) + 3 * (ac != e.activation_checkpointing) + 2 * micros.index(mi) + 10 * (
            off != e.offload) + 2 * nf
        change = [f"engine.stage={st}"] * (st != e.stage) + ["engine.activation_checkpointing=true"] * (
            ac != e.activation_checkpointing) + [f"{key}={mi}"] * (mi != micro) + ["engine.offload=true"] * (
            off != e.offload) + [f"{k}=true" for k in frozen[:nf]]
        if change:
            out.append((cost, change))
    return sorted(out, key=lambda c: c[0])


def stage_config(args: list[str]) -> tuple[str, object, dict]:
    """Command-line words -> (stage, its typed config, the planner keys) (also used by `python -m rlhf.env`)."""
    mine, rest = dict(PLANNER_KEYS), []
    for a in args:
        k, sep, v = a.partition("=")
        (mine.__setitem__(k, v) if sep and k in PLANNER_KEYS else rest.append(a))
    stage = mine["stage"]
    if stage not in STAGES:
        raise ConfigError(f"stage={stage!r}: the planner knows the stages {', '.join(STAGES)}")
    try:
        mine.update(world_size=int(mine["world_size"]), rank=int(mine["rank"]), budget_gib=float(mine["budget_gib"]))
    except ValueError as e:
        raise ConfigError(f"world_size and rank must be integers, budget_gib a number ({e})") from None
    if mine["world_size"] < 1 or not 0 <= mine["rank"] < mine["world_size"] or mine["budget_gib"] < 0:
        raise ConfigError(f"need world_size >= 1, 0 <= rank < world_size and budget_gib >= 0; got {mine}")
    if mine["device"] not in ("cuda", "cpu"):
        raise ConfigError(f"device must be cuda or cpu, got {mine['device']!r}")
    rewrites = cli.check_overrides(rest, SCHEMAS[stage], CONF_DIR, f"rlhf.{stage}")
    return stage, to_config(compose(stage, [rewrites.get(a, a) for a in rest]), SCHEMAS[stage]), mine


def run_plan(args: list[str]) -> tuple[dict, list[str] | None]:
    """Command-line words -> (the plan, the cheapest overrides that fit, or None when it fits or no
    budget was given; [] when nothing fits)."""
    stage, cfg, mine = stage_config(args)
    world = mine["world_size"]

    def one(extra: list[str]) -> dict:  # the candidate's keys set on the typed config (no new compose)
        changed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.from_dotlist(extra)))
        return plan(stage, changed, world=world, rank=mine["rank"], device=mine["device"], budget_gib=mine["budget_gib"])

    report = one([])
    if report["fits"] is not False:
        return report, None
    for _, change in candidates(stage, cfg, world):
        if one(change)["fits"]:
            return report, change
    return report, []


def _g(n: float) -> str:
    return fmt_bytes(n)


def format_plan(report: dict, change: list[str] | None) -> str:
    r = report
    lines = [f"plan: stage {r['stage']}, {r['world_size']} rank(s), rank {r['rank']}, {r['device']} {r['precision']}, "
             f"ZeRO stage {r['zero_stage']}"]
    if "generation_rank" in r:
        g = r["generation_rank"]
        lines[0] += (f"; engine.placement=split: {r['training_ranks']} training rank(s) (below: a training rank, ZeRO "
                     f"over {r['training_ranks']}) + {g['ranks']} generation rank(s)")
    for name, m in r["models"].items():
        where = ", offloaded to CPU" if m["offload"] else ""
        if not m["trained"]:
            lines += [f"  {name} (frozen{where}): {m['total_params']:,} params {_g(m['param_bytes'])}",
                      f"    forward ({m['rows']:g} x {m['seq']} tokens, no grad): logits {_g(m['logits_bytes'])} | "
                      f"gathered params {_g(m['gathered_bytes'])}"]
            continue
        lines += [f"  {name} (trained{where}): {m['total_params']:,} params, {m['trainable_params']:,} trainable",
                  f"    params {_g(m['param_bytes'])} | grads {_g(m['grad_bytes'])} | optimizer {_g(m['optimizer_bytes'])}"
                  f" | model state {_g(m['model_state_bytes'])}",
                  f"    our layout {_g(m['layout_bytes'])} | ZeRO paper {m['zero_formula']} = {_g(m['zero_formula_bytes'])}",
                  f"    activations ({m['rows']:g} x {m['seq']} tokens) {_g(m['activation_bytes'])} | with checkpointing "
                  f"{_g(m['activation_ckpt_bytes'])} | logits {_g(m['logits_bytes'])} | gathered params {_g(m['gathered_bytes'])}"]
    if "kv_cache_bytes" in r:
        kept = " (kept between phases: engine.release_inference_cache=false)" if r.get("inference_kept_bytes") else ""
        lines.append(f"  generation: {r['generation_path']} path ({r['generation_why']}): KV cache {_g(r['kv_cache_bytes'])}"
                     f" | weights {_g(r['generation_weight_bytes'])}{kept}")
    if r.get("buffers"):
        parts = [f"{k} {_g(v)}" + (f" ({r['cublas']['workspaces']} x {_g(r['cublas']['bytes_each'])}: forward, "
                                     f"backward{', decode graphs' if r['cublas']['workspaces'] > 2 else ''})"
                                     if k == "cuBLAS workspaces" else "") for k, v in r["buffers"].items()]
        lines.append("  kept buffers: " + " | ".join(parts) + " (in resident)")
    runtime = f"the process {_g(r['runtime_bytes'])} + " if r.get("runtime_bytes") else ""
    lines.append(f"  {runtime}resident {_g(r['resident_bytes'])} + largest phase (" + ", ".join(
        f"{k} {_g(v)}" for k, v in r["phases"].items()) + f") = peak {_g(r['peak_bytes'])}")
    if "host_mmap" in r:
        h = r["host_mmap"]
        lines.append("  host allocator: " + (
            f"blocks of {h['threshold_mb']:g} MiB or more mapped apart (engine.cpu_mmap_threshold_mb; " + (
                f"rows of {h['row_tokens']} tokens >= engine.cpu_mmap_min_row_tokens={h['min_row_tokens']})"
                if h["row_tokens"] is not None else "one pack per micro-batch, data.pack_length=0: taken as long)")
            if h["threshold_mb"] is not None else "glibc's own mmap threshold (" + (
                "engine.cpu_mmap_threshold_mb=null)" if "allocator_note" in r else
                f"rows of {h['row_tokens']} tokens < engine.cpu_mmap_min_row_tokens={h['min_row_tokens']})")))
    lines += [f"  note: {r[k]}" for k in ("allocator_note", "shapes_note") if k in r]
    if "generation_rank" in r:
        g = r["generation_rank"]
        lines.append(f"  a generation rank: the actor's weights {_g(g['weight_bytes'])} | KV cache ({g['rows']} rows) "
                     f"{_g(g['kv_cache_bytes'])} | a weight-stream bucket {_g(g['bucket_bytes'])} = peak {_g(g['peak_bytes'])}")
    if r["fits"] is not None:
        verdict = "fits" if r["fits"] else "does NOT fit"
        lines.append(f"  budget {_g(r['budget_bytes'])}: {verdict}")
    if change:
        lines.append(f"  cheapest change that fits: {' '.join(change)}")
    elif change == []:
        lines.append("  no combination of ZeRO stage, offload, activation checkpointing and micro-batch fits: "
                     "more ranks or a smaller model")
    return "\n".join(lines)
