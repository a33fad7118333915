"""The skeleton every stage app runs on: open the run, evaluate before, step with a cadence, finish.

    run, accum = Run.open("sft", "SFT", cfg, cfg.train, validate_sft)  # process group, logging, checks, seed
    ... data, models, engines (the stage's own) ...
    run.begin(engines, total, evaluate, eval_line)           # resume or start clean; "before" evaluation
    for step in run.steps():                                 # log / eval / save cadence after each step
        out = engine.train_step(batches, loss)
        run.check(out)                                       # non-finite steps in a row -> TrainingError
        if run.logs(step):
            run.log_train(step, {...}, postfix={...})
    after = run.evaluate_after()
    run.finish({...}, model_dir, plot)                       # plot, summary.json, the last lines

A stage that trains one engine on rows (SFT, reward, DPO) runs the whole loop as
`run.loop(engine, order, accum, batch, loss, keys, postfix)`; PPO writes its own loop on `steps()`.

What a stage says is only its own: data, its step, its evaluation, its summary figures. What
every stage gets the same way:
  - output_dir with config.yaml, metrics.jsonl and samples.jsonl (each evaluation's held-out samples;
    both truncated after the resumed step), the loggers of `logger=...`, checkpoints/
    (`train.save_every`, `train.keep_last_n`). A fresh run (nothing to resume) into a directory that
    holds a previous run's checkpoints or outputs stops before any model loads, naming
    `train.resume=true` and `train.overwrite=true`; only the latter deletes them;
  - resume (`train.resume`): the engines' sharded state and a JSON `extra_state` holding the step,
    the "before" evaluation (so summary.json compares with the untrained model after any resume)
    and what the stage adds (`state()`, e.g. PPO's adaptive KL controller);
  - the evaluation cadence: before (step 0), every `train.eval_every` steps, after (the last step);
  - `train.max_consecutive_skips` non-finite steps in a row end the run with a TrainingError;
  - `run.stop(reason)` (e.g. PPO's train.stop_on_alarm) ends the loop after the current step: a
    checkpoint, then the final evaluation, export and summary as after the last step;
  - a tqdm bar with the stage's key figures, the memory plan after the first step.
"""
from __future__ import annotations

import copy
import gc
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from engine import compile_seconds, format_memory_report, init_distributed, prune_checkpoints, set_deterministic
from engine.checkpoint import read_meta, remove_leftovers
from engine.distributed import all_gather_object, all_reduce_sum, barrier
from rlhf.config import as_yaml
from rlhf.core.errors import ConfigError, TrainingError
from rlhf.core.provenance import describe, provenance
from rlhf.data import Row
from rlhf.data.packing import batch_tokens
from rlhf.data.sources import write_rows
from rlhf.data.stage import held_out_line
from rlhf.run.app import (
    checkpoint_root, progress, replace_previous_run, resolve_resume, save_config, seed_everything, setup_logging,
)
from rlhf.run.runlog import (
    METRICS, SAMPLES, RunLog, format_summary, plot_series, read_metrics, series, write_summary,
)

logger = logging.getLogger("rlhf")

Plot = Sequence[tuple[str, Sequence[tuple[str, str, str]]]]  # [(panel ylabel, [(label, kind, key), ...]), ...]
EVAL_ROWS = "eval_rows.jsonl"  # in output_dir: the held-out rows a stage evaluated on
STARTS = "starts.json"  # in output_dir: the starts compared (starts.n > 1) and the one continued


class Checkpointable(Protocol):
    """What a run saves and resumes: one TrainEngine, or several behind one object (PPO's models)."""

    def save_checkpoint(self, path: str, extra_state: dict) -> None: ...
    def load_checkpoint(self, path: str) -> dict: ...


def without_samples(ev: dict[str, Any]) -> dict[str, Any]:
    """An evaluation as logged and checkpointed: figures only (its generated samples are printed)."""
    return {k: v for k, v in ev.items() if k != "samples"}


def config_hash(cfg: Any) -> str:
    import hashlib

    return hashlib.sha256(as_yaml(cfg).encode()).hexdigest()[:16]


def flat_config(cfg: Any) -> dict[str, Any]:
    """The config as {dotted key: value} (what a checkpoint records, to name what a resume changed)."""
    from omegaconf import OmegaConf

    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(OmegaConf.to_container(OmegaConf.structured(cfg)), "")
    return out


