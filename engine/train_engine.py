"""TrainEngine (a model + its optimizer over the ranks) and FrozenEngine (a model without gradients).

One optimizer step (`train_step`), for this rank's micro-batches mb_1..mb_k:
    forward mb_1 -> all-reduce its weight once: normaliser Z = k * sum_ranks(w_1)   (before any backward;
                    Z = W exactly when the caller passes the global weight, `total_weight`)
    for each mb_i: forward, backward of loss_sum_i * (N * loss_scale / Z)   (gradient sync on the last only)
    all-reduce [sum loss_sum, sum w, metrics * w] -> W = global weight
    grads *= (Z / W) / loss_scale            exact normalisation by the global weight, and fp16 unscale
    global grad norm (all-reduced over shards) -> inf/nan: skip the step; else clip, step, schedule
DDP and FSDP2 both *average* gradients over the N ranks, hence the factor N. With one micro-batch
Z == W exactly and the correction is skipped; with several, Z only estimates W from the first
micro-batch (gradient accumulation cannot know the later weights before the first backward without
holding every graph) and the correction makes the result exact, while gradient magnitudes stay near
their normalised size in the meantime (which matters for fp16).
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .checkpoint import (
    ENGINE_META,
    load_model_optimizer,
    load_rank_state,
    published,
    rank_file,
    read_meta,
    rng_state,
    save_model_optimizer,
    save_rank_state,
    set_rng_state,
    write_meta,
)
from .config import EngineConfig, OptimConfig, host_mmap_threshold, long_rows, selfcheck_enabled, validate_engine_config
from .errors import CheckpointError
from .lora import lora_layers, merge_lora
from .distributed import DistInfo, all_reduce_sum, barrier, group, init_distributed
from .loss_scale import DynamicLossScaler, global_grad_norm, scale_grads_
from .memory import PhasePeaks, memory_report, set_cpu_kernel_cache, set_mmap_threshold, tensor_bytes, trim_host_heap
from .optim import build_optimizer, build_scheduler, validate_optim_config
from .parallelize import TORCH_DTYPES, clean_name, hf_base_model, inner_module, parallelize
from .vllm_backend import ExpectedWeights, VLLMGenerator, VLLMRollout
from .weight_check import expected_tap, hf_name, mismatches, raise_on_any_rank, sharded_fingerprints

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, dict], tuple[torch.Tensor, "torch.Tensor | float", dict]]


def _materialize_meta(model: nn.Module, info: DistInfo) -> None:
    """A model built on the meta device gets CPU storage and a random init (HF `init_weights`), the
    same on every rank (rank 0's values are broadcast before any sharding)."""
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return
    base = hf_base_model(model)
    if not callable(getattr(base, "init_weights", None)):
        raise ValueError(
            "the model is on the meta device and is not a transformers model with init_weights(); "
            "build it on the CPU (e.g. from_pretrained) before creating the engine"
        )
    model.to_empty(device="cpu")
    with torch.no_grad():
        base.init_weights()  # also recomputes non-persistent buffers such as rotary inv_freq
    if info.world_size > 1:
        import torch.distributed as dist

        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0 if group() is None else dist.get_global_rank(group(), 0), group=group())


def _set_kernel_selfcheck(cfg: EngineConfig) -> None:
    """`engine.selfcheck` for the kernels' first-use check (process-wide, like the kernels themselves):
    auto leaves it to the kernels (on for CUDA tensors), true / false force it."""
    from kernels.dispatch import set_selfcheck

    value = str(cfg.selfcheck).lower()
    set_selfcheck(None if value == "auto" else value == "true")


def _maybe_inject_kernels(model: nn.Module, cfg: EngineConfig, info: DistInfo) -> None:
    """engine.kernels=true: fused kernels into the module's forwards (engine/kernel_injection.py)."""
    if not cfg.kernels:
        return
    from .kernel_injection import inject_kernels

    replaced = inject_kernels(model)
    if info.is_main:
        logger.info("engine.kernels=true: %s (%s)", ", ".join(replaced) or "nothing to replace",
                    "Triton" if info.device.type == "cuda" else "PyTorch references off CUDA")


