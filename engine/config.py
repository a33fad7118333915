"""Typed configuration of the training engine.

The engine knows nothing about RLHF: these dataclasses are all it reads. The stage apps in `rlhf/`
build them from Hydra YAML once, at start, and pass them down (EngineConfig is their `engine` group's
schema itself).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .distributed import DistInfo

# NOTE: no torch import at run time: the stage configs (rlhf/config/schema.py) import this module, and
# scripts/stage_plan.py composes them in ~1 s without loading torch. The dtypes: parallelize.TORCH_DTYPES.
PRECISIONS = ("fp32", "bf16", "fp16")
GENERATION_PATHS = ("auto", "injected", "hf", "vllm")
SELFCHECK = ("auto", "true", "false")
CHECK_WEIGHTS = ("every", "first", "never")
PLACEMENTS = ("colocated", "split")


@dataclass(kw_only=True, slots=True)
class VLLMConfig:
    """`engine.vllm.*`: the in-process vLLM engine of `engine.generation=vllm` (engine/vllm_backend.py)."""

    gpu_memory_utilization: float = 0.3  # CUDA: the share of the GPU's memory vLLM may take (weights + KV cache)
    kv_cache_gib: float = 1.0  # CPU: GiB of KV cache (vLLM's CPU backend sizes it explicitly, no profiling)
    max_model_len: int | None = None  # prompt + response tokens per sequence (null: the model's max_position_embeddings)
    tensor_parallel_size: int = 1  # GPUs one engine spans (within a node); 1 = one engine per rank
    enforce_eager: bool = True  # true: no CUDA graphs / torch.compile in vLLM (faster start); false: graphs
    enable_prefix_caching: bool = True  # reuse the KV cache of shared prompt prefixes (a GRPO group's prompt)
    sleep: bool = True  # CUDA: vLLM's sleep mode between generation phases (memory back to training)
    max_num_seqs: int = 256  # rows vLLM schedules at once


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """How a model is partitioned and computed (DeepSpeed ZeRO vocabulary, FSDP2 underneath).

    stage 0 = DDP; 1 = DDP + ZeroRedundancyOptimizer; 2 = FSDP2 fully_shard(reshard_after_forward=False);
    3 = FSDP2 fully_shard(reshard_after_forward=True).

    Also the schema of the stage apps' `engine` config group (conf/engine/*.yaml), used as is: each
    field's trailing comment is its description in their `--help`.
    """

    stage: int = 0  # ZeRO stage: 0 DDP, 1 + sharded optimizer, 2 FSDP2 (grads), 3 FSDP2 (params)
    # CPUOffloadPolicy: sharded params/grads/optimizer step live on the CPU (stage 2/3; FrozenEngine:
    # any stage, moved by hand).
    offload: bool = False  # params/grads/optimizer step on the CPU (stage 2/3; frozen models: any stage)
    # "auto" = bf16 on CUDA and on a CPU with native bf16 dot products (AVX512-BF16 or AMX), fp32 on
    # other CPUs: `resolve_precision` makes it concrete before the config reaches TrainEngine / FrozenEngine.
    precision: str = "fp32"  # fp32 | bf16 | fp16 (dynamic loss scaling, CUDA only) | auto (bf16 on CUDA and bf16-capable CPUs, else fp32)
    activation_checkpointing: bool = False  # recompute each transformer block in backward (less memory)
    # torch.compile each transformer block in place (nn.Module.compile: state-dict names unchanged),
    # before DDP / fully_shard wrap it, as torchtitan does; the model's other parts and generation
    # (compiler stance force_eager) stay eager. The first steps pay the compilation, reported apart
    # (`compile_seconds`, summary.json compile_s). Needs a C++ compiler on CPU (inductor).
    compile: bool = False  # torch.compile each transformer block (compile time reported apart in summary.json)
    initial_loss_scale: float = 65536.0  # fp16 only: the first loss scale
    loss_scale_window: int = 1000  # fp16: steps without overflow before the scale doubles
    min_loss_scale: float = 1.0  # fp16: the scale never goes below this
    # Costs a graph traversal per step. FSDP2 (stage 2/3) needs no such flag.
    find_unused_parameters: bool = False  # stage 0/1 (DDP): some trainable params get no gradient
    # Generation mode (`TrainEngine.generation()`): "injected" = engine.inference (fused weights,
    # static KV cache, CUDA graphs) for supported architectures (Llama family, OPT), "hf" =
    # transformers `generate`, "auto" = injected on CUDA, hf elsewhere (engine/generation.py
    # AUTO_RULE, measured in docs/engine.md). An unsupported model falls back
    # to hf, logged once.
    # "vllm" = an in-process vLLM engine per rank (engine/vllm_backend.py: paged attention, continuous
    # batching, prefix cache), fed by the same weight sync and checked by the same fingerprints.
    generation: str = "auto"  # auto (injected on CUDA for Llama-family/OPT, else hf) | injected | hf | vllm
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # engine.generation=vllm: the vLLM engine's settings
    # Fused kernels (kernels/) in the model's forwards: norms, SwiGLU, rotary, and log-probs/entropy
    # straight from hidden states (engine/kernel_injection.py). Triton on CUDA, references elsewhere.
    kernels: bool = False  # fused kernels: norms, SwiGLU, rotary, log-probs from hidden states
    # A policy forward whose [rows, length, vocab] float32 logits would exceed this many MiB takes its log-probs
    # and entropy from the hidden states instead, a [chunk, vocab] slice of at most this size at a time
    # (kernels.fused_logprobs_entropy: chunked PyTorch on CPU, Triton on CUDA), so long responses never hold the
    # whole logits. null = the model's own logits always (engine.kernels=true chunks at 256 MiB anyway).
    # The default is measured (scripts/bench_logits.py, docs/engine.md).
    max_logits_mb: float | None = 256.0  # MiB of fp32 logits a policy forward may materialise; above: chunked log-probs
    # Free the injected model's weights, KV cache and CUDA graphs on leaving generation mode (memory
    # for training) instead of keeping them for the next phase (an in-place weight refresh).
    release_inference_cache: bool = False  # free the injected weights/KV cache/graphs after each generation phase
    # Host memory on the CPU (glibc; a no-op elsewhere, engine/memory.py). Freed blocks stay in the heap, so a
    # process's resident memory stays near its high-water mark and a phase's freed sizes rarely fit the next
    # phase's: allocations of at least this many MiB get their own mapping, returned to the system when freed.
    # null: glibc's own (dynamic) threshold, which rises to 32 MiB and puts long rows' activations in the heap (the
    # peak RSS of 2,048-token responses 1.16x the threshold's). Rows shorter than cpu_mmap_min_row_tokens keep
    # glibc's own: there the threshold saved no memory and cost up to 4.5% of a 128-token GRPO step (docs/engine.md).
    cpu_mmap_threshold_mb: float | None = 16  # CPU: host allocations >= this many MiB are mapped apart and freed to the system (glibc); null = glibc's own threshold
    cpu_mmap_min_row_tokens: int = 512  # CPU: apply cpu_mmap_threshold_mb only where the training engine's longest row has >= this many tokens (0 = always)
    cpu_trim_heap: bool = True  # CPU: give the heap's free pages back to the system at each switch between generation and training, and where rows reach cpu_mmap_min_row_tokens after each micro-batch's backward (glibc malloc_trim)
    # bf16 kernels on the CPU (oneDNN) are made per matrix shape and cached with their buffers, in oneDNN's primitive
    # cache and in ideep's (PyTorch's) LRU cache, 1,024 entries each by default: with response lengths that vary from
    # step to step every step brings new shapes, and the process grew by ~85 MiB a step (measured: docs/engine.md).
    # At 64 entries it stays flat; a step's reuse is its layers' (the same shapes in a row), and the 128-token GRPO
    # step measured 0.98x, within a step's noise here.
    cpu_kernel_cache: int | None = 64  # CPU: entries of oneDNN's and ideep's kernel caches (ONEDNN_PRIMITIVE_CACHE_CAPACITY, LRU_CACHE_CAPACITY; the environment's own values win); null = the libraries' 1024
    # The injected decoder decodes only the rows still running once a quarter of them have ended (their KV
    # cache rows and step state moved to the front; batch sizes in buckets under CUDA graphs): finished rows
    # stop costing compute. Measured in docs/engine.md. Not applied under engine.deterministic (a row's
    # numerics would depend on when the other rows of its batch end).
    compact_finished: bool = True  # injected decoder: stop computing rows that have ended (compact the batch)
    # A rank that waits longer than this in a collective (another rank died or hangs) fails instead of
    # hanging for good; rank-0-only work between collectives (export, pruning) must stay well under it.
    timeout_s: float = 1800.0  # process-group timeout in seconds (torchrun runs)
    # The first use in a run of the injected decoder and of each Triton kernel is compared with its
    # reference on a small slice (engine/generation.py decoder_mismatch, kernels/dispatch.py guarded);
    # a mismatch or an exception: one warning line, and the reference path for the rest of the run.
    selfcheck: str = "auto"  # check the fast paths on first use: auto (on CUDA) | true | false
    # On entering generation mode, a fingerprint of every tensor of the generation layout (the
    # injected model's fused slots, LoRA merged; or the gathered module transformers generate uses)
    # is compared with the training parameters it came from (engine/weight_check.py); a mismatch is
    # a WeightCheckError naming the tensor, before a token is sampled. Measured cost: docs/engine.md.
    check_weights: str = "every"  # compare the generation weights with the training parameters: every (switch to generation) | first | never
    # Deterministic mode (engine/determinism.py): torch's deterministic algorithms, and generation whose
    # tokens and log-probs do not depend on the batch (generation.BatchInvariantGenerator: per-row sampling
    # streams from the caller's row seeds, fixed-size forwards, SDPA's math backend). Bit for bit on the
    # same machine and world size; see docs/engine.md for the cost and what holds only to a tolerance.
    deterministic: bool = False  # runs repeat bit for bit (same machine, world size); batch-invariant sampling
    # Deterministic mode only: every generation forward runs exactly this many rows (a batch is cut into
    # chunks, the last one filled with copies), since GEMM kernels are chosen by the row count.
    deterministic_rows: int = 64  # engine.deterministic: rows per generation forward (chunks; the last one padded)
    # Split placement (engine/distributed.py split_world): in one torchrun job the first ranks train (ZeRO
    # over their own process group) and the last engine.generation_ranks ranks only generate, each with a
    # whole copy of the model, refreshed after each optimizer step by the weight stream
    # (engine/weight_stream.py: large flat buckets in the generation layout, checked on arrival).
    placement: str = "colocated"  # colocated (every rank generates, then trains) | split (the last generation_ranks ranks only generate; RL)
    generation_ranks: int = 1  # placement=split: how many of the job's ranks generate (the last ones; the rest train)
    weight_bucket_mb: float = 256.0  # placement=split: MiB per bucket of the weight stream (one broadcast each)
    # Read by the stage apps' command line only (rlhf/config/ds_config.py), never by the engine: the file's
    # settings become overrides placed before the user's, so the command line wins.
    ds_config: str | None = None  # a DeepSpeed ds_config.json whose keys fill this config (see docs/deepspeed.md)


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with weight-decay groups and a warmup + decay learning-rate schedule."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    scheduler: str = "cosine"  # constant | linear | cosine
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio for linear/cosine
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 dot products natively (AVX512-BF16 or AMX tiles), where oneDNN's
    bf16 matmul is the faster one (2.4x fp32 for the tiny default's [1536, 192] x [192, 512] on an
    AVX512-BF16 core); elsewhere bf16 is emulated and slower than fp32."""
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def long_rows(cfg: EngineConfig, row_tokens: int | None) -> bool:
    """Whether the longest row a training engine trains on (`row_tokens`; None = not known, taken as long) reaches
    engine.cpu_mmap_min_row_tokens: where the host allocator's threshold and the heap trims after each micro-batch
    apply on the CPU."""
    return row_tokens is None or row_tokens >= cfg.cpu_mmap_min_row_tokens


