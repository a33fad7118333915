"""Process-group setup and the few collectives the engine needs.

`init_distributed()` always leaves a process group behind, even for a single process started with
plain `python`: a gloo group of one over an in-memory HashStore. FSDP2, DCP and the all-reduces in the
train step then run the same code at world size 1 as under `torchrun`.
"""
from __future__ import annotations

import ctypes
import datetime
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import LaunchError


@dataclass(frozen=True, slots=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    is_main: bool


_INFO: DistInfo | None = None
# The group the engine's collectives run over: None = the default (whole world); under a split
# placement (`split_world`) the trainers' own group, so that ZeRO, DDP, the step's all-reduces and DCP
# run over the training ranks only while the generation ranks do something else.
_GROUP: Any = None
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher() -> bool:
    """Under torchrun on Linux: this worker gets SIGTERM when its launcher dies, however it dies.

    NOTE: torchrun forwards SIGINT/SIGTERM to its workers, but `kill -9` on the launcher cannot be
    forwarded: without this the workers train on, orphaned, until a collective times out (issue #29).
    The parent-death signal is set once, then the parent is checked again (it may have died before).
    Returns whether it was set."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the launcher died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def init_distributed(timeout_s: float | None = None) -> DistInfo:
    """Join (or create) the default process group and pick this rank's device. Idempotent.
    `timeout_s`: how long a collective may wait for the other ranks (None: torch's default).

    Under torchrun (RANK/WORLD_SIZE set): NCCL on CUDA, gloo on CPU. Without torchrun: a group of one.
    On CUDA the backend is "cpu:gloo,cuda:nccl" so that collectives on CPU tensors (CPU-offloaded
    gradient norms, object broadcasts) work next to NCCL ones.
    """
    global _INFO
    if _INFO is not None and dist.is_initialized():
        return _INFO
    cuda = torch.cuda.is_available()
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda and local_rank >= (n := torch.cuda.device_count()):  # else CUDA's "invalid device ordinal" from set_device
        here = os.environ.get("LOCAL_WORLD_SIZE", "more")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise LaunchError(f"local rank {local_rank} has no GPU: {here} processes were started on this node but it "
                          f"has {n} CUDA device{'s' if n != 1 else ''}"
                          f"{f' (CUDA_VISIBLE_DEVICES={visible})' if visible is not None else ''}; start at most {n} "
                          f"(torchrun --nproc_per_node {n}), or run on the CPU with gloo (CUDA_VISIBLE_DEVICES= empty)")
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            die_with_launcher()
            timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
            dist.init_process_group(backend, **timeout)  # env:// rendezvous set up by torchrun
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    _INFO = DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device, is_main=rank == 0)
    return _INFO


def shutdown_distributed() -> None:
    """Destroy the default process group (end of a script); `init_distributed()` may be called again."""
    global _INFO, _GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _INFO, _GROUP = None, None


@dataclass(frozen=True, slots=True)
class Placement:
    """Where this rank sits in a split job (`split_world`): the first ranks train, the last generate.

    `stream_group`: the first trainer and every generator (the weight broadcast, engine/weight_stream.py);
    `train_group`: the trainers (None on a generator). `world_rank` is the rank in the whole job; the
    engine's `DistInfo` on a trainer is its view inside the trainers' group."""

    role: str  # "train" | "generate"
    world_rank: int
    trainer_ranks: tuple[int, ...]
    generator_ranks: tuple[int, ...]
    train_group: Any
    stream_group: Any

    def kind(self, rank: int) -> str:
        return "trainer" if rank in self.trainer_ranks else "generator"


def split_world(generation_ranks: int) -> Placement:
    """Splits the job (after `init_distributed`) into trainers (ranks 0..W-N-1) and `generation_ranks`
    generators (the last N). Collective over the whole job: every rank creates the same groups in the
    same order. On a trainer, from then on `init_distributed()`'s info and the collectives of this module
    (and of the engine: FSDP2's mesh, DDP, DCP) are those of the trainers' group; a generator's info is a
    group of one (it runs no engine collective)."""
    global _INFO, _GROUP
    info = init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    if not 1 <= generation_ranks < world:
        raise ValueError(f"engine.generation_ranks={generation_ranks} must leave at least one training rank and "
                         f"take at least one of the job's {world} ranks (torchrun --nproc_per_node x --nnodes)")
    trainers, generators = tuple(range(world - generation_ranks)), tuple(range(world - generation_ranks, world))
    train_group = dist.new_group(list(trainers))  # NOTE: new_group is collective: every rank, same order
    stream_group = dist.new_group([trainers[0], *generators])
    role = "train" if rank in trainers else "generate"
    if role == "train":
        _GROUP = train_group
        r = dist.get_rank(train_group)
        _INFO = DistInfo(rank=r, world_size=len(trainers), local_rank=info.local_rank, device=info.device, is_main=r == 0)
    else:
        _INFO = DistInfo(rank=0, world_size=1, local_rank=info.local_rank, device=info.device, is_main=False)
    return Placement(role=role, world_rank=rank, trainer_ranks=trainers, generator_ranks=generators,
                     train_group=train_group if role == "train" else None, stream_group=stream_group)


def group() -> Any:
    """The process group of the engine's collectives (None: the default group)."""
    return _GROUP


def _size() -> int:
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(_GROUP)


def exit_process(code: int = 0) -> None:
    """End a process that used a process group: atexit handlers (wandb, logging), the group destroyed,
    streams flushed, then `os._exit(code)` without interpreter finalization.

    NOTE: a plain exit can abort with SIGABRT ("terminate called without an active exception") after
    the work is done: a gloo worker thread that drops the last reference to a collective's tensors
    while the interpreter finalizes takes the GIL and is killed mid-unwind (pytorch#190489; measured
    here: 1 in ~3 two-rank runs that resume a DCP checkpoint). `destroy_process_group` does not join
    those threads; skipping finalization avoids the window entirely.
    A failed run (`code` != 0) does not destroy the group: gloo's destructor waits for the work still
    queued, which a dead or hung peer never completes (a split placement's weight stream in flight).
    """
    import atexit
    import logging
    import sys

    try:
        atexit._run_exitfuncs()
        if code == 0:
            shutdown_distributed()
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def barrier() -> None:
    if _size() > 1:
        dist.barrier(group=_GROUP)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In-place SUM across ranks (no-op at world size 1); returns `t`."""
    if _size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=_GROUP)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """In-place MAX across ranks (no-op at world size 1); returns `t`."""
    if _size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_GROUP)
    return t


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (pickled; for small things)."""
    if _size() == 1:
        return [obj]
    out: list[Any] = [None] * _size()
    dist.all_gather_object(out, obj, group=_GROUP)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank (pickled; for small things such as a temp directory name)."""
    if _size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src if _GROUP is None else dist.get_global_rank(_GROUP, src), group=_GROUP)
    return box[0]
