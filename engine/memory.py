"""Per-rank memory accounting: bytes actually held, next to the ZeRO paper's predictions.

Measured numbers come from the tensors themselves (the local shard of a DTensor), so they show what
this rank really holds at rest. The formulas are those of the ZeRO paper for Adam in mixed
precision (2 bytes fp16/bf16 param + 2 grad + 12 optimizer: fp32 master, momentum, variance), with
Psi the trainable parameter count and N the world size:
    stage 0: 16 Psi   stage 1: 4 Psi + 12 Psi / N   stage 2: 2 Psi + 14 Psi / N   stage 3: 16 Psi / N
Our layout keeps fp32 master params as *the* params (the bf16 copy is transient), which is also 16
bytes per param in total, so the stage 3 prediction applies to us unchanged; stages 1 and 2 differ
from the paper, and frozen params (LoRA's base model: Phi of them, fp32 storage) are not in it. So
the report also predicts our own layout (after a backward, gradients included):
    stage 0: 16 Psi + 4 Phi   stage 1: 8 Psi + 8 Psi / N + 4 Phi   (DDP keeps fp32 params + grads whole)
    stage 2, 3: (16 Psi + 4 Phi) / N                              (FSDP2 reshards after backward)
`planned_bytes` computes the same three numbers exactly, per rank, from parameter shapes alone (a model
on the meta device is enough; rlhf/plan.py): FSDP2 gives rank r rows [r*c, (r+1)*c) of each
parameter's dim 0, c = ceil(rows / N) (torch.chunk), ZeroRedundancyOptimizer assigns whole parameters
greedily (largest first, to the rank holding the fewest elements so far), and AdamW keeps exp_avg and
exp_avg_sq like the parameter plus a 4-byte `step` per parameter.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os
import platform
import re
from collections.abc import Iterable

import torch
from torch import nn

from .loss_scale import local_tensor

ZERO_FORMULAS = {0: "16Ψ", 1: "4Ψ+12Ψ/N", 2: "2Ψ+14Ψ/N", 3: "16Ψ/N"}


def zero_formula_bytes(stage: int, trainable: int, world: int) -> float:
    """Model-state bytes per rank predicted by ZeRO for Adam in mixed precision."""
    psi, n = trainable, world
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def layout_bytes(stage: int, trainable: int, frozen: int, world: int) -> float:
    """Model-state bytes per rank for this engine's layout (fp32 params + grads, Adam moments)."""
    psi, phi, n = trainable, frozen, world
    return {0: 16 * psi + 4 * phi, 1: 8 * psi + 8 * psi / n + 4 * phi}.get(stage, (16 * psi + 4 * phi) / n)