class _ShardedModule:
    """What TrainEngine and FrozenEngine share: gathering and exporting a possibly sharded module."""

    cfg: EngineConfig
    info: DistInfo
    model: nn.Module
    unwrapped: nn.Module
    _fsdp_units: list[tuple[nn.Module, bool]]

    @property
    def inner(self) -> nn.Module:
        """The module under the engine's wrappers and any `ModuleView`: the transformers model (or
        its peft wrapper) whose state dict names `full_state_dict` returns; what an export saves."""
        return inner_module(self.unwrapped)

    def eval(self) -> None:
        self.model.eval()

    def train(self) -> None:
        self.model.train()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Consolidated CPU state dict on rank 0 (None elsewhere); clean FQNs, storage dtype. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {clean_name(k): v for k, v in sd.items()} if self.info.is_main else None

    @contextlib.contextmanager
    def gathered_parameters(self):
        """Full params on the module for the duration (all-gathered once, not per forward). Collective.

        Stage 2/3: every FSDP unit is unsharded and told not to reshard after forward; on exit the
        setting is restored and the units reshard. Stage 0/1: params are already whole, a no-op.
        """
        if not self._fsdp_units:
            yield
            return
        for unit, _ in self._fsdp_units:
            unit.set_reshard_after_forward(False, recurse=False)
        for unit, _ in self._fsdp_units:
            unit.unshard()
        try:
            yield
        finally:
            for unit, reshard in self._fsdp_units:
                unit.set_reshard_after_forward(reshard, recurse=False)
                unit.reshard()

    def named_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(clean name, full tensor) for every parameter, gathering one FSDP unit at a time. Collective.

        A yielded tensor is only valid until the next item (its unit is resharded then): copy it.
        Under mixed precision the gathered tensor is the compute-dtype copy (what an inference model
        wants); stage 0/1 yields the fp32 params themselves.
        """
        named = list(self.unwrapped.named_parameters())
        if not self._fsdp_units:
            for name, p in named:
                yield clean_name(name), p.detach()
            return
        prefixes = {id(m): name for name, m in self.unwrapped.named_modules()}
        unit_prefix = [(unit, prefixes[id(unit)]) for unit, _ in self._fsdp_units]

        def owner(fqn: str) -> nn.Module:  # the innermost unit whose module path contains the param
            best, best_len = None, -1
            for unit, prefix in unit_prefix:
                if (prefix == "" or fqn.startswith(prefix + ".")) and len(prefix) > best_len:
                    best, best_len = unit, len(prefix)
            return best

        owned = {id(unit): [] for unit, _ in self._fsdp_units}
        for name, _ in named:
            owned[id(owner(name))].append(name)
        for unit, _ in self._fsdp_units:
            unit.unshard()
            for name in owned[id(unit)]:
                yield clean_name(name), self.unwrapped.get_parameter(name).detach()
            unit.reshard()

    def _base_memory_report(self, optimizer, grad_bytes: int | None) -> dict:
        return memory_report(
            self.unwrapped,
            optimizer,
            stage=self.cfg.stage,
            world_size=self.info.world_size,
            rank=self.info.rank,
            grad_bytes=grad_bytes,
        )


_KERNEL_CACHE_LOGGED: list = []


def _kernel_cache(entries: int | None) -> None:
    """engine.cpu_kernel_cache: the CPU's bf16 kernel caches bounded (engine/memory.py), logged once a process."""
    applied = set_cpu_kernel_cache(entries)
    if applied and applied not in _KERNEL_CACHE_LOGGED:
        _KERNEL_CACHE_LOGGED.append(applied)
        mine = all(v == str(entries) for v in applied.values())
        logger.info("CPU kernel caches: %s (%s)", ", ".join(f"{k}={v}" for k, v in applied.items()),
                    "engine.cpu_kernel_cache" if mine else f"the environment's; engine.cpu_kernel_cache={entries} "
                    "applies where a variable is unset")


