"""Hub names on a machine without internet: fail in seconds, naming the key and what to do.

Without this, `from_pretrained("facebook/opt-125m")` or `load_dataset("Dahoas/rm-static")` with no
network retries for 30-55 s (measured: 55 s for a tokenizer, 31 s for a dataset) before failing.
So before anything loads a name that is not a local path, `ensure_hub` asks once per process
whether the hub answers (an HTTP HEAD to HF_ENDPOINT, default huggingface.co, within
PROBE_TIMEOUT_S). If it does not:

  - the name is in the local Hugging Face cache -> this process switches to offline mode (as
    HF_HUB_OFFLINE=1 would) and the libraries load it from the cache without waiting;
  - it is not -> ConfigError naming the key: use a local path, or pre-download and set
    HF_HUB_OFFLINE=1.

With HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE / HF_DATASETS_OFFLINE) nothing is probed: the
libraries read the cache only, and fail fast themselves when it lacks the name.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import sys
import threading
import urllib.error
import urllib.request
from typing import Any

from rlhf.core.errors import ConfigError

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
DEFAULT_ENDPOINT = "https://huggingface.co"
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")  # "gpt2", "facebook/opt-125m"
_LOCAL_PREFIXES = ("/", "./", "../", "~", "outputs/")  # outputs/: where the stages write (conf/*.yaml)
_STAGE_OF_KEY = {"actor.model": "rlhf.sft", "critic.model": "rlhf.reward", "reward_model.model": "rlhf.reward"}
_TRUE = {"1", "ON", "YES", "TRUE"}
SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet")  # the data files rlhf/data/sources.py reads
# Suffixes that mark a string as a file path (not a hub name) even when it does not exist.
FILE_LIKE_SUFFIXES = frozenset(
    {".csv", ".tsv", ".txt", ".arrow", ".gz", ".zip", ".bz2", ".xz", ".zst", ".xlsx", ".pkl", ".pt", ".yaml", ".yml"}
)


def looks_local(path: str) -> bool:
    """Meant as a local path: absolute, ./ ../ ~ or outputs/ (where the stages write), or its first
    component is an existing directory ("runs/sft" beside a runs/ folder). Such a path that does not
    exist is a missing file, never a hub name to look up.
    NOTE: so a hub organisation named "outputs" (or named like a local folder) needs a local download."""
    first = path.split("/", 1)[0]
    return (path.startswith(_LOCAL_PREFIXES) or os.path.exists(os.path.expanduser(path))
            or (first != path and os.path.isdir(first)))


def missing_path_error(path: str, key: str) -> ConfigError:
    """'no such file or directory', with the stage to run first when the key or path names one."""
    stage = _STAGE_OF_KEY.get(key) or next(
        (f"rlhf.{s}" for s in ("sft", "reward", "ppo") if path.lstrip("./").startswith(f"outputs/{s}")), None)
    hint = f": run `python -m {stage}` first, or point {key} at a model" + (
        " (model.fallback_to_config=true trains from random weights built from model.config)"
        if key == "model.name_or_path" else "") if stage else \
        " (has the stage that writes it run? a stage's output_dir, a Hugging Face directory or a hub name is expected)"
    return ConfigError(f"{key}={path!r}: no such file or directory{hint}")


def check_local(path: str, key: str) -> None:
    """Raises `missing_path_error` when `path` is meant as local (`looks_local`) and does not exist."""
    if looks_local(path) and not os.path.exists(os.path.expanduser(path)):
        raise missing_path_error(path, key)


def is_hub_name(source: str) -> bool:
    """Whether `source` would be looked up on the hub: no such local path, and shaped like a repo id.
    (A missing file with a data suffix is left to rlhf/data/sources.py, which names the file.)"""
    if looks_local(source):
        return False
    suffix = os.path.splitext(source)[1].lower()
    return bool(_HUB_ID.match(source)) and suffix not in SUPPORTED_EXTENSIONS and suffix not in FILE_LIKE_SUFFIXES


def offline_mode() -> bool:
    """HF_HUB_OFFLINE=1 (or its older names) is set, or this process switched to the cache."""
    env = (os.environ.get(k, "").upper() for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(v in _TRUE for v in env)


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


@functools.cache
def hub_reachable() -> bool:
    """Whether the hub endpoint answers an HTTP HEAD (any status) within PROBE_TIMEOUT_S; through the
    proxy of HTTPS_PROXY/HTTP_PROXY when one is set (urllib reads them). In a thread, because a hanging
    name lookup ignores socket timeouts."""
    result: list[bool] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint(), method="HEAD"), timeout=PROBE_TIMEOUT_S).close()
            result.append(True)
        except urllib.error.HTTPError:  # an answer, if not a 200: the hub is there
            result.append(True)
        except (OSError, ValueError):  # refused, unreachable, timed out, no such host, a malformed URL
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(PROBE_TIMEOUT_S)  # a lookup still hanging is left behind in its daemon thread
    return bool(result) and result[0]


def in_local_cache(name: str, repo_type: str, cache_dir: str | None = None) -> bool:
    """Whether the Hugging Face caches hold something of `name` (hub cache snapshots; for datasets
    also the `datasets` cache or `cache_dir`). Partial content still fails later, quickly, offline."""
    from huggingface_hub import constants

    folder = f"{repo_type}s--{name.replace('/', '--')}"
    if os.path.isdir(os.path.join(constants.HF_HUB_CACHE, folder, "snapshots")):
        return True
    if repo_type != "dataset":
        return False
    datasets_cache = os.environ.get("HF_DATASETS_CACHE") or os.path.join(constants.HF_HOME, "datasets")
    bases = [b for b in (cache_dir, datasets_cache) if b]
    return any(os.path.isdir(os.path.join(b, sub)) for b in bases for sub in (name.replace("/", "___"), folder))


def use_local_cache() -> None:
    """Offline mode for the rest of this process (the libraries read the flag at import, so the
    imported modules are set too)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    for mod in ("huggingface_hub.constants", "datasets.config"):
        if mod in sys.modules:
            sys.modules[mod].HF_HUB_OFFLINE = True


