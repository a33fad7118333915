"""Sharded checkpoints for exact resume, written atomically.

Layout of one checkpoint directory:
    .metadata, __*_*.distcp   torch.distributed.checkpoint (DCP): model + optimizer, each rank its shards
    rank{r}.pt                 this rank's RNG states, scheduler, loss scaler, counters (and, for
                               ZeRO-1, its local optimizer shard, which DCP cannot describe)
    engine.json                the engine's layout: world size, ZeRO stage, precision, its step
    meta.json                  written last by rank 0: step and extra_state. A directory without it
                               is incomplete and ignored.
Everything is first written to `<path>.tmp-<random>`; after a barrier rank 0 adds meta.json and
renames the directory to `<path>` (`published`). A kill at any moment leaves either the previous
complete checkpoint or a `*.tmp-*` leftover, which the listing functions ignore. Several engines
(e.g. an actor and a critic) share one checkpoint: each writes its files into its own
subdirectory inside one `published` block, so they are published together or not at all.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import time
import uuid
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .distributed import group
from .errors import CheckpointError
from .parallelize import VIEW_PREFIX

META = "meta.json"
ENGINE_META = "engine.json"
TMP_MARK = ".tmp-"
KILL_ENV = "ENGINE_KILL_AT"
_passed: dict[str, int] = {}


def kill_point(name: str) -> None:
    """A moment where a kill must lose nothing (inside a checkpoint write, mid-prune, ...). With
    `ENGINE_KILL_AT=<name>[:n]` in the environment the process SIGKILLs itself the n-th time (default
    the first) it passes `name`: how the tests prove it with a real kill; `<name>:<n>:hang` makes it
    hang there instead (sleeps until killed: a rank that stops answering). Otherwise a no-op."""
    want = os.environ.get(KILL_ENV)
    if not want:
        return
    target, _, rest = want.partition(":")
    nth, _, how = rest.partition(":")
    if target == name:
        _passed[name] = _passed.get(name, 0) + 1
        if _passed[name] == int(nth or 1):
            if how == "hang":
                while True:
                    time.sleep(3600)
            os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------- directories


def new_tmp_path(path: str) -> str:
    return f"{os.path.abspath(path)}{TMP_MARK}{uuid.uuid4().hex[:8]}"


def fsync_tree(root: str) -> None:
    """Every file and directory under `root` (and `root`) flushed to disk: a rename published after
    this never points at data still in the page cache when the machine goes down."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: str, path: str) -> None:
    """Rename the finished `tmp` to `path` (its contents synced first), replacing an existing `path`
    (the old one moved aside first, then deleted)."""
    path = os.path.abspath(path)
    fsync_tree(tmp)
    old = None
    if os.path.exists(path):
        old = new_tmp_path(path)
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))  # the rename itself
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_leftovers(directory: str) -> list[str]:
    """Delete `.tmp-` entries under `directory` (one level): what a killed write or prune left.
    Not collective: the main rank, while nothing writes there. Returns what was removed."""
    if not os.path.isdir(directory):
        return []
    gone = [os.path.join(directory, n) for n in os.listdir(directory) if TMP_MARK in n]
    for path in gone:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
    return gone


@contextmanager
def atomic_directory(path: str):
    """Yield a temporary directory next to `path`; on normal exit it becomes `path` (single process).

    On an exception the temporary directory is removed and `path` is left as it was.
    """
    tmp = new_tmp_path(path)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, path)


@contextmanager
def atomic_directories(*paths: str):
    """`atomic_directory` for outputs that belong together (a policy and its critic): yields one
    temporary directory per path, all inside one `.tmp-` staging directory next to the first; on
    normal exit each replaces its path in turn. The caller writes its completion mark (a stage's
    summary.json) only after this returns, so a kill midway leaves a leftover and no mark."""
    stage = new_tmp_path(paths[0])
    tmps = [os.path.join(stage, str(i)) for i in range(len(paths))]
    for tmp in tmps:
        os.makedirs(tmp)
    try:
        yield tmps
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    for i, (tmp, path) in enumerate(zip(tmps, paths)):
        if i:
            kill_point("publish_together")
        publish(tmp, path)
    shutil.rmtree(stage, ignore_errors=True)


@contextmanager
def published(path: str, meta: dict, is_main: bool):
    """Collective: every rank writes its files into the yielded temporary directory (the same one
    on all ranks); then rank 0 writes meta.json (`meta`, the completion mark) and renames the
    directory to `path`. On an exception nothing is published."""
    from engine.distributed import barrier, broadcast_object

    json.dumps(meta)  # fail before anything is written if it is not JSON-able
    tmp = broadcast_object(new_tmp_path(path) if is_main else None)
    os.makedirs(tmp, exist_ok=True)
    yield tmp
    barrier()  # every rank's files are on disk
    kill_point("checkpoint_write")
    if is_main:
        write_meta(tmp, meta)
        publish(tmp, path)
    barrier()  # nobody proceeds (or lists checkpoints) before the rename


