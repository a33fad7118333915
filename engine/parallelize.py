"""Apply activation checkpointing and data parallelism to a model from outside it.

`parallelize(model, cfg, info)` is the one place that knows how a ZeRO stage maps onto PyTorch:
    stage 0  DDP                                   full params, grads, optimizer state on every rank
    stage 1  DDP (+ ZeroRedundancyOptimizer, built in optim.py)       optimizer state sharded
    stage 2  FSDP2 fully_shard(reshard_after_forward=False)           + grads and params at rest sharded
    stage 3  FSDP2 fully_shard(reshard_after_forward=True)            + params resharded after forward
Blocks (the unit of sharding and recompute) are the modules named in the HF model's
`_no_split_modules` (looked up through peft wrappers), else the children of the largest ModuleList.
"""
from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from .config import PRECISIONS, EngineConfig
from .distributed import DistInfo, group

# Prefixes that wrappers insert into parameter names; removed from every name the engine exports.
# The one map from dtype names to torch dtypes (engine.precision is one of its keys).
TORCH_DTYPES = dict(zip(PRECISIONS, (torch.float32, torch.bfloat16, torch.float16)))
VIEW_PREFIX = "_view_module."  # what a ModuleView (below) adds in front of its inner module's names
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.", VIEW_PREFIX)


@dataclass
class Parallelized:
    """What `parallelize` built: the module to call, the plain module under it, and the FSDP units."""

    model: nn.Module  # DDP(module) for stage 0/1 (the module itself on one rank), the module (an FSDPModule) for 2/3
    unwrapped: nn.Module
    # FSDP units in model.modules() order (root first) with the reshard_after_forward each was given.
    fsdp_units: list[tuple[nn.Module, bool]] = field(default_factory=list)


def clean_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


class ModuleView(nn.Module):
    """A module whose forward is a computation on another module (`inner`: a transformers model,
    peft-wrapped or not), e.g. "log-probs of these tokens" or "a value per position".

    The engine shards and wraps the view like any module, so its forward runs inside the FSDP2 /
    DDP hooks; every name the engine hands out (state dicts, exports, generation weights) is
    `inner`'s own (`_view_module.` is stripped like a wrapper prefix), and `hf_base_model` /
    `inner_module` see through it (blocks to shard, generation, `config`).
    """

    def __init__(self, inner: nn.Module):
        super().__init__()
        self._view_module = inner

    @property
    def inner(self) -> nn.Module:
        return self._view_module


def inner_module(model: nn.Module) -> nn.Module:
    """The module a `ModuleView` computes on (a peft wrapper, if any, kept), or `model` itself."""
    return model.inner if isinstance(model, ModuleView) else model


def hf_base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a view and a peft wrapper (or `model` itself)."""
    model = inner_module(model)
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, innermost first (fully_shard must see children before parents)."""
    names = set(getattr(hf_base_model(model), "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        if lists:
            blocks = list(max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters())).children())
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(blocks, key=lambda m: -order[id(m)])