def ensure_hub(source: str, key: str, repo_type: str = "model", cache_dir: str | None = None) -> None:
    """Call before `from_pretrained`/`load_dataset(source)`: returns when `source` is local, offline
    mode is on, the hub answers, or the cache holds it (then offline mode is switched on); raises
    ConfigError naming `key` otherwise (also for a local path that does not exist: `check_local`)."""
    check_local(source, key)
    if not is_hub_name(source) or offline_mode() or hub_reachable():
        return
    if in_local_cache(source, repo_type, cache_dir):
        logger.warning("the hub (%s) does not answer: loading %s=%s from the local cache (as HF_HUB_OFFLINE=1)",
                       endpoint(), key, source)
        use_local_cache()
        return
    kind = " --repo-type dataset" if repo_type == "dataset" else ""
    raise ConfigError(
        f"{key}={source!r} is not a local path, and as a hub {repo_type} name it cannot be fetched: the hub "
        f"({endpoint()}) did not answer within {PROBE_TIMEOUT_S:g} s and the local cache does not hold it. "
        f"Give a local path (e.g. from `hf download{kind} {source} --local-dir DIR` where there is internet), "
        f"or pre-download it into the cache (`hf download{kind} {source}`) and set HF_HUB_OFFLINE=1"
    )


def check_sources(config: Any, prefix: str = "", unused: frozenset = frozenset()) -> None:
    """`ensure_hub` on every key of a typed config marked `field(metadata={"hub": "model"|"dataset"})`
    (on each entry of a list, as data.path=[a,b]), so that an unreachable hub name fails with its exact
    key before anything starts; the `unused` keys
    (those the run will not read, e.g. PPO's critic.model without a critic) are left."""
    for f in dataclasses.fields(config):
        value, key = getattr(config, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            check_sources(value, key + ".", unused)
        elif f.metadata.get("hub") and key not in unused:
            # NOTE: with fallback_to_config a name_or_path that is not local builds from config (rlhf/modeling/load.py)
            if f.name == "name_or_path" and getattr(config, "fallback_to_config", False):
                continue
            # a list (data.path=[a,b]: a mixture of sources): each of its names
            for source in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(source, str) and source:
                    ensure_hub(source, key, f.metadata["hub"], getattr(config, "cache_dir", None))
