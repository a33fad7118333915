"""What the stage apps share below the skeleton (rlhf/run/stage.py): the entry point, error reporting,
seeding, the run directory, resume, progress."""
from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

import hydra
import torch.distributed as dist
from hydra._internal.utils import get_args_parser

from engine import exit_process, latest_checkpoint, list_checkpoints
from engine.checkpoint import META
from engine.distributed import barrier, shutdown_distributed
from engine.errors import CheckpointError, LaunchError
from rlhf.config import PPOConfig, ServeConfig, as_yaml, cli, compose, to_config
from rlhf.config.ds_config import ds_overrides, log_report
from rlhf.config.validate import unused_sources
from rlhf.core.errors import ConfigError, DataFormatError, TrainingError
from rlhf.core.hub import check_sources
from rlhf.core.paths import CONF_DIR
from rlhf.modeling.load import quiet_transformers

logger = logging.getLogger("rlhf")

CHECKPOINTS = "checkpoints"


@dataclass
class InProcess:
    """A stage run from Python (rlhf/api.py) rather than from a command line: `stage_main` raises the
    user error it would print (ConfigError, ...: the same text), ends neither the process nor a torchrun
    job's process group, and records here the config the run got (where its summary.json is)."""

    config: Any = None  # the typed config `run` got (None: nothing ran, e.g. --help)


_IN_PROCESS: InProcess | None = None


@contextlib.contextmanager
def in_process() -> Iterator[InProcess]:
    """Within the block, a stage's `main()` (as its command line runs it, sys.argv included) behaves as
    `InProcess` says; one stage at a time."""
    global _IN_PROCESS
    if _IN_PROCESS is not None:
        raise RuntimeError("a stage is already running in this process (rlhf.api runs one at a time)")
    before = os.environ.get("HYDRA_FULL_ERROR")
    # Hydra turns an exception of the task into a printed trace and exit code 1, unless this is set: then
    # it re-raises it, and the caller gets the run's own exception
    os.environ["HYDRA_FULL_ERROR"] = "1"
    _IN_PROCESS = InProcess()
    try:
        yield _IN_PROCESS
    finally:
        _IN_PROCESS = None
        if before is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = before