def host_mmap_threshold(cfg: EngineConfig, row_tokens: int | None) -> float | None:
    """The host allocator's mmap threshold (MiB) a training engine on the CPU sets, or None for glibc's own:
    engine.cpu_mmap_threshold_mb where its rows are long (`long_rows`)."""
    return cfg.cpu_mmap_threshold_mb if long_rows(cfg, row_tokens) else None


def resolve_precision(cfg: EngineConfig, device: torch.device) -> EngineConfig:
    """`precision="auto"` made concrete for `device` (a copy): bf16 on CUDA and on a CPU with native
    bf16 (`cpu_has_bf16`), fp32 elsewhere; any other config is returned as it is. Call it before
    TrainEngine / FrozenEngine, which take no "auto"."""
    if cfg.precision != "auto":
        return cfg
    bf16 = device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16())
    return dataclasses.replace(cfg, precision="bf16" if bf16 else "fp32")

def selfcheck_enabled(cfg: EngineConfig, device_type: str) -> bool:
    """`engine.selfcheck` for a `device_type` device: auto = on CUDA (true/false as written; a YAML or
    command-line boolean arrives as "True"/"False" in this string field)."""
    value = str(cfg.selfcheck).lower()
    return device_type == "cuda" if value == "auto" else value == "true"


def validate_engine_config(cfg: EngineConfig, info: DistInfo, *, frozen: bool = False) -> None:
    """Reject combinations that cannot work here, at construction, naming the key (`engine.<field>`).

    `frozen` (FrozenEngine): offload is allowed at every stage (stage 0/1 move the model by hand).
    """
    if cfg.stage not in (0, 1, 2, 3):
        raise ValueError(f"engine.stage must be 0, 1, 2 or 3 (ZeRO stages), got {cfg.stage!r}")
    if not cfg.timeout_s > 0:
        raise ValueError(f"engine.timeout_s must be > 0 seconds, got {cfg.timeout_s!r}")
    if cfg.precision == "auto":
        raise ValueError("engine.precision=auto must be resolved for the device first (engine.config.resolve_precision)")
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"engine.precision must be one of {PRECISIONS} (or auto), got {cfg.precision!r}")
    if cfg.generation not in GENERATION_PATHS:
        raise ValueError(f"engine.generation must be one of {GENERATION_PATHS}, got {cfg.generation!r}")
    if str(cfg.selfcheck).lower() not in SELFCHECK:
        raise ValueError(f"engine.selfcheck must be one of {SELFCHECK}, got {cfg.selfcheck!r}")
    if cfg.check_weights not in CHECK_WEIGHTS:
        raise ValueError(f"engine.check_weights must be one of {CHECK_WEIGHTS}, got {cfg.check_weights!r}")
    if not isinstance(cfg.compact_finished, bool):
        raise ValueError(f"engine.compact_finished must be true or false, got {cfg.compact_finished!r}")
    if not isinstance(cfg.cpu_trim_heap, bool):
        raise ValueError(f"engine.cpu_trim_heap must be true or false, got {cfg.cpu_trim_heap!r}")
    mmap_mb = cfg.cpu_mmap_threshold_mb
    if mmap_mb is not None and (isinstance(mmap_mb, bool) or not isinstance(mmap_mb, (int, float))
                                or not mmap_mb > 0):
        raise ValueError(f"engine.cpu_mmap_threshold_mb must be null (glibc's default) or a size in MiB > 0, "
                         f"got {mmap_mb!r}")
    rows = cfg.cpu_mmap_min_row_tokens
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"engine.cpu_mmap_min_row_tokens must be an integer >= 0 (tokens of the longest row; 0 = "
                         f"always), got {rows!r}")
    cache = cfg.cpu_kernel_cache
    if cache is not None and (isinstance(cache, bool) or not isinstance(cache, int) or cache < 0):
        raise ValueError(f"engine.cpu_kernel_cache must be null (the libraries' 1024) or an integer >= 0 (entries; "
                         f"0 = no cache: each bf16 kernel made anew, ~2x slower), got {cache!r}")
    if not isinstance(cfg.deterministic, bool):
        raise ValueError(f"engine.deterministic must be true or false, got {cfg.deterministic!r}")
    if isinstance(cfg.deterministic_rows, bool) or not isinstance(cfg.deterministic_rows, int) \
            or cfg.deterministic_rows < 1:
        raise ValueError(f"engine.deterministic_rows must be an integer >= 1 (rows per generation forward), "
                         f"got {cfg.deterministic_rows!r}")
    if cfg.placement not in PLACEMENTS:
        raise ValueError(f"engine.placement must be one of {PLACEMENTS}, got {cfg.placement!r}")
    if isinstance(cfg.generation_ranks, bool) or not isinstance(cfg.generation_ranks, int) or cfg.generation_ranks < 1:
        raise ValueError(f"engine.generation_ranks must be an integer >= 1 (ranks that generate under "
                         f"engine.placement=split), got {cfg.generation_ranks!r}")
    if cfg.max_logits_mb is not None and not (isinstance(cfg.max_logits_mb, (int, float)) and cfg.max_logits_mb > 0):
        raise ValueError(f"engine.max_logits_mb must be null (the model's logits always) or > 0 (MiB of float32 logits "
                         f"a policy forward may hold), got {cfg.max_logits_mb!r}")
    if not (isinstance(cfg.weight_bucket_mb, (int, float)) and cfg.weight_bucket_mb > 0):
        raise ValueError(f"engine.weight_bucket_mb must be > 0 (MiB per bucket of the weight stream), "
                         f"got {cfg.weight_bucket_mb!r}")
    v = cfg.vllm
    if not 0 < v.gpu_memory_utilization <= 1:
        raise ValueError(f"engine.vllm.gpu_memory_utilization must be in (0, 1], got {v.gpu_memory_utilization!r}")
    if not v.kv_cache_gib > 0:
        raise ValueError(f"engine.vllm.kv_cache_gib must be > 0 (GiB of KV cache on CPU), got {v.kv_cache_gib!r}")
    if v.max_model_len is not None and (isinstance(v.max_model_len, bool) or v.max_model_len < 1):
        raise ValueError(f"engine.vllm.max_model_len must be null or an integer >= 1, got {v.max_model_len!r}")
    if isinstance(v.max_num_seqs, bool) or v.max_num_seqs < 1:
        raise ValueError(f"engine.vllm.max_num_seqs must be an integer >= 1, got {v.max_num_seqs!r}")
    if isinstance(v.tensor_parallel_size, bool) or v.tensor_parallel_size < 1:
        raise ValueError(f"engine.vllm.tensor_parallel_size must be an integer >= 1, got {v.tensor_parallel_size!r}")
    if cfg.generation == "vllm":
        if v.tensor_parallel_size != 1:
            raise ValueError(f"engine.vllm.tensor_parallel_size={v.tensor_parallel_size}: this version runs one vLLM "
                             "engine per rank (tensor_parallel_size=1); shard a larger actor's training with ZeRO "
                             "and generate on split ranks (engine.placement=split) instead")
        if cfg.deterministic:
            raise ValueError("engine.deterministic=true with engine.generation=vllm: vLLM's scheduler batches rows "
                             "as they come, so its logits are not batch-invariant; a vllm run repeats and resumes "
                             "exactly through per-row seeds on the same machine and world size (engine.deterministic="
                             "false), or use engine.generation=hf for bit-for-bit runs")
    if cfg.precision == "fp16" and info.device.type != "cuda":
        raise ValueError(
            f"engine.precision=fp16 needs a CUDA device (device here: {info.device}); "
            "use engine.precision=bf16 or fp32 on CPU"
        )
    if cfg.offload and cfg.stage < 2 and not frozen:
        raise ValueError(
            f"engine.offload=true needs engine.stage 2 or 3 (FSDP2 CPUOffloadPolicy); "
            f"engine.stage={cfg.stage} is DDP, which keeps full params on the device"
        )
    if not cfg.initial_loss_scale > 0:
        raise ValueError(f"engine.initial_loss_scale must be > 0, got {cfg.initial_loss_scale}")
    if cfg.loss_scale_window < 1:
        raise ValueError(f"engine.loss_scale_window must be >= 1, got {cfg.loss_scale_window}")
    if not 0 < cfg.min_loss_scale <= cfg.initial_loss_scale:
        raise ValueError(
            f"engine.min_loss_scale must be in (0, engine.initial_loss_scale], got {cfg.min_loss_scale}"
        )