def apply_activation_checkpointing(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Recompute each block in backward. Returns the blocks as they now appear in the module tree.

    HF models: their own non-reentrant checkpointing (names unchanged). Otherwise torch's
    checkpoint_wrapper, which inserts `_checkpoint_wrapped_module.` into names (stripped on export).
    """
    base = hf_base_model(model)
    enable = getattr(base, "activation_checkpointing_enable", None)
    if callable(enable) and getattr(base, "supports_gradient_checkpointing", False):
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return blocks
    if callable(getattr(base, "gradient_checkpointing_enable", None)) and getattr(
        base, "supports_gradient_checkpointing", False
    ):  # transformers < 5.2x
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return blocks
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing as torch_apply_ac,
        checkpoint_wrapper,
    )

    ids = {id(b) for b in blocks}
    torch_apply_ac(
        model,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: id(m) in ids,
    )
    wrapped = [m for m in model.modules() if id(getattr(m, "_checkpoint_wrapped_module", None)) in ids]
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(wrapped, key=lambda m: -order[id(m)])


def compile_blocks(blocks: list[nn.Module]) -> None:
    """torch.compile each block in place (`nn.Module.compile`): the module tree and the parameter
    names do not change (no `_orig_mod.`), so sharding, checkpoints and exports are as without it.
    One compiled region per block type is reused by every block; sequence lengths that vary between
    batches become dynamic after the first recompilation (torch.compile's default)."""
    for block in blocks:
        block.compile()


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (torch._dynamo's forward + backward graph
    compilation), 0.0 when nothing was compiled."""
    try:
        from torch._dynamo.utils import calculate_time_spent
    except ImportError:  # pragma: no cover - a torch without dynamo
        return 0.0
    return float(calculate_time_spent().get("total_wall_time", 0.0))


def autocast_forward(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Run `module.forward` under torch.autocast (stage 0/1 mixed precision; params stay fp32).

    Patched on the instance so calls through DDP, `generate` and the module itself all get it, and
    the state-dict names do not change (a wrapper module would add a prefix).
    """
    forward = module.forward
    module.forward = types.MethodType(
        lambda self, *args, **kwargs: _autocast_call(forward, device, dtype, args, kwargs), module
    )


def _autocast_call(forward, device, dtype, args, kwargs):
    with torch.autocast(device_type=device.type, dtype=dtype):
        return forward(*args, **kwargs)


def offload_between_forwards(module: nn.Module, device: torch.device) -> None:
    """Keep `module` on the CPU, moving it to `device` for each forward (frozen models at stage 0/1)."""
    module.to("cpu")
    if device.type == "cpu":
        return
    module.register_forward_pre_hook(lambda m, args: m.to(device))
    module.register_forward_hook(lambda m, args, out: m.to("cpu"))


def parallelize(model: nn.Module, cfg: EngineConfig, info: DistInfo, *, frozen: bool = False) -> Parallelized:
    """Shard (or replicate) `model` over the ranks according to `cfg.stage` and move it to the device.

    `frozen`: a model without gradients (reference/reward): no DDP wrapper (nothing to all-reduce),
    no activation checkpointing, and FSDP units reshard after every forward (there is no backward to
    keep the gathered params for).
    """
    dtype = TORCH_DTYPES[cfg.precision]
    blocks = find_blocks(model)

    if cfg.stage <= 1:
        if frozen and cfg.offload:
            offload_between_forwards(model, info.device)
        else:
            model.to(info.device)
        if cfg.activation_checkpointing and not frozen:
            blocks = apply_activation_checkpointing(model, blocks)
        if cfg.compile:
            compile_blocks(blocks)
        if dtype != torch.float32:
            autocast_forward(model, info.device, dtype)
        # NOTE: one rank: no DDP wrapper either. Its all-reduce is then the identity (same gradients bit for
        # bit), but its forward, bucket copies and the call itself were ~5% of the default RL step's
        # update on CPU (scripts/bench_rl.py --profile: 12 allreduce_ calls and ~330 copy_ per train_step)
        if frozen or info.world_size == 1:
            return Parallelized(model=model, unwrapped=model)
        from torch.nn.parallel import DistributedDataParallel as DDP

        # NOTE: transformer buffers (rotary inv_freq) are deterministic; no per-forward broadcast.
        # (torch >= 2.12 renamed broadcast_buffers to forward_sync_buffers.)
        no_buffer_sync = (
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
            else {"broadcast_buffers": False}
        )
        ddp = DDP(
            model,
            device_ids=[info.device.index] if info.device.type == "cuda" else None,
            find_unused_parameters=cfg.find_unused_parameters,
            process_group=group(),
            **no_buffer_sync,
        )
        return Parallelized(model=ddp, unwrapped=model)

    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

    # under a split placement the trainers' group (engine.distributed.split_world), else the whole job
    mesh = init_device_mesh(info.device.type, (info.world_size,)) if group() is None else \
        DeviceMesh.from_group(group(), info.device.type)
    kwargs: dict = {"mesh": mesh}
    if dtype != torch.float32:
        # Params are stored (sharded) in fp32, all-gathered and computed in `dtype`; gradients are
        # reduce-scattered in fp32 so the sum over ranks does not lose bits.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if cfg.offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=info.device.type == "cuda")
    reshard_blocks = True if frozen else cfg.stage == 3
    # NOTE: the root's params (embeddings, final norm, head): the head is the first needed in backward,
    # so training keeps the root gathered from forward to backward (as torchtitan); frozen ones reshard.
    reshard_root = frozen

    # 1. Activation checkpointing before sharding: checkpoint_wrapper must be the module that
    #    fully_shard wraps, so the recompute runs within the unit's backward and reuses the params it
    #    gathered for backward (HF's own checkpointing re-enters the unit's hooks in the recompute,
    #    which FSDP2 sees as already unsharded: same single all-gather; equal losses are tested).
    if cfg.activation_checkpointing and not frozen:
        blocks = apply_activation_checkpointing(model, blocks)
    # 2. torch.compile per block before fully_shard (the unit's hooks stay outside the compiled code).
    if cfg.compile:
        compile_blocks(blocks)
    # 3. One FSDP unit per block (innermost first): one all-gather per block, overlapped with the
    #    previous block's compute, and only one block's full params alive at a time (stage 3).
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_blocks, **kwargs)
    # 4. The root last: it takes the remaining params and drives lazy init and the streams.
    fully_shard(model, reshard_after_forward=reshard_root, **kwargs)
    # NOTE: FSDP2 makes the first unit to run forward the root (lazily). A ModuleView's inner model
    # can run before the view does (generation mode calls `generate` on it), which would make a block
    # a root of its own; so the root's lazy init runs now, as its first forward would run it.
    model._get_fsdp_state()._lazy_init()
    # (fully_shard moved the params and buffers to the mesh's device; CPUOffloadPolicy then keeps the
    # sharded params on the CPU and copies each unit's shard to the device for its all-gather.)
    units = [(m, reshard_root if m is model else reshard_blocks) for m in model.modules() if isinstance(m, FSDPModule)]
    return Parallelized(model=model, unwrapped=model, fsdp_units=units)
