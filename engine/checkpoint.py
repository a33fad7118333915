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
import random
import shutil
import uuid
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .parallelize import VIEW_PREFIX

META = "meta.json"
ENGINE_META = "engine.json"
TMP_MARK = ".tmp-"


# ---------------------------------------------------------------- directories


def new_tmp_path(path: str) -> str:
    return f"{os.path.abspath(path)}{TMP_MARK}{uuid.uuid4().hex[:8]}"


def publish(tmp: str, path: str) -> None:
    """Rename the finished `tmp` to `path`, replacing an existing `path` (old one moved aside first)."""
    path = os.path.abspath(path)
    old = None
    if os.path.exists(path):
        old = new_tmp_path(path)
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
        shutil.rmtree(path, ignore_errors=True)
    return doomed


# ---------------------------------------------------------------- RNG


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
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

        np.random.set_state(state["numpy"])
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


def _inner_names(state: dict) -> dict:
    """`state` with a `ModuleView`'s prefix dropped from every FQN (same values, not copies), so a
    checkpoint holds the inner model's own names whether or not a role wraps it."""
    def strip(fqn: str) -> str:
        return fqn.removeprefix(VIEW_PREFIX)

    out = {"model": {strip(k): v for k, v in state["model"].items()}}
    if "optim" in state:
        optim = state["optim"]
        out["optim"] = {"state": {strip(k): v for k, v in optim["state"].items()},
                        "param_groups": [{**g, "params": [strip(p) for p in g["params"]]} for g in optim["param_groups"]]}
    return out


def _view_names(loaded: dict, like: dict) -> dict:
    """`loaded` (inner names, as `_inner_names` gave) back under the FQNs of `like`."""
    def strip(fqn: str) -> str:
        return fqn.removeprefix(VIEW_PREFIX)

    out = {"model": {k: loaded["model"][strip(k)] for k in like["model"]}}
    if "optim" in like:
        optim = loaded["optim"]
        out["optim"] = {"state": {k: optim["state"][strip(k)] for k in like["optim"]["state"]},
                        "param_groups": [{**g, "params": list(lg["params"])}
                                         for g, lg in zip(optim["param_groups"], like["optim"]["param_groups"])]}
    return out


def save_model_optimizer(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer, zero1: bool) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_inner_names(_dcp_state(model, optimizer, zero1)), checkpoint_id=directory)


def load_model_optimizer(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer, zero1: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    live = _dcp_state(model, optimizer, zero1)
    loaded = _inner_names(live)
    dcp.load(loaded, checkpoint_id=directory)  # in place, each rank reads the pieces of its shards
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
    # weights_only=False: the file holds Python RNG tuples and numpy state, written by us.
    return torch.load(path, map_location="cpu", weights_only=False)