def write_meta(directory: str, meta: dict, name: str = META) -> None:
    with open(os.path.join(directory, name), "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_meta(path: str, name: str = META) -> dict:
    with open(os.path.join(path, name)) as f:
        return json.load(f)


def list_checkpoints(root: str) -> list[str]:
    """Complete checkpoints (with meta.json, no `.tmp-` in the name) under `root`, oldest step first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if TMP_MARK in name or not os.path.isfile(os.path.join(path, META)):
            continue
        try:
            step = int(read_meta(path)["step"])
        except (OSError, ValueError, KeyError, json.JSONDecodeError):
            continue
        found.append((step, name, path))
    return [path for _, _, path in sorted(found)]


def latest_checkpoint(root: str) -> str | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def prune_checkpoints(root: str, keep_last_n: int) -> list[str]:
    """Delete all but the newest `keep_last_n` complete checkpoints (<= 0 keeps all); returns the deleted.

    Not collective: call it on the main rank, after `save_checkpoint` returned everywhere.
    """
    if keep_last_n <= 0:
        return []
    doomed = list_checkpoints(root)[:-keep_last_n]
    for path in doomed:
        # NOTE: renamed first, so a kill mid-delete leaves a `.tmp-` leftover, never a listed half checkpoint
        gone = new_tmp_path(path)
        os.replace(path, gone)
        kill_point("prune")
        shutil.rmtree(gone, ignore_errors=True)
    return doomed


# ---------------------------------------------------------------- RNG


def rng_state() -> dict:
    """Every RNG's state as tensors and plain Python values (what `torch.load(weights_only=True)` reads)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "gauss": float(gauss)}
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s["name"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- model + optimizer (DCP)


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer, zero1: bool) -> dict:
    """The live state dicts (sharded DTensors under FSDP2, clean FQNs) that DCP saves into / loads into."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if zero1:  # ZeroRedundancyOptimizer is not understood by get_state_dict; its shard goes to rank{r}.pt
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _strip(fqn: str) -> str:
    return fqn.removeprefix(VIEW_PREFIX)


def _inner_names(state: dict) -> dict:
    """`state` with a `ModuleView`'s prefix dropped from every FQN (same values, not copies), so a
    checkpoint holds the inner model's own names whether or not a role wraps it."""
    out = {"model": {_strip(k): v for k, v in state["model"].items()}}
    if "optim" in state:
        optim = state["optim"]
        out["optim"] = {"state": {_strip(k): v for k, v in optim["state"].items()},
                        "param_groups": [{**g, "params": [_strip(p) for p in g["params"]]} for g in optim["param_groups"]]}
    return out


def _view_names(loaded: dict, like: dict) -> dict:
    """`loaded` (inner names, as `_inner_names` gave) back under the FQNs of `like`."""
    out = {"model": {k: loaded["model"][_strip(k)] for k in like["model"]}}
    if "optim" in like:
        optim = loaded["optim"]
        out["optim"] = {"state": {k: optim["state"][_strip(k)] for k in like["optim"]["state"]},
                        "param_groups": [{**g, "params": list(lg["params"])}
                                         for g, lg in zip(optim["param_groups"], like["optim"]["param_groups"])]}
    return out


def save_model_optimizer(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer, zero1: bool) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_inner_names(_dcp_state(model, optimizer, zero1)), checkpoint_id=directory, process_group=group())


def load_model_optimizer(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer, zero1: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    live = _dcp_state(model, optimizer, zero1)
    loaded = _inner_names(live)
    dcp.load(loaded, checkpoint_id=directory, process_group=group())  # in place, each rank reads the pieces of its shards
    state = _view_names(loaded, live)
    if zero1:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.pt")


def save_rank_state(directory: str, rank: int, state: dict[str, Any]) -> None:
    torch.save(state, rank_file(directory, rank))


def load_rank_state(directory: str, rank: int) -> dict[str, Any] | None:
    path = rank_file(directory, rank)
    if not os.path.exists(path):
        return None
    # weights_only: tensors and plain Python values only (rng_state stores numpy's state as a tensor)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path} holds objects that are not tensors or plain values (written by an older "
                         f"version of this program, or not by it): it cannot be resumed ({str(e).splitlines()[0]})") from None