class TrainEngine(_ShardedModule):
    """A trainable model sharded per `engine_cfg.stage`, with AdamW, an LR schedule and loss scaling."""

    def __init__(
        self,
        model: nn.Module,
        engine_cfg: EngineConfig,
        optim_cfg: OptimConfig,
        *,
        total_steps: int,
        info: DistInfo | None = None,
        row_tokens: int | None = None,
    ):
        """`row_tokens`: the longest row (tokens) this engine will train on, if known: on the CPU the host
        allocator's threshold applies from engine.cpu_mmap_min_row_tokens on (engine.config.host_mmap_threshold)."""
        info = info or init_distributed()
        validate_engine_config(engine_cfg, info)
        validate_optim_config(optim_cfg, total_steps)
        self.cfg, self.optim_cfg, self.info = engine_cfg, optim_cfg, info
        _set_kernel_selfcheck(engine_cfg)
        _materialize_meta(model, info)
        _maybe_inject_kernels(model, engine_cfg, info)
        if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
            model.float()  # fp32 master weights; compute dtype comes from the precision policy
        model.train()
        par = parallelize(model, engine_cfg, info)
        self.model, self.unwrapped, self._fsdp_units = par.model, par.unwrapped, par.fsdp_units
        self._sharded = engine_cfg.stage >= 2  # gradients are shards (FSDP2) rather than replicas (DDP)
        # transformers checkpoints a block (engine.activation_checkpointing) only while that block is in
        # training mode; a caller that keeps the model in eval() (the RL stage: no training-only branches)
        # would silently train without it, so train_step holds these blocks' own flag (not their children's:
        # dropout stays as the caller set it) in training mode
        self._checkpointed = [m for m in self.unwrapped.modules() if getattr(m, "gradient_checkpointing", False) is True]
        self._zero1 = engine_cfg.stage == 1
        self._gen_path: str | None = None  # generation(): "injected" | "hf", chosen on first use
        self._inference = None  # the injected InferenceModel, kept between generation phases
        self._vllm = None  # engine.generation=vllm: the VLLMRollout, built on first use and kept
        self.sync_stats = None  # the last weight sync into vLLM (engine/vllm_backend.py SyncStats)
        self.phase_peaks = PhasePeaks(info.device)  # peak memory of the generation and training phases
        if info.device.type == "cpu":
            _kernel_cache(engine_cfg.cpu_kernel_cache)
        mmap_mb = host_mmap_threshold(engine_cfg, row_tokens) if info.device.type == "cpu" else None
        # engine.cpu_trim_heap where rows are long (the threshold's floor): also after each micro-batch's backward.
        # The heap's blocks under the threshold that a micro-batch frees stay resident, and with widths that vary
        # the next micro-batches rarely reuse them: the training phase's peak grew from step to step (2,048 tokens,
        # ends spread: 5.02 GiB at the second step, 3.93 with these trims; docs/engine.md)
        self._trim_each_micro_batch = (info.device.type == "cpu" and engine_cfg.cpu_trim_heap
                                       and long_rows(engine_cfg, row_tokens))
        if mmap_mb is not None and not set_mmap_threshold(mmap_mb):  # the host allocator (glibc only)
            logger.warning("engine.cpu_mmap_threshold_mb=%s does nothing here: the C library is not glibc (or refused "
                           "the value); host allocations keep the C library's own rule", mmap_mb)
        # engine.selfcheck: the injected decoder is compared with transformers on its first use
        self._check_decoder_first = selfcheck_enabled(engine_cfg, info.device.type)
        # the mergeable LoRA layers ({} without adapters; None: adapters the injected model cannot take)
        self._lora = lora_layers(inner_module(self.unwrapped))
        self.weight_checks = 0  # engine.check_weights: checks run so far (generation() entries checked)
        self.weight_check_s = 0.0  # the last check's seconds (fingerprints and comparison)
        self.optimizer = build_optimizer(self.unwrapped, optim_cfg, zero1=self._zero1)
        self.scheduler = build_scheduler(self.optimizer, optim_cfg, total_steps)
        self.scaler = DynamicLossScaler(
            enabled=engine_cfg.precision == "fp16",
            init_scale=engine_cfg.initial_loss_scale,
            window=engine_cfg.loss_scale_window,
            min_scale=engine_cfg.min_loss_scale,
        )
        self._trainable = [p for p in self.unwrapped.parameters() if p.requires_grad]
        self.global_step = 0  # train_step calls, skipped ones included
        self.skipped_steps = 0  # steps that updated nothing: non-finite gradients, or empty ones
        self.empty_steps = 0  # of those, steps whose global loss weight was 0
        self._grad_bytes: int | None = None
        self._cuda_peak: int | None = None
        self.rank_extra: Any = None  # set by load_checkpoint
        self.not_restored: list[str] = []  # set by load_checkpoint: what another world size / precision lost

    # ------------------------------------------------------------ one optimizer step

    def _grad_sync(self, enabled: bool):
        """Gradient communication only on the last micro-batch of a step."""
        if self._sharded:
            self.model.set_requires_gradient_sync(enabled)
            return contextlib.nullcontext()
        if enabled or self.model is self.unwrapped:  # one rank at stage 0/1: no DDP, nothing to hold back
            return contextlib.nullcontext()
        return self.model.no_sync()

    def _to_device(self, batch: dict) -> dict:
        dev = self.info.device
        return {k: v.to(dev, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    @contextlib.contextmanager
    def _checkpointing(self) -> Iterator[None]:
        """transformers' checkpointed blocks in training mode (their own flag) for a forward and backward."""
        was = [m.training for m in self._checkpointed]
        for m in self._checkpointed:
            m.training = True
        try:
            yield
        finally:
            for m, t in zip(self._checkpointed, was):
                m.training = t

    def train_step(self, micro_batches: list[dict], loss_fn: LossFn, total_weight: float | None = None
                   ) -> dict[str, Any]:
        """Forward + backward over `micro_batches` (this rank's share of one step), then one update.

        loss_fn(model, micro_batch) -> (loss_sum, weight, metrics): the loss *summed* over `weight`
        units (tokens, sequences); metrics are per-micro-batch means with the same keys on every
        micro-batch and rank (they are all-reduced as one packed tensor). The micro-batch's top-level
        tensors are moved to the device first. Returns loss (global weighted mean), grad_norm
        (pre-clip), lr (used by this step), skipped (non-finite gradients, or `empty`: a global weight
        of 0; either way nothing was updated), empty, loss_scale, weight (global) and the metrics'
        means weighted by `weight`. Collective: every rank calls it with the same number of micro-batches.
        `total_weight`: the step's global weight (every rank's micro-batches), when the caller knows it
        before the forwards (a function of the inputs, e.g. token counts all-reduced once): the gradients
        are normalised by it exactly (Z = W, no estimate and no correction), and a sum of the returned
        weights that differs from it raises (the loss and its caller disagree on the units).
        """
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        n, world, dev = len(micro_batches), self.info.world_size, self.info.device
        loss_scale = self.scaler.scale
        acc = torch.zeros(2, dtype=torch.float64, device=dev)  # [sum loss_sum, sum weight]
        metric_sums: dict[str, torch.Tensor] = {}
        normaliser = None if total_weight is None else (float(total_weight) if total_weight > 0 else 1.0)
        for i, mb in enumerate(micro_batches):
            with self._grad_sync(i == n - 1), self._checkpointing():
                loss_sum, weight, metrics = loss_fn(self.model, self._to_device(mb))
                w = torch.as_tensor(weight, dtype=torch.float64, device=dev).detach()
                if normaliser is None:
                    # NOTE: all-reduced before the first backward so every rank scales by the same Z.
                    est = all_reduce_sum(w.clone()).item() * n
                    normaliser = est if est > 0 else 1.0
                (loss_sum * (world * loss_scale / normaliser)).backward()
            acc[0] += loss_sum.detach().double()
            acc[1] += w
            for k, v in metrics.items():
                v = torch.as_tensor(v, dtype=torch.float64, device=dev).detach() * w
                metric_sums[k] = metric_sums[k] + v if k in metric_sums else v
            if self._trim_each_micro_batch:
                del loss_sum  # the micro-batch's last tensor here: what it freed goes back to the system
                trim_host_heap()

        names = sorted(metric_sums)
        totals = all_reduce_sum(torch.cat([acc, torch.stack([metric_sums[k] for k in names])]) if names else acc)
        totals = totals.tolist()
        known, total_weight = total_weight, totals[1]
        if known is not None and abs(total_weight - known) > 1e-6 * max(abs(known), 1.0):
            raise ValueError(f"train_step: the loss's weights sum to {total_weight} over the ranks, but "
                             f"total_weight={known} was given")
        grads = [p.grad for p in self._trainable if p.grad is not None]
        correction = normaliser / total_weight if total_weight > 0 else 0.0
        if known is not None and total_weight > 0:
            correction = 1.0  # normalised by the exact global weight already
        scale_grads_(grads, correction / loss_scale)  # skipped when exactly 1 (one micro-batch, no fp16)
        grad_norm = global_grad_norm(grads, sharded=self._sharded)
        overflow = not math.isfinite(grad_norm)
        # NOTE: a step with nothing to learn from (weight 0 on every rank: e.g. every response empty)
        # must not step either: AdamW would still move the parameters on its momentum and decay.
        empty = total_weight <= 0
        lr = self.optimizer.param_groups[0]["lr"]
        if overflow or empty:
            self.skipped_steps += 1  # params, optimizer state and schedule untouched (DeepSpeed semantics)
            self.empty_steps += empty
        else:
            clip = self.optim_cfg.grad_clip
            if clip > 0 and grad_norm > clip:
                scale_grads_(grads, clip / (grad_norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
            self.optimizer.step()
            self.scheduler.step()
        self.scaler.update(overflow)
        self._grad_bytes = tensor_bytes(grads)
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        if self._cuda_peak is None and dev.type == "cuda":
            self._cuda_peak = torch.cuda.max_memory_allocated(dev)

        def mean(total: float) -> float:
            return total / total_weight if total_weight > 0 else 0.0

        out: dict[str, Any] = {k: mean(v) for k, v in zip(names, totals[2:])}
        out.update(
            loss=mean(totals[0]),
            grad_norm=grad_norm,
            lr=lr,
            skipped=overflow or empty,
            empty=empty,
            loss_scale=loss_scale,
            weight=total_weight,
        )
        return out

    # ------------------------------------------------------------ checkpoints

    def _rank_state(self) -> dict:
        state = {
            "rng": rng_state(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "global_step": self.global_step,
            "skipped_steps": self.skipped_steps,
            "empty_steps": self.empty_steps,
        }
        if self._zero1:
            state["zero1_optimizer"] = self.optimizer.optim.state_dict()  # this rank's shard
        return state

    def save_checkpoint(self, path: str, extra_state: dict | None = None, rank_extra: Any = None) -> None:
        """Sharded checkpoint of everything a bit-exact resume needs, published atomically. Collective.

        `extra_state`: JSON-able, shared by all ranks (e.g. the data position). `rank_extra`: any
        picklable per-rank object (e.g. this rank's shards of an EMA copy), restored only at the
        same world size (`load_checkpoint(...)` then sets `self.rank_extra`).
        """
        meta = {"step": self.global_step, "extra_state": extra_state or {}}
        with published(path, meta, self.info.is_main) as tmp:
            self.write_state(tmp, rank_extra)

    def write_state(self, directory: str, rank_extra: Any = None) -> None:
        """This engine's part of a checkpoint, into `directory` (inside a `published` block). Collective."""
        os.makedirs(directory, exist_ok=True)
        save_model_optimizer(directory, self.model, self.optimizer, self._zero1)
        save_rank_state(directory, self.info.rank, {**self._rank_state(), "rank_extra": rank_extra})
        if self.info.is_main:
            write_meta(directory, {"step": self.global_step, "world_size": self.info.world_size,
                                   "stage": self.cfg.stage, "precision": self.cfg.precision}, ENGINE_META)

    def load_checkpoint(self, path: str) -> dict:
        """Restore model, optimizer, schedule, loss scale, counters and RNG; returns extra_state. Collective."""
        self.read_state(path)
        return read_meta(path)["extra_state"]

    def read_state(self, directory: str) -> None:
        """Restore what `write_state` wrote into `directory`. Collective."""
        path = directory
        meta = read_meta(path, ENGINE_META)
        same_world = meta["world_size"] == self.info.world_size
        if (meta["stage"] == 1) != self._zero1 or (self._zero1 and not same_world):
            raise CheckpointError(
                f"checkpoint {path} (engine.stage={meta['stage']}, world size {meta['world_size']}) cannot be "
                f"loaded with engine.stage={self.cfg.stage} at world size {self.info.world_size}: ZeRO-1 "
                "optimizer shards are saved per rank; stages 0, 2, 3 reshard freely among themselves"
            )
        which = self.info.rank if same_world else 0  # another world size: rank 0's shared parts, no per-rank RNG
        state = load_rank_state(path, which)
        if state is None:
            raise CheckpointError(f"checkpoint {path} has no {os.path.basename(rank_file(path, which))} (a per-rank file "
                             "is missing: an incomplete copy?): it cannot be resumed")
        same_precision = meta.get("precision", self.cfg.precision) == self.cfg.precision
        self.not_restored = [f"per-rank RNG states (saved by {meta['world_size']} ranks, now {self.info.world_size}: "
                             "dropout and sampling draws differ from an uninterrupted run)"] * (not same_world)
        self.not_restored += [f"the loss scale (engine.precision {meta['precision']} -> {self.cfg.precision}; the fp32 "
                              "weights and optimizer state are restored)"] * (not same_precision)
        if self.not_restored:
            logger.warning("resuming %s: not restored: %s", path, "; ".join(self.not_restored))
        load_model_optimizer(path, self.model, self.optimizer, self._zero1)
        sched = dict(state["scheduler"])
        sched["lr_lambdas"] = [None] * len(sched["lr_lambdas"])  # keep this run's schedule config
        self.scheduler.load_state_dict(sched)
        for pgroup, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            pgroup["lr"] = lr  # ZeroRedundancyOptimizer's outer groups are not in any state dict
        if same_precision:
            self.scaler.load_state_dict(state["scaler"])
        self.global_step = state["global_step"]
        self.skipped_steps = state["skipped_steps"]
        self.empty_steps = state.get("empty_steps", 0)  # checkpoints before it was counted: 0
        if self._zero1:
            self.optimizer.optim.load_state_dict(state["zero1_optimizer"])
        if same_world:
            set_rng_state(state["rng"])
        self.rank_extra = state.get("rank_extra") if same_world else None
        barrier()

    # ------------------------------------------------------------ generation mode

    @contextlib.contextmanager
    def generation(self):
        """Generation mode: yields a generator over the whole (gathered) model. Collective.

        Path (`engine.generation`, chosen once and logged once): the injected model
        (engine/inference: fused weights, static KV cache, CUDA graphs) for supported architectures
        without unmerged LoRA adapters, else `transformers` `generate` on the unsharded module.

        Injected timeline: on entry the weights are streamed one FSDP unit at a time into the
        injected model's fused slots (allocated on first use, refreshed in place afterwards, so
        captured graphs stay valid); the sharded training module is left as it was. On exit, with
        `engine.release_inference_cache=true`, the injected weights, cache and graphs are freed.
        Generic timeline: the parameters are all-gathered once, the module is put in eval mode, and
        on exit the gathered copy is freed (resharded). Either way, on CUDA the allocator cache is
        released on exit so training resumes with its usual memory. Inside, no collective runs.
        With `engine.selfcheck` (auto: on CUDA), the injected path's first use is checked against
        transformers first (`_decoder_agrees`); if it disagrees, this and every later phase take the
        generic path. LoRA adapters reach the injected model merged (engine/lora.py).
        With `engine.check_weights` (every entry, the first, or never), the generation layout is
        compared with the training parameters before anything is generated (engine/weight_check.py):
        a mismatch raises WeightCheckError on every rank.
        vLLM timeline (`engine.generation=vllm`, engine/vllm_backend.py): an in-process vLLM engine built on
        first use and kept; on entry the weights are streamed into it one FSDP unit at a time (LoRA merged)
        through vLLM's in-place reload, then checked; on exit it sleeps (CUDA sleep mode; CPU: none).
        """
        from .generation import BatchInvariantGenerator

        def wrap(gen):  # engine.deterministic: per-row streams, fixed-size forwards (BatchInvariantGenerator)
            return BatchInvariantGenerator(gen, self.cfg.deterministic_rows) if self.cfg.deterministic else gen

        check = self.cfg.check_weights == "every" or (self.cfg.check_weights == "first" and self.weight_checks == 0)
        self._switch_phase("generation")
        try:
            if self._generation_path() == "vllm":
                rollout = self._refresh_vllm(check=check)
                try:
                    yield VLLMGenerator(rollout)
                finally:
                    rollout.sleep()  # its memory back to training where the platform can (CUDA sleep mode)
                return
            with self._generation_local(check, wrap) as gen:
                yield gen
        finally:
            self._switch_phase("training")

    def _switch_phase(self, phase: str) -> None:
        """Between generation and training: on the CPU the heap's free pages go back to the system first
        (engine.cpu_trim_heap), so the phase's resident memory (and its measured peak) starts from what is live."""
        if self.info.device.type == "cpu" and self.cfg.cpu_trim_heap:
            trim_host_heap()
        self.phase_peaks.enter(phase)

    @contextlib.contextmanager
    def _generation_local(self, check: bool, wrap):
        """generation() on the injected model or transformers generate (the paths that run in our own modules)."""
        from .generation import HFGenerator, InjectedGenerator

        if self._generation_path() == "injected":
            model = self._refresh_inference_model(check=check)
            if self._check_decoder_first:
                self._check_decoder_first = False
                if not self._decoder_agrees(model):  # the rest of the run generates through transformers
                    model.release()
                    self._inference, self._gen_path = None, "hf"
                else:
                    model.release_cache()  # the probe's 2-row cache and graphs; the real batch allocates its own
        if self._gen_path == "injected":
            try:
                # (engine.deterministic: no compaction, a row's numerics would depend on when its batch-mates end)
                yield wrap(InjectedGenerator(model, self.cfg.compact_finished and not self.cfg.deterministic))
            finally:
                if self.cfg.release_inference_cache:
                    model.release()
                    self._inference = None
        else:
            # NOTE: engine.compile compiles the blocks for training; decoding through them would
            # recompile for every cache shape, so generate runs them eagerly.
            stance = torch.compiler.set_stance("force_eager") if self.cfg.compile else contextlib.nullcontext()
            sources = self._sharded_sources() if check else None
            with self.gathered_parameters(), stance:
                if check:
                    self._check_gathered(sources)
                was_training = self.unwrapped.training
                self.unwrapped.eval()
                try:
                    yield wrap(HFGenerator(inner_module(self.unwrapped)))
                finally:
                    self.unwrapped.train(was_training)
        if self.info.device.type == "cuda":
            torch.cuda.empty_cache()

    def _refresh_vllm(self, check: bool):
        """The vLLM engine (built on first use) with the current weights: streamed one FSDP unit at a time,
        LoRA merged, into vLLM's own layout in place (engine/vllm_backend.py); `check`: its tensors then
        compared with the training tensors (a mismatch raises on every rank). Collective."""
        dtype = TORCH_DTYPES[self.cfg.precision]
        if self._vllm is None:
            self._vllm = VLLMRollout(hf_base_model(self.unwrapped).config, dtype=dtype, settings=self.cfg.vllm,
                                     seed=0, device=self.info.device)
        expected = ExpectedWeights(dtype) if check else None
        named = self.generation_weights()
        if self._fsdp_units:
            # NOTE: vLLM's reload buffers a layer's tensors until the layer is complete (a padded vocabulary
            # never is: it waits for the reload's end), and a gathered FSDP unit's storage is freed when the
            # next unit is gathered: what vLLM keeps must be its own copy
            named = ((n, t.detach().clone()) for n, t in named)
        self.sync_stats = stats = self._vllm.load(named, expected)
        if check:
            self._finish_check(lambda: (stats.mismatched, stats.compared), "vLLM engine", stats.check_s)
        return self._vllm

    def generation_metrics(self) -> dict[str, float]:
        """Per-step figures of the generation backend: the last vLLM sync's bytes / seconds / GB/s and the
        phases' peak memory (empty for a path with neither)."""
        out = self.phase_peaks.as_metrics()
        if self.sync_stats is not None:
            out.update(self.sync_stats.as_metrics())
        return out

    def generation_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of the generation layout, LoRA merged: what a generation rank's copy of
        the model holds (engine/weight_stream.py sends it). One FSDP unit gathered at a time; a tensor is
        valid only until the next item. Collective over the training ranks."""
        for name, t in merge_lora(self.named_full_parameters(), self._lora or {}):
            yield hf_name(name), t

    @property
    def generation_path(self) -> str:
        """'injected' or 'hf': what `generation()` uses for this module (see `engine.generation`)."""
        return self._generation_path()

    def _generation_path(self) -> str:
        """'injected' or 'hf' for this module; the choice and its reason are logged once."""
        if self._gen_path is None:
            self._gen_path, why = self._choose_generation_path()
            if self.info.is_main:
                logger.info("generation mode: %s path (%s)", self._gen_path, why)
        return self._gen_path

    def _choose_generation_path(self) -> tuple[str, str]:
        from .generation import choose_generation_path

        base = hf_base_model(self.unwrapped)
        # LoRA adapters the injected model can take merged (engine/lora.py) are no reason to fall back
        unmergeable = base is not inner_module(self.unwrapped) and self._lora is None
        return choose_generation_path(self.cfg.generation, self.info.device.type, getattr(base, "config", None),
                                      adapters=unmergeable)


    def _decoder_agrees(self, model) -> bool:
        """engine.selfcheck, on the injected decoder's first use: `decoder_mismatch` on two probe prompts
        against the transformers module with its gathered weights; a mismatch (or an exception) logs one
        warning. Collective: every rank checks, and all fall back if any rank's check failed (the two
        paths gather weights with different collectives)."""
        from .distributed import all_reduce_sum
        from .generation import InjectedGenerator, decoder_mismatch, probe_prompts

        ids, mask = probe_prompts(hf_base_model(self.unwrapped).config.vocab_size, self.info.device)
        cuda = [self.info.device] if self.info.device.type == "cuda" else []
        with self.gathered_parameters(), torch.random.fork_rng(devices=cuda):  # the run's RNG streams untouched
            why = decoder_mismatch(InjectedGenerator(model), inner_module(self.unwrapped), ids, mask,
                                   dtype=TORCH_DTYPES[self.cfg.precision])
        failed = all_reduce_sum(torch.tensor([float(why is not None)], device=self.info.device)).item() > 0
        if failed:
            logger.warning("generation: the injected decoder disagrees with transformers on first use (%s); using "
                           "transformers generate for the rest of the run",
                           why or "on another rank; this rank's check passed")
        return not failed

    def _refresh_inference_model(self, check: bool = False):
        """The injected model with the current weights (LoRA merged), streamed one FSDP unit at a time.
        `check`: the weight check rides on the same stream (expected fingerprints taken from each
        gathered tensor as it passes), then compares the slots. Collective."""
        from .inference import InferenceModel

        dtype, layers = TORCH_DTYPES[self.cfg.precision], self._lora or {}
        raw = self.named_full_parameters()
        expected: dict[str, torch.Tensor] = {}
        spent = [0.0]
        if check:
            raw = expected_tap(raw, dtype, layers, expected, spent)
        named = merge_lora(raw, layers, lazy=True)  # merged straight into the slots (engine/lora.py)
        if self._inference is None:
            self._inference = InferenceModel(hf_base_model(self.unwrapped).config, named, dtype=dtype,
                                             device=self.info.device)
        else:
            self._inference.load_weights(named)
        if check:
            for _ in raw:  # NOTE: what the refresh left unread is still expected (and its units resharded)
                pass
            slots, required = self._inference.named_slots()
            self._finish_check(lambda: mismatches(slots, self._listed(expected), required), "injected model",
                               spent[0])
        return self._inference

    @staticmethod
    def _listed(fps: dict[str, torch.Tensor]) -> dict[str, list[float]]:
        if not fps:
            return {}
        return dict(zip(fps, torch.stack([f.cpu() for f in fps.values()]).tolist()))

    def _finish_check(self, compare, where: str, spent: float) -> None:
        """Runs `compare` (-> (mismatch lines, tensors compared)) and raises on every rank if any rank
        found a mismatch; counts and times the check, logging it once at INFO. Collective: a rank
        whose comparison fails with an exception still joins the all-reduce (no rank hangs)."""
        start = time.perf_counter()
        try:
            bad, compared = compare()
        except Exception as e:  # noqa: BLE001 - reported on every rank as a failed check
            if self.info.world_size == 1:
                raise
            bad, compared = [f"the check itself failed: {type(e).__name__}: {e}"], 0
        raise_on_any_rank(bad, rank=self.info.rank, device=self.info.device, where=where)
        self.weight_check_s = spent + time.perf_counter() - start
        self.weight_checks += 1
        if self.info.is_main:
            log = logger.info if self.weight_checks == 1 else logger.debug
            if compared:
                log("engine.check_weights=%s: %d tensors of the generation layout (%s) equal the training parameters (%.3f s)",
                    self.cfg.check_weights, compared, where, self.weight_check_s)
            else:
                log("engine.check_weights=%s: the generation layout (%s) is the training module itself (stage %d): nothing to compare",
                    self.cfg.check_weights, where, self.cfg.stage)

    def _sharded_sources(self) -> list[tuple[str, torch.Tensor]]:
        """(clean name, parameter) as training holds them at rest: FSDP2 shards (every unit resharded
        first: a stage-2 unit may still hold its last forward's gathered copy) or DDP's replicas."""
        for unit, _ in self._fsdp_units:
            unit.reshard()
        return [(clean_name(n), p) for n, p in self.unwrapped.named_parameters()]

    def _check_gathered(self, sources: list[tuple[str, torch.Tensor]]) -> None:
        """The transformers path's check, inside `gathered_parameters`: each gathered tensor against
        its shards (sharded fingerprints, one all-reduce). A tensor that *is* its training parameter
        (stage 0/1: generate runs on the training module itself) has nothing to compare. Collective."""
        start = time.perf_counter()
        layout = {clean_name(n): p for n, p in self.unwrapped.named_parameters()}
        differ = [(n, p) for n, p in sources if n in layout and layout[n] is not p]
        names = [n for n, _ in differ]
        try:
            want = sharded_fingerprints(differ, {n: layout[n].dtype for n in names}, rank=self.info.rank,
                                        device=self.info.device)
            expected = dict(zip(names, want.cpu().tolist()))
        except Exception as e:  # noqa: BLE001 - every rank must still reach the all-reduce below
            if self.info.world_size == 1:
                raise
            error = e
            expected = {}
        else:
            error = None

        def compare():
            if error is not None:
                raise error
            return mismatches({n: layout[n] for n in names}, expected, names)

        self._finish_check(compare, "the gathered module transformers generate runs on", time.perf_counter() - start)

    # ------------------------------------------------------------ memory

    def memory_report(self) -> dict:
        """Bytes this rank holds (params, grads of the last step, optimizer state) vs the ZeRO formula."""
        report = self._base_memory_report(self.optimizer, self._grad_bytes)
        if self._cuda_peak is not None:
            report["cuda_max_allocated_bytes"] = self._cuda_peak
        return report


class FrozenEngine(_ShardedModule):
    """A model used only for forward under no_grad (reference, reward): same sharding, no optimizer.

    `engine_cfg.offload`: stage 2/3 keep the shards on the CPU (CPUOffloadPolicy); stage 0/1 keep
    the whole model on the CPU and move it to the device around each forward.
    """

    def __init__(self, model: nn.Module, engine_cfg: EngineConfig, info: DistInfo | None = None):
        info = info or init_distributed()
        validate_engine_config(engine_cfg, info, frozen=True)
        self.cfg, self.info = engine_cfg, info
        _set_kernel_selfcheck(engine_cfg)
        _materialize_meta(model, info)
        _maybe_inject_kernels(model, engine_cfg, info)
        model.requires_grad_(False)
        model.eval()
        par = parallelize(model, engine_cfg, info, frozen=True)
        self.model, self.unwrapped, self._fsdp_units = par.model, par.unwrapped, par.fsdp_units

    def memory_report(self) -> dict:
        return self._base_memory_report(None, 0)