@contextlib.contextmanager
def user_errors():
    """Errors in the user's config or data end the run with one clear line and exit code 2,
    not a stack trace from deep inside a library (from Python, `in_process`: the error itself)."""
    try:
        yield
    except (ConfigError, DataFormatError, FileNotFoundError, TrainingError, CheckpointError, LaunchError) as e:
        if _IN_PROCESS is not None:
            raise
        kind = "training" if isinstance(e, TrainingError) else "checkpoint" if isinstance(e, CheckpointError) else \
            "launch" if isinstance(e, LaunchError) else \
            "configuration/data"  # subclasses too (the http reward source's RewardServerDown is a TrainingError)
        print(f"error ({kind}): {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def stage_main(config_name: str, schema: type, run: Callable[[Any], Any]) -> None:
    """The entry of a stage app: `python -m rlhf.<stage> [key=value ...]` -> `run(typed config)`.

    Hydra composes conf/<config_name>.yaml with the overrides (`@hydra.main` as before: same run
    directory, log file and flags), `to_config` types it as the dataclass `schema`, hub names are
    checked (rlhf/core/hub.py), then `run` gets the config. Around Hydra: `--help` lists every key of
    `schema` with its current value and description (rlhf/config/cli.py); an override naming a key that
    `schema` lacks (`train.lrr=1`, `+train.lrr=1`) stops with exit code 2 and the closest valid key,
    before Hydra would suggest `+key` or merge it; so do a flag Hydra does not know (TRL's
    `--learning_rate 1e-5`: the override to write instead), a comma list without brackets and an
    output_dir that is a file; `--cfg` prints values resolved (no `${root:...}`).
    """
    module = _stage_module(run)
    parser = get_args_parser()
    with user_errors():  # `--learning_rate 1e-5` (TRL's habit): the override to write, not Hydra's usage page
        foreign = {w.partition("=")[0] for w in parser.parse_known_args(sys.argv[1:])[1] if w.startswith("-")}
        cli.check_foreign_flags(sys.argv[1:], foreign, schema, module)
    args = parser.parse_args(sys.argv[1:])
    with user_errors():
        if args.help:
            print(_help_page(args.config_name or config_name, schema, module, args.overrides, run), end="")
            return
        rewrites = cli.check_overrides(args.overrides, schema, CONF_DIR, module, multirun=args.multirun)
        ds_args, ds_report = _ds_config(args.overrides, schema, module)
    sys.argv[1:] = [rewrites.get(a, a) for a in sys.argv[1:]]
    if ds_args:  # before the user's first override, so that the command line wins
        first = sys.argv.index(rewrites.get(args.overrides[0], args.overrides[0]), 1)
        sys.argv[first:first] = ds_args
    if args.cfg and not args.resolve:
        sys.argv.append("--resolve")  # NOTE: resolves only what is printed; config.yaml keeps ${...}

    def task(raw: Any) -> None:
        with user_errors():
            config = to_config(raw, schema)
            _check_ds_config_applied(config, ds_report)
            unused = unused_sources(config) if isinstance(config, (PPOConfig, ServeConfig)) else set()
            check_sources(config, unused=frozenset(unused))  # keys the run will not read are not probed
            if _IN_PROCESS is not None:
                _IN_PROCESS.config = config
            run(config)

    task.__module__ = module  # Hydra names the job (and its .log file) after this module, as before
    code: int | str | None = 0
    try:
        hydra.main(version_base="1.3", config_path=CONF_DIR, config_name=config_name)(task)()
    except SystemExit as e:
        code = e.code
    finally:
        if _IN_PROCESS is not None and "WORLD_SIZE" not in os.environ:
            shutdown_distributed()  # the run's group of one; the next run in this process makes its own
    if _IN_PROCESS is not None:  # the caller's process goes on (under torchrun its group too, for the next run)
        if code:
            raise SystemExit(code)
        return
    if dist.is_initialized():  # a run that used a process group ends without finalization races
        if isinstance(code, str):
            print(code, file=sys.stderr)
        exit_process(code if isinstance(code, int) else (0 if code is None else 1))
    if code:
        raise SystemExit(code)


def _ds_config(overrides: list[str], schema: type, module: str) -> tuple[list[str], Any]:
    """`engine.ds_config=PATH` on the command line: the file's settings as Hydra overrides (placed
    before the user's) and the report that the run logs (rlhf/config/ds_config.py); else ([], None)."""
    args, report = ds_overrides(overrides, schema, CONF_DIR, module)
    if args:
        cli.check_overrides(args, schema, CONF_DIR, module)  # our keys and types, as for the user's
    return args, report


def _check_ds_config_applied(config: Any, report: Any) -> None:
    """The file was read from the command line (and its mapping is logged once, by rank 0); a
    ds_config set anywhere else (a YAML file) would be silently unread, so it is an error."""
    path = getattr(getattr(config, "engine", None), "ds_config", None)
    if path and report is None:
        raise ConfigError(f"engine.ds_config={path} is read from the command line only: pass "
                          f"engine.ds_config={path} there")
    if report is not None and os.environ.get("RANK", "0") == "0":
        log_report(report, logger)


def _stage_module(run: Callable) -> str:
    """The module that defines `run` ("rlhf.sft"), also under `python -m` (where it is "__main__")."""
    spec = getattr(sys.modules.get(run.__module__), "__spec__", None)
    return spec.name if spec is not None else run.__module__


def _help_page(config_name: str, schema: type, module: str, overrides: list[str], run: Callable) -> str:
    rewrites = cli.check_overrides(overrides, schema, CONF_DIR, module)
    overrides = _ds_config(overrides, schema, module)[0] + [rewrites.get(o, o) for o in overrides]
    raw = compose(config_name, overrides, return_hydra_config=True, job_name=module.rsplit(".", 1)[-1])
    choices = cli.config_groups(CONF_DIR)
    chosen = {g: raw.hydra.runtime.choices.get(g) for g in choices}
    choices = {g: opts for g, opts in choices.items() if chosen[g] is not None}  # groups this stage uses
    doc = (sys.modules[run.__module__].__doc__ or "").strip().split("\n")[0]
    return cli.help_text(module, doc, to_config(raw, schema), schema, choices, chosen)


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
    """The checkpoint a run continues from, or None for a fresh start: `false` -> None; `true` -> the
    latest complete checkpoint in output_dir/checkpoints, which must exist (a ConfigError naming `auto`
    otherwise: "continue" with nothing to continue is a mistake, not a fresh run); `auto` -> that
    checkpoint if there is one, else None (logged); a path -> that checkpoint, which must be complete."""
    word = resume.lower() if isinstance(resume, str) else resume
    if word in (False, "false", ""):
        return None
    if word in (True, "true", "auto"):
        root = checkpoint_root(output_dir)
        path = latest_checkpoint(root)
        if path is None and word == "auto":
            logger.info("%s=auto: %s holds no complete checkpoint: starting fresh", key, root)
        elif path is None:
            raise ConfigError(f"{key}=true: {root} holds no complete checkpoint to continue from (checkpoints are "
                              f"written every train.save_every steps and at the end); {key}=auto resumes when there "
                              f"is one and starts fresh otherwise, {key}=false starts fresh")
        return path
    if not os.path.isfile(os.path.join(resume, META)):
        raise ConfigError(f"{key}={resume!r} is not a complete checkpoint directory (no {META})")
    return resume


# What a finished or interrupted run leaves in its output_dir (besides config.yaml, metrics.jsonl and
# logs, which a fresh run rewrites): a fresh run replaces these only with train.overwrite=true.
PREVIOUS_OUTPUTS = ("summary.json", "model", "critic", "model_ema")


def replace_previous_run(output_dir: str, overwrite: bool, is_main: bool) -> None:
    """A fresh run (nothing resumed) into `output_dir`: a previous run's checkpoints or outputs are
    an error naming the two ways on (nothing is deleted), or with `overwrite` are removed first (so
    `resume=true` later, or the next stage, never picks up a different run's state or model)."""
    root = checkpoint_root(output_dir)
    checkpoints = [f"checkpoints/{os.path.basename(c)}" for c in list_checkpoints(root)[-1:]]
    found = checkpoints + [f for f in PREVIOUS_OUTPUTS if os.path.exists(os.path.join(output_dir, f))]
    if not found:
        return
    if not overwrite:
        resume = "train.resume=true continues it from its last checkpoint, " if checkpoints else ""
        raise ConfigError(
            f"output_dir={output_dir} holds a previous run ({', '.join(found)}): {resume}train.overwrite=true "
            "deletes it and starts afresh, or choose another output_dir"
        )
    if is_main:
        logger.warning("train.overwrite=true: removing the previous run in %s (%s)", output_dir, ", ".join(found))
        for f in (CHECKPOINTS, *PREVIOUS_OUTPUTS):
            path = os.path.join(output_dir, f)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
    barrier()


def progress(total: int, initial: int, desc: str, is_main: bool) -> tqdm:
    return tqdm(total=total, initial=initial, desc=desc, disable=not is_main, dynamic_ncols=True,
                file=sys.stdout, mininterval=1.0)