def shard_numel(shape: tuple[int, ...], world: int, rank: int) -> int:
    """Elements of a parameter of `shape` that FSDP2 places on `rank` (dim 0 in torch.chunk pieces)."""
    if not shape:
        return 1 if rank == 0 else 0
    rows, rest = shape[0], math.prod(shape[1:])
    chunk = -(-rows // world)
    return max(0, min(chunk, rows - rank * chunk)) * rest


def zero1_owned(groups: list[list[int]], world: int, rank: int) -> list[int]:
    """Sizes (numel) of the parameters whose optimizer state `rank` holds under ZeroRedundancyOptimizer:
    per param group, largest first (a stable sort), each to the rank with the fewest elements so far."""
    sizes, mine = [0] * world, []
    for group in groups:
        for numel in sorted(group, reverse=True):
            owner = sizes.index(min(sizes))
            sizes[owner] += numel
            if owner == rank:
                mine.append(numel)
    return mine


def planned_bytes(shapes: list[tuple[tuple[int, ...], bool]], groups: list[list[int]], *, stage: int, world: int,
                  rank: int, frozen_bytes_per_param: int | None = None) -> dict[str, int]:
    """param/grad/optimizer bytes that `memory_report` measures on `rank` after a step, from shapes.

    `shapes`: (shape, trainable) per parameter (tied ones once); `groups`: the numels of each AdamW
    param group (engine.optim.param_groups). A TrainEngine stores every parameter in fp32. A
    FrozenEngine (`frozen_bytes_per_param`: its storage dtype's size) has no gradients or optimizer.
    """
    sharded = stage >= 2
    local = [(shard_numel(s, world, rank) if sharded else math.prod(s), t) for s, t in shapes]
    if frozen_bytes_per_param is not None:
        return {"param_bytes": frozen_bytes_per_param * sum(n for n, _ in local), "grad_bytes": 0, "optimizer_bytes": 0}
    trainable = [n for n, t in local if t]
    # AdamW: exp_avg + exp_avg_sq in fp32, and `step`, a 0-dim fp32 tensor, per parameter it owns
    owned = zero1_owned(groups, world, rank) if stage == 1 else trainable
    return {"param_bytes": 4 * sum(n for n, _ in local), "grad_bytes": 4 * sum(trainable),
            "optimizer_bytes": sum(8 * n + 4 for n in owned)}


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the locally held storage of `tensors` (each DTensor counted by its local shard)."""
    total, seen = 0, set()
    for t in tensors:
        if t is None or id(t) in seen:  # dedupe on the (alive) originals: tied params count once
            continue
        seen.add(id(t))
        local = local_tensor(t)
        total += local.numel() * local.element_size()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's local optimizer
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def memory_report(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    stage: int,
    world_size: int,
    rank: int,
    grad_bytes: int | None = None,
) -> dict:
    """Bytes this rank holds for params, grads and optimizer state, and the ZeRO prediction.

    `grad_bytes`: gradients measured by the engine just before its last zero_grad (gradients do not
    exist at rest); None measures the ones alive now.
    """
    params = list(module.parameters())
    trainable = [p for p in params if p.requires_grad]
    if grad_bytes is None:
        grad_bytes = tensor_bytes(p.grad for p in params)
    report = {
        "rank": rank,
        "world_size": world_size,
        "stage": stage,
        "total_params": sum(p.numel() for p in params),  # a DTensor reports its global numel
        "trainable_params": sum(p.numel() for p in trainable),
        "param_bytes": tensor_bytes(params),
        "trainable_param_bytes": tensor_bytes(trainable),
        "grad_bytes": grad_bytes,
        "optimizer_bytes": tensor_bytes(optimizer_state_tensors(optimizer)),
    }
    report["model_state_bytes"] = report["param_bytes"] + report["grad_bytes"] + report["optimizer_bytes"]
    report["zero_formula"] = ZERO_FORMULAS[stage]
    report["zero_formula_bytes"] = zero_formula_bytes(stage, report["trainable_params"], world_size)
    frozen = report["total_params"] - report["trainable_params"]
    report["layout_bytes"] = layout_bytes(stage, report["trainable_params"], frozen, world_size)
    return report


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_memory_report(report: dict) -> str:
    """A few lines for the start-of-run log."""
    lines = [
        f"[rank {report['rank']}/{report['world_size']}] ZeRO stage {report['stage']}: "
        f"{report['trainable_params']:,} trainable / {report['total_params']:,} params",
        f"  params {fmt_bytes(report['param_bytes'])} | grads {fmt_bytes(report['grad_bytes'])} | "
        f"optimizer {fmt_bytes(report['optimizer_bytes'])} | model state {fmt_bytes(report['model_state_bytes'])}",
        f"  predicted for this layout {fmt_bytes(report['layout_bytes'])} | ZeRO paper (Adam, mixed precision, "
        f"trainable only) {report['zero_formula']} = {fmt_bytes(report['zero_formula_bytes'])}",
    ]
    if "models" in report:  # a run of several models (e.g. PPO's): what each holds on this rank
        lines.append(f"  {len(report['models'])} models on this rank: " + " | ".join(
            f"{name} {fmt_bytes(n)}" for name, n in report["models"].items()))
    if "cuda_max_allocated_bytes" in report:
        lines.append(f"  CUDA max allocated after the first step: {fmt_bytes(report['cuda_max_allocated_bytes'])}")
    return "\n".join(lines)


def process_memory(field: str = "VmRSS") -> int | None:
    """A /proc/self/status memory field of this process in bytes (VmRSS: resident now, VmHWM: its peak); None
    where it cannot be read (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# the environment variables that size oneDNN's primitive cache and ideep's LRU cache of bf16 kernels on the CPU (each
# library reads its own once, at its first kernel)
KERNEL_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def set_cpu_kernel_cache(entries: int | None) -> dict[str, str]:
    """Bound the CPU kernel caches at `entries` each (None: leave the libraries' defaults) through their environment
    variables, where the environment does not set them already (the user's values win). Returns {variable: value}
    of those set in the environment now. Takes effect only before the process's first bf16 kernel: each library
    reads its variable once (a stage's engine starts before any forward)."""
    if entries is None:
        return {}
    for var in KERNEL_CACHE_ENV:
        os.environ.setdefault(var, str(entries))
    return {var: os.environ[var] for var in KERNEL_CACHE_ENV}


# PyTorch's cuBLAS workspace per (handle, stream) (aten's CublasHandlePool): 32 MiB on compute capability 9-12 (Hopper,
# Blackwell), :4096:2:16:8 (8.125 MiB) before
CUBLAS_WORKSPACE_SM90 = 4096 * 8 * 1024
CUBLAS_WORKSPACE_OLDER = (4096 * 2 + 16 * 8) * 1024


def cublas_workspace_bytes(capability: tuple[int, int] | None = None, config: str | None = None) -> int:
    """The workspace PyTorch gives cuBLAS at a (handle, stream)'s first matmul and keeps for the process's life:
    CUBLAS_WORKSPACE_CONFIG's `:KiB:count` pairs summed where it is set (`config`, default the environment's), else
    32 MiB on compute capability 9-12 and 8.125 MiB before. `capability` None (no GPU to ask): 32 MiB, the larger.
    Each thread that runs matmuls has its own handle (the autograd engine's backward thread too), and each stream
    its own workspace."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "") if config is None else config
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if pairs:
        return sum(int(kib) * int(n) for kib, n in pairs) * 1024
    return CUBLAS_WORKSPACE_SM90 if capability is None or 9 <= capability[0] <= 12 else CUBLAS_WORKSPACE_OLDER


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (malloc_trim, mallopt); None elsewhere (musl, macOS, Windows)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        lib.malloc_trim.argtypes, lib.mallopt.argtypes = [ctypes.c_size_t], [ctypes.c_int, ctypes.c_int]
        return lib
    except (OSError, AttributeError):
        return None


def set_mmap_threshold(mib: float | None) -> bool:
    """Serve host allocations of `mib` MiB or more with their own mmap, unmapped when freed (glibc's
    M_MMAP_THRESHOLD): large CPU tensors then go back to the system as soon as they die instead of staying in
    the heap, where freed blocks of one size are rarely reused by the next phase's other sizes and the
    process's resident memory stays at its high-water mark. Setting it also stops glibc raising the
    threshold by itself (it does, up to 32 MiB, each time a mapped block is freed). None: glibc's default.
    Returns whether it was applied (glibc only)."""
    if mib is None or (lib := _glibc()) is None:
        return False
    return bool(lib.mallopt(M_MMAP_THRESHOLD, int(mib * 2**20)))


def trim_host_heap() -> bool:
    """Give the heap's free pages back to the system (glibc malloc_trim(0), every arena): a phase's freed
    blocks stop counting in the resident memory of the next. False where the C library is not glibc."""
    if (lib := _glibc()) is None:
        return False
    lib.malloc_trim(0)
    return True


class PhasePeaks:
    """Peak memory of the phases a process alternates between (generation, then training), each phase's
    own: on CUDA the allocator's peak (reset at each phase's start), on CPU the process's peak resident
    set (VmHWM, reset at each phase's start through /proc/self/clear_refs; Linux). `peaks`: {phase: bytes}
    of the last time each phase ran; None where neither is measurable."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peaks: dict[str, int] = {}
        self._phase: str | None = None

    def _reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def _peak(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return process_memory("VmHWM")

    def enter(self, phase: str) -> None:
        """End the current phase (its peak recorded) and start `phase`."""
        if self._phase is not None and (peak := self._peak()) is not None:
            self.peaks[self._phase] = peak
        self._phase = phase
        self._reset()

    def as_metrics(self) -> dict[str, float]:
        """{mem_<phase>_peak_gib}: each phase's peak the last time it ran, the phase in progress its peak so far
        (the RL stage asks after the update: the step's own generation and training phases)."""
        peaks = dict(self.peaks)
        if self._phase is not None and (now := self._peak()) is not None:
            peaks[self._phase] = now
        return {f"mem_{phase}_peak_gib": b / (1 << 30) for phase, b in peaks.items()}