# Keys a resume is expected to change (or that cannot matter to the state it resumes).
RESUME_FREE = ("train.resume", "train.overwrite", "output_dir", "logger.", "train.log_every", "train.eval_every",
               "train.save_every", "train.keep_last_n")


def resume_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between the run a checkpoint recorded (`Run.record`) and this one, as
    "key: old -> new" lines (world size first); keys in RESUME_FREE are not listed."""
    lines = []
    if saved.get("world_size") not in (None, now["world_size"]):
        lines.append(f"world size: {saved['world_size']} -> {now['world_size']}")
    old, new = saved.get("config", {}), now["config"]
    for key in sorted(set(old) | set(new)):
        if not key.startswith(RESUME_FREE) and old.get(key, "(absent)") != new.get(key, "(absent)"):
            lines.append(f"{key}: {old.get(key, '(absent)')} -> {new.get(key, '(absent)')}")
    return lines


def other_code(saved: dict[str, Any]) -> str | None:
    """One line when the checkpoint's run (`Run.record`) was made by other code than this one (another
    version, or another commit of a checkout), else None. A checkpoint from before versions were
    recorded is from an older version."""
    now = provenance()
    code = saved.get("code")
    if code is None:
        return f"it was saved by an older version than this one, {describe(now)} (it records none)"
    if (code.get("version"), code.get("commit")) == (now["version"], now["commit"]):
        return None
    return f"it was saved by version {describe(code)}, this is {describe(now)}"


def agree(resume_path: str | None, cfg: Any) -> None:
    """Every rank must run the same config from the same checkpoint (a rank that saw another file
    system, or another command line, would train something else in lock-step): compared across
    ranks, a mismatch is an error on every rank naming what differs."""
    mine = (resume_path, config_hash(cfg))
    every = all_gather_object(mine)
    if any(e != every[0] for e in every):
        what = "checkpoint to resume from" if any(e[0] != every[0][0] for e in every) else "configuration"
        raise ConfigError(f"the ranks disagree on the {what}: " + "; ".join(
            f"rank {r}: {p or 'none'} (config {h})" for r, (p, h) in enumerate(every)))


class Throughput:
    """Tokens per second over the whole world since the last `rate()` call (a collective)."""

    def __init__(self) -> None:
        self.tokens, self.t0 = 0, time.time()

    def add(self, n: int) -> None:
        self.tokens += n

    def rate(self) -> float:
        total = all_reduce_sum(torch.tensor(float(self.tokens))).item()
        now = time.time()
        rate = total / max(now - self.t0, 1e-9)
        self.tokens, self.t0 = 0, now
        return rate


class Run:
    """One stage run; see the module docstring. `name`: the progress bar, `<name>.png` and summary's
    "stage"; `title`: the plot's title and the last lines. `cfg` has output_dir, seed and logger;
    `train` has resume, log_every, eval_every, save_every, keep_last_n and max_consecutive_skips."""

    def __init__(self, name: str, title: str, cfg: Any, train: Any):
        self.t_start = time.time()
        self.name, self.title, self.cfg, self.train = name, title, cfg, train
        self.out_dir = cfg.output_dir
        set_deterministic(cfg.engine.deterministic)  # before any model or cuBLAS handle exists
        self.info = init_distributed(timeout_s=cfg.engine.timeout_s)
        setup_logging(self.info.is_main)
        self.total = self.start = 0
        self.before: dict[str, Any] = {}
        self.extra_state: dict[str, Any] = {}
        self._skips = 0
        self.resume_path: str | None = None
        self.stop_reason: str | None = None  # set by `stop`
        self._last_eval: tuple[int, dict] | None = None
        self._prelude: tuple[list[tuple[int, str, dict]], dict[int, list]] | None = None  # the chosen start's log

    @classmethod
    def open(cls, name: str, title: str, cfg: Any, train: Any, validate: Callable[[Any, Any], Any]) -> tuple[Run, Any]:
        """The process group, logging, `validate(cfg, info)` (its result is returned), the checkpoint
        to resume from (or the previous run's outputs refused / removed: see the module doc), the seed."""
        run = cls(name, title, cfg, train)
        run.as_given = copy.deepcopy(cfg)  # config.yaml: before validation fits micro-batches to the world size
        checked = validate(cfg, run.info)
        if run.info.is_main:  # what a killed checkpoint write, export or prune left behind
            for path in remove_leftovers(checkpoint_root(run.out_dir)) + remove_leftovers(run.out_dir):
                logger.info("removed %s (left by an interrupted write)", path)
        run.resume_path = resolve_resume(train.resume, run.out_dir)
        agree(run.resume_path, cfg)
        if run.resume_path is None:
            replace_previous_run(run.out_dir, train.overwrite, run.info.is_main)
        seed_everything(cfg.seed)
        return run, checked

    # ------------------------------------------------------------------ data

    def held_out(self, rows: Sequence[Row], n: int, unit: str, source: str | None) -> dict[str, Any]:
        """The stage's held-out set (`rows` as read, `n` of them evaluated after the over-long rule, from
        `source`): one log line naming it, the rows written to output_dir/eval_rows.jsonl (main rank), so
        that `rlhf.evaluate data.eval_path=<that file>` scores the same rows, and its summary.json fields:
        eval_source, eval_rows (n), eval_rows_file (None without held-out rows)."""
        logger.info(held_out_line(n, unit, source))
        path = os.path.join(self.out_dir, EVAL_ROWS)
        if self.info.is_main:
            if rows:
                os.makedirs(self.out_dir, exist_ok=True)
                write_rows(path, rows)
            elif os.path.exists(path):  # a previous run's, in the same output_dir
                os.remove(path)
        return {"eval_source": source, "eval_rows": n, "eval_rows_file": path if rows else None}

    # ------------------------------------------------------------------ start

    def begin(self, state: Checkpointable, total: int, evaluate: Callable[[], dict], eval_line: Callable[[dict], str],
              *, memory: Any = None, state_fn: Callable[[], dict] | None = None) -> None:
        """Resume `state` (train.resume) or start clean; open metrics.jsonl; save config.yaml; the
        "before" evaluation (step 0; on resume the one the checkpoint kept). `state_fn()`: what the
        stage adds to each checkpoint's extra_state (read back from `self.extra_state`)."""
        self.state, self.total, self.evaluate, self.eval_line = state, total, evaluate, eval_line
        self.memory, self.state_fn = memory, state_fn or dict
        path = self.resume_path
        if path:
            self.extra_state = state.load_checkpoint(path)
            self.start = int(self.extra_state["step"])
            if self._prelude is None:
                logger.info("resumed from %s at step %d", path, self.start)
            if self.info.is_main and (other := other_code(self.extra_state.get("run", {}))):
                logger.warning("resuming %s: %s", path, other)
            if changes := resume_changes(self.extra_state.get("run", {}), self.record):
                logger.warning("resuming %s with another setup than the run that saved it (the data position is "
                               "a step count: changed batch sizes re-cut the rows):\n  %s", path, "\n  ".join(changes))
            if self.info.is_main and os.path.exists(os.path.join(self.out_dir, "summary.json")):
                os.remove(os.path.join(self.out_dir, "summary.json"))  # unfinished again until this run ends
        self.log = RunLog(self.out_dir, self.cfg.logger, is_main=self.info.is_main, config_dict=self.record["config"],
                          resume_step=self.start if path else None, final=self.start == total)
        if self.info.is_main:
            save_config(self.out_dir, self.as_given)
        if self._prelude is not None:  # the chosen start's steps, as a run of its seed alone would have logged them
            records, samples = self._prelude
            for step, kind, values in records:
                self.log.log(step, kind, **values)
                if kind == "eval":
                    self.log.samples(step, samples.get(step, []))
        if path:
            self.before = self.extra_state["before"]
        else:
            self.before = without_samples(self._evaluate(0))
            logger.info("before training: %s", self.eval_line(self.before))

    @property
    def record(self) -> dict[str, Any]:
        """What each checkpoint keeps of the setup that wrote it (compared on resume)."""
        return {"world_size": self.info.world_size, "config_hash": config_hash(self.cfg), "config": flat_config(self.cfg),
                "code": provenance()}

    # ------------------------------------------------------------------ several starts

    def best_start(self, starts: Any, total: int, build: Callable[[int], Any], order_of: Callable[[int], Any],
                   evaluate: Callable[[Any], dict], accum: int, batch: Callable[[list[int]], dict], loss: Callable,
                   keys: Sequence[str], extra: Callable[[int], dict] | None = None) -> int:
        """The seed the run continues with (config `starts`: n, steps; rlhf/config/schema.py StartsConfig).
        With starts.n > 1 on a fresh run: start k (seed + 1000 x (k - 1)) is `build(seed_k)` (a new engine,
        after seed_everything(seed_k)), evaluated (`evaluate(engine)`: step 0), trained starts.steps steps on
        `order_of(seed_k)` as `loop` trains, and evaluated again; the best held-out `loss` so far is kept as
        a checkpoint at that step (one engine in memory at a time), the others are dropped. The chosen one's
        checkpoint becomes the run's (checkpoints/step_<steps>), `begin` continues it and logs its first
        steps, so the run equals the run `seed=<its seed>`; output_dir/starts.json lists every start.
        Resuming (train.resume), the seed the checkpoint was trained with."""
        seed, main = self.cfg.seed, self.info.is_main
        if self.resume_path is not None:
            return int(read_meta(self.resume_path)["extra_state"].get("start_seed", seed))
        # a fresh run: what a previous run left in output_dir (train.overwrite=true) is not this run's; with
        # several starts `begin` opens the log as a resume at the chosen start's step, which would keep it
        for name in (STARTS, METRICS, SAMPLES) if starts.n > 1 else (STARTS,):
            if main and os.path.exists(os.path.join(self.out_dir, name)):
                os.remove(os.path.join(self.out_dir, name))
        if starts.n == 1:
            return seed
        if not starts.steps < total:
            raise ConfigError(f"starts.steps={starts.steps}: each start trains that many steps before the comparison, "
                              f"so it must be fewer than the run's {total} steps")
        self.total = total
        scratch = os.path.join(self.out_dir, "starts")  # the best start so far; gone after the choice
        if main:
            shutil.rmtree(scratch, ignore_errors=True)
        found: list[dict[str, Any]] = []
        best: dict[str, Any] | None = None
        for k in range(starts.n):
            s = seed + 1000 * k
            seed_everything(s)
            engine, self._skips = build(s), 0
            before = evaluate(engine)
            if "loss" not in before:
                raise ConfigError(f"starts.n={starts.n} compares the starts by their held-out loss: this run has no "
                                  "held-out rows (set data.eval_path, or data.eval_size > 0)")
            records, order, meter = [(0, "eval", without_samples(before))], order_of(s), Throughput()
            bar = progress(starts.steps, 0, f"start {k + 1}/{starts.n} (seed {s})", main)
            for step in range(starts.steps):
                record = self._step(engine, order, step, accum, batch, loss, keys, meter, extra)
                if record is not None:
                    records.append((step + 1, "train", record))
                    bar.set_postfix(loss=format(record.get("loss", float("nan")), ".3f"))
                bar.update(1)
            bar.close()
            after = evaluate(engine)
            records.append((starts.steps, "eval", without_samples(after)))
            found.append({"seed": s, "eval_loss": after["loss"], "eval_loss_before": before["loss"],
                          **({"gold_score": after["gold_score"]} if "gold_score" in after else {})})
            logger.info("start %d/%d (seed %d): held-out loss %.4f after %d steps (%s)", k + 1, starts.n, s, after["loss"],
                        starts.steps, "the best so far" if best is None or after["loss"] < best["loss"] else
                        f"not better than seed {best['seed']}'s {best['loss']:.4f}")
            if best is None or after["loss"] < best["loss"]:
                path = os.path.join(scratch, f"seed_{s}")
                engine.save_checkpoint(path, {"step": starts.steps, "before": without_samples(before), "run": self.record,
                                              "start_seed": s})
                if best is not None and main:
                    shutil.rmtree(best["path"])
                best = {"seed": s, "loss": after["loss"], "path": path, "records": records,
                        "samples": {0: before.get("samples", []), starts.steps: after.get("samples", [])}}
            del engine
            gc.collect()
        self.resume_path = os.path.join(checkpoint_root(self.out_dir), f"step_{starts.steps:07d}")
        if main:
            os.makedirs(checkpoint_root(self.out_dir), exist_ok=True)
            os.replace(best["path"], self.resume_path)
            shutil.rmtree(scratch)
            with open(os.path.join(self.out_dir, STARTS + ".tmp"), "w") as f:
                json.dump({"steps": starts.steps, "chosen_seed": best["seed"], "starts": found}, f, indent=1)
            os.replace(os.path.join(self.out_dir, STARTS + ".tmp"), os.path.join(self.out_dir, STARTS))
        barrier()
        self._prelude = (best["records"], best["samples"])
        logger.info("starts: seed %d continues (held-out loss %.4f after %d steps; %s)", best["seed"], best["loss"],
                    starts.steps, ", ".join(f"seed {f['seed']}: {f['eval_loss']:.4f}" for f in found))
        return best["seed"]

    def starts_summary(self) -> dict[str, Any]:
        """summary.json's fields for several starts (output_dir/starts.json): the seed continued and every
        start's held-out loss at the comparison; {} for a run of one start."""
        path = os.path.join(self.out_dir, STARTS)
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            found = json.load(f)
        return {"start_seed": found["chosen_seed"], "starts": found["starts"]}

    # ------------------------------------------------------------------ the loop

    def steps(self) -> Iterator[int]:
        """0-based step indices from the resumed step to `total`; after each step (the loop body):
        the memory plan (first step), evaluation every train.eval_every, a checkpoint every
        train.save_every and at the end."""
        t = self.train
        self.bar = progress(self.total, self.start, self.name, self.info.is_main)
        for step in range(self.start, self.total):
            yield step
            done = step + 1
            self.bar.update(1)
            if done == self.start + 1 and self.memory is not None:
                logger.info("memory plan:\n%s", format_memory_report(self.memory.memory_report()))
            if t.eval_every and done % t.eval_every == 0 and done < self.total:
                self.bar.write(f"step {done}: {self.eval_line(self._evaluate(done))}")
            saves = bool(t.save_every) and (done % t.save_every == 0 or done == self.total)
            if saves or self.stop_reason:  # a stop saves first, so the run can be resumed or inspected
                self.save(done)
            if self.stop_reason:
                logger.warning("stopping after step %d of %d (checkpoint saved): %s", done, self.total,
                               self.stop_reason)
                self.total = done  # the final evaluation, export and summary follow as at the end
                break
        self.bar.close()

    def loop(self, engine: Any, order: Any, accum: int, batch: Callable[[list[int]], dict], loss: Callable,
              keys: Sequence[str], postfix: dict[str, tuple[str, str]], *,
              before_step: Callable[[int], None] | None = None,
              extra: Callable[[int], dict] | None = None,
              derive: Callable[[dict], dict] | None = None) -> dict[str, Any]:
        """The loop of a stage that trains one engine on rows (SFT, reward, DPO): each step, this rank's
        `accum` micro-batches of `order`'s rows (`batch(row indices)`), one `engine.train_step` with
        `loss`, the skip check; every log step a train record: `out[k]` for `keys`, tokens_per_s (the
        world's, since the last record), skipped_steps and `extra(step)`; the bar shows `postfix`
        ({name: (record key, format spec)}). `before_step(step)` runs first (reward's head-only phase);
        `derive(out)` adds figures computed from the step's averages (KTO's per-kind means) before `keys`
        are read. Returns the last record."""
        meter, last = Throughput(), {}
        for step in self.steps():
            if before_step is not None:
                before_step(step)
            record = self._step(engine, order, step, accum, batch, loss, keys, meter, extra, derive)
            if record is not None:
                last = record
                self.log_train(step, last, {name: format(last[k], spec) for name, (k, spec) in postfix.items()})
        return last

    def _step(self, engine: Any, order: Any, step: int, accum: int, batch: Callable[[list[int]], dict], loss: Callable,
              keys: Sequence[str], meter: Throughput, extra: Callable[[int], dict] | None = None,
              derive: Callable[[dict], dict] | None = None) -> dict[str, Any] | None:
        """One step of `loop`; the train record when the step logs one."""
        batches = [batch(rows) for rows in order.rank_rows(step, self.info.rank, self.info.world_size, accum)]
        meter.add(sum(batch_tokens(b) for b in batches))
        out = engine.train_step(batches, loss)
        self.check(out)
        if not self.logs(step):
            return None
        out = derive(out) if derive is not None else out
        return {**{k: out[k] for k in keys}, "tokens_per_s": meter.rate(), "skipped_steps": engine.skipped_steps,
                **(extra(step) if extra else {})}

    def save(self, done: int) -> str:
        """A checkpoint of the state after `done` steps (collective), the oldest pruned; returns its path. The
        loop saves by train.save_every; a stage calls it when a step cannot finish (PPO's reward server
        down), so that train.resume=true redoes that step."""
        path = os.path.join(checkpoint_root(self.out_dir), f"step_{done:07d}")
        self.state.save_checkpoint(path, {"step": done, "before": self.before, "run": self.record, **self.state_fn()})
        if self.info.is_main:
            prune_checkpoints(checkpoint_root(self.out_dir), self.train.keep_last_n)
        return path

    def stop(self, reason: str) -> None:
        """End the loop cleanly after the current step (called from the loop body or an evaluation):
        a checkpoint, then the final evaluation, export and summary as after the last step. Every rank
        must call it at the same step (decide on all-reduced figures)."""
        self.stop_reason = self.stop_reason or reason

    def logs(self, step: int) -> bool:
        """Whether 0-based `step` writes a train record (every train.log_every steps and the last)."""
        done = step + 1
        return done % self.train.log_every == 0 or done == self.total

    def log_train(self, step: int, record: dict[str, Any], postfix: dict[str, str]) -> None:
        self.log.log(step + 1, "train", **record)
        self.bar.set_postfix(**postfix)

    def check(self, *outs: dict) -> None:
        """Counts a step as skipped when any engine step of it (`outs`: e.g. PPO's actor and critic)
        was skipped: a non-finite loss or gradient, or nothing to learn from (a loss weight of 0);
        train.max_consecutive_skips in a row raise TrainingError."""
        skipped = [o for o in outs if o["skipped"]]
        self._skips = self._skips + 1 if skipped else 0
        if self._skips >= self.train.max_consecutive_skips:
            last = skipped[0]
            why = ("had nothing to train on (a total loss weight of 0: every target masked or every response "
                   "empty); check the data and the over-long rule" if last.get("empty") else
                   f"had a non-finite loss or gradient (last loss {last['loss']}); lower the learning rate, check "
                   "the data, or use engine.precision=fp32")
            raise TrainingError(f"{self._skips} consecutive steps {why}")

    # ------------------------------------------------------------------ the end

    def evaluate_after(self) -> dict[str, Any]:
        if self._last_eval is not None and self._last_eval[0] == self.total:  # a stop right after an evaluation
            return self._last_eval[1]
        return self._evaluate(self.total)

    def finish(self, summary: dict[str, Any], model_dir: str, plot: Plot, samples: Sequence[dict] = ()) -> dict:
        """(main rank) `<name>.png`, summary.json = stage, time_s, compile_s (with engine.compile), steps,
        `summary`, model_dir; the samples and the summary printed last. Returns the summary (empty on
        other ranks)."""
        out: dict[str, Any] = {}
        if self.info.is_main:
            train, ev = read_metrics(self.out_dir, "train"), read_metrics(self.out_dir, "eval")
            rows = {"train": train, "eval": ev}
            plot_series(os.path.join(self.out_dir, f"{self.name}.png"), self.title,
                        [(ylabel, [(label, *series(rows[kind], key)) for label, kind, key in lines])
                         for ylabel, lines in plot])
            out = {"stage": self.name, "time_s": round(time.time() - self.t_start, 1)}
            if self.cfg.engine.compile:  # spent within time_s, reported apart
                out["compile_s"] = round(compile_seconds(), 1)
            out.update(steps=self.total, **summary, model_dir=model_dir)
            write_summary(self.out_dir, out)
            for s in samples[:3]:  # every one is in samples.jsonl; without a gold judge only the sampled response
                response = s.get("response", s.get("sampled_response"))
                gold = f" (gold {s['gold']})" if "gold" in s else ""
                print(f"  sample: {s['prompt']!r} -> {response!r}{gold}")
            print(f"{self.title} done ({self.out_dir}):\n{format_summary(out)}", flush=True)
            sys.stdout.flush()
        self.log.finish()
        return out

    def _evaluate(self, step: int) -> dict[str, Any]:
        ev = self.evaluate()
        self.log.log(step, "eval", **without_samples(ev))
        self.log.samples(step, ev.get("samples", []))
        self._last_eval = (step, ev)
        return ev
