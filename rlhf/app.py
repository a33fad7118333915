"""What the three stage apps share: error reporting, seeding, the run directory, resume, progress."""
from __future__ import annotations

import contextlib
import logging
import os
import random
import sys
from typing import Any

import torch
from tqdm import tqdm

from rlhf.config import ROOT, ConfigError, as_yaml
from rlhf.data.records import DataFormatError

logger = logging.getLogger("rlhf")

CONF_DIR = str(ROOT / "conf")
CHECKPOINTS = "checkpoints"


class TrainingError(RuntimeError):
    """A run that cannot go on (e.g. non-finite losses step after step); the message says why."""


@contextlib.contextmanager
def user_errors():
    """Errors in the user's config or data end the run with one clear line and exit code 2,
    not a stack trace from deep inside a library."""
    try:
        yield
    except (ConfigError, DataFormatError, FileNotFoundError, TrainingError) as e:
        kind = "training" if isinstance(e, TrainingError) else "configuration/data"
        print(f"error ({kind}): {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def setup_logging(is_main: bool) -> None:
    """Quiet the libraries; non-main ranks only warn (the main rank speaks for the run)."""
    from rlhf.models import quiet_transformers

    quiet_transformers()
    logging.getLogger().setLevel(logging.INFO if is_main else logging.WARNING)
    for name in ("httpx", "urllib3", "filelock", "datasets"):
        logging.getLogger(name).setLevel(logging.WARNING)


def save_config(output_dir: str, config: Any) -> None:
    os.makedirs(output_dir, exist_ok=True)
    tmp = os.path.join(output_dir, "config.yaml.tmp")
    with open(tmp, "w") as f:
        f.write(as_yaml(config))
    os.replace(tmp, os.path.join(output_dir, "config.yaml"))


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, CHECKPOINTS)


def resolve_resume(resume: bool | str, output_dir: str, key: str = "train.resume") -> str | None:
    """`false` -> None; `true` -> the latest complete checkpoint (None, with a warning, if there is
    none); a path -> that checkpoint, which must be complete."""
    from engine import latest_checkpoint
    from engine.checkpoint import META

    if resume is False or (isinstance(resume, str) and resume.lower() in ("false", "")):
        return None
    if resume is True or (isinstance(resume, str) and resume.lower() == "true"):
        path = latest_checkpoint(checkpoint_root(output_dir))
        if path is None:
            logger.warning("%s=true but %s holds no complete checkpoint: starting from scratch",
                           key, checkpoint_root(output_dir))
        return path
    if not os.path.isfile(os.path.join(resume, META)):
        raise ConfigError(f"{key}={resume!r} is not a complete checkpoint directory (no {META})")
    return resume


def fresh_checkpoints(output_dir: str, is_main: bool) -> None:
    """A run that does not resume starts without the old run's checkpoints (so `resume=true`
    later can never pick up a different run's state)."""
    import shutil

    root = checkpoint_root(output_dir)
    if is_main and os.path.isdir(root) and os.listdir(root):
        logger.info("removing the previous run's checkpoints in %s (train.resume=false)", root)
        shutil.rmtree(root)


def progress(total: int, initial: int, desc: str, is_main: bool) -> tqdm:
    return tqdm(total=total, initial=initial, desc=desc, disable=not is_main, dynamic_ncols=True,
                file=sys.stdout, mininterval=1.0)


def count_skips(skips: int, out: dict, limit: int) -> int:
    """Consecutive non-finite steps so far; raises TrainingError at `limit`."""
    skips = skips + 1 if out["skipped"] else 0
    if skips >= limit:
        raise TrainingError(
            f"{skips} consecutive steps had a non-finite loss or gradient (last loss {out['loss']}); "
            "lower the learning rate, check the data, or use engine.precision=fp32"
        )
    return skips


def maybe_checkpoint(engine: Any, save_every: int, keep_last_n: int, output_dir: str, done: int, total: int,
                     extra_state: dict | None = None) -> None:
    """A sharded checkpoint every `save_every` steps and at the end (when saving at all). Collective."""
    from engine import prune_checkpoints

    if save_every and (done % save_every == 0 or done == total):
        engine.save_checkpoint(os.path.join(checkpoint_root(output_dir), f"step_{done:07d}"),
                               {"step": done, **(extra_state or {})})
        if engine.info.is_main:
            prune_checkpoints(checkpoint_root(output_dir), keep_last_n)


class Throughput:
    """Tokens per second over the whole world since the last `rate()` call (a collective)."""

    def __init__(self) -> None:
        import time

        self._time = time.time
        self.tokens, self.t0 = 0, self._time()

    def add(self, n: int) -> None:
        self.tokens += n

    def rate(self) -> float:
        from engine.distributed import all_reduce_sum

        total = all_reduce_sum(torch.tensor(float(self.tokens))).item()
        now = self._time()
        rate = total / max(now - self.t0, 1e-9)
        self.tokens, self.t0 = 0, now
        return rate


def open_run(engine: Any, resume: bool | str, output_dir: str, logger_cfg: Any, config: Any) -> tuple[Any, int, bool]:
    """Resume `engine` (train.resume) or start clean; open the metrics log; save config.yaml.

    Returns (log, first step to run, whether it resumed).
    """
    from rlhf.runlog import RunLog

    path = resolve_resume(resume, output_dir)
    if path:
        engine.load_checkpoint(path)
        logger.info("resumed from %s at step %d", path, engine.global_step)
    else:
        fresh_checkpoints(output_dir, engine.info.is_main)
    start = engine.global_step
    log = RunLog(output_dir, logger_cfg, is_main=engine.info.is_main, resume_step=start if path else None)
    if engine.info.is_main:
        save_config(output_dir, config)
    return log, start, bool(path)
