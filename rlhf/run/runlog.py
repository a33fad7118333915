"""What a run leaves behind besides its model: metrics.jsonl, samples.jsonl, PNG plots, summary.json,
and what the loggers of `logger=...` write (rlhf/run/loggers.py: W&B, TensorBoard, MLflow, trackio, CSV).

Only the main rank writes. `metrics.jsonl` holds one JSON object per record with `step` and
`kind` ("train", "eval", ...); `samples.jsonl` one per held-out sample of each evaluation, with its
`step`. On resume the records after the restored step are dropped from both so the files read as
one uninterrupted run. wandb runs offline unless `logger.mode=online`, and with
`logger.mode=disabled` it is never imported.
"""
from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

from rlhf.config import LoggerConfig
from rlhf.core.provenance import provenance
from rlhf.run.loggers import open_sinks, scalar_values, table_of

logger = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"
SUMMARY = "summary.json"


def _clean(v: Any) -> Any:
    """JSON-safe scalars: tensors -> numbers, NaN/inf -> strings (JSON has no NaN)."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class RunLog:
    def __init__(self, output_dir: str, cfg: LoggerConfig, *, is_main: bool, config_dict: dict | None = None,
                 resume_step: int | None = None, final: bool = False):
        self.output_dir, self.is_main = output_dir, is_main
        self.path = os.path.join(output_dir, METRICS)
        self.samples_path = os.path.join(output_dir, SAMPLES)
        self.sinks: list = []
        if not is_main:
            return
        os.makedirs(output_dir, exist_ok=True)
        if resume_step is None:
            open(self.path, "w").close()
            open(self.samples_path, "w").close()
        else:
            self._truncate_after(resume_step, final)
        self.sinks = open_sinks(cfg, output_dir, config_dict or {})

    def _truncate_after(self, step: int, final: bool) -> None:
        """Records after `step` dropped (and, `final`: a resume of the last step, which evaluates again,
        its "after" evaluation too); the samples of the evaluations dropped with them."""
        kept = [r for r in read_metrics(self.output_dir) if r.get("step", 0) < step
                or (r.get("step", 0) == step and not (final and r.get("kind") == "eval"))]
        with open(self.path, "w") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        last = step - 1 if final else step
        kept_samples = [r for r in read_samples(self.output_dir) if r.get("step", 0) <= last]
        with open(self.samples_path, "w") as f:
            for r in kept_samples:
                f.write(json.dumps(r) + "\n")

    def log(self, step: int, kind: str, **values: Any) -> None:
        if not self.is_main:
            return
        record = {"step": step, "kind": kind, **{k: _clean(v) for k, v in values.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = scalar_values(record)
        for sink in self.sinks:
            sink.scalars(step, scalars)

    def samples(self, step: int, samples: Sequence[dict[str, Any]]) -> None:
        """An evaluation's held-out samples (prompt, response, gold, ...): appended to samples.jsonl with
        their step, and each logger's table of step `step`."""
        if not self.is_main or not samples:
            return
        rows = [{k: _clean(v) for k, v in s.items()} for s in samples]
        with open(self.samples_path, "a") as f:
            for r in rows:
                f.write(json.dumps({"step": step, **r}) + "\n")
        columns, table = table_of(rows)
        for sink in self.sinks:
            sink.table(step, columns, table)

    def finish(self) -> None:
        for sink in self.sinks:
            sink.finish()
        self.sinks = []


def read_samples(output_dir: str, step: int | None = None) -> list[dict]:
    """samples.jsonl's records (of evaluation `step`, or all)."""
    return [r for r in read_jsonl(os.path.join(output_dir, SAMPLES)) if step is None or r.get("step") == step]


def read_metrics(output_dir: str, kind: str | None = None) -> list[dict]:
    return [r for r in read_jsonl(os.path.join(output_dir, METRICS)) if kind is None or r.get("kind") == kind]


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSONL file a run appends to ([] when it is absent): a cut last line (a run killed
    while appending) is left out, any other bad line is an error naming it."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ValueError(f"{path}:{i + 1}: not a JSON record (the file is corrupt)") from None
            # NOTE: a run killed while appending leaves a cut last line: it was never a record
    return rows


def write_summary(output_dir: str, summary: dict) -> str:
    """summary.json (atomically: temp file + rename), ending with the code that made it (`version`, and
    `commit` from a checkout: rlhf/core/provenance.py); returns its path."""
    path = os.path.join(output_dir, SUMMARY)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({k: _clean(v) for k, v in {**summary, **provenance()}.items()}, f, indent=1)
    os.replace(tmp, path)
    return path


def format_summary(summary: dict) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    width = max(len(k) for k in summary)
    return "\n".join(f"  {k:<{width}}  {fmt(v)}" for k, v in summary.items())


TIES = "ties"  # a value `series` gives where every pair tied: drawn as a label, not a point
Panel = tuple  # (ylabel, [(label, xs, ys), ...]) or (ylabel, [...], xlabel); xlabel defaults to "step"


def make_figure(title: str, panels: Sequence[Panel], *, ncols: int = 1, sharex: bool = True):
    """A matplotlib Figure with one panel per (ylabel, series[, xlabel]), filled row by row over `ncols`
    columns; empty series and panels are skipped (None if nothing is left).

    Every panel gets its own x label and tick labels (no guessing which axis a panel uses); x ticks are
    integers, since steps are. With `sharex` all panels share one x range (one run's steps); the
    pipeline figure turns it off because its columns are different stages.
    """
    panels = [(p[0], [s for s in p[1] if s[1]], p[2] if len(p) > 2 else "step") for p in panels]
    panels = [p for p in panels if p[1]]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ncols = min(ncols, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols if ncols > 1 else 7, 2.8 * nrows), squeeze=False,
                             sharex=sharex)
    flat = list(axes.flat)
    for ax, (ylabel, series_, xlabel) in zip(flat, panels):
        for label, xs, ys in series_:
            pts = [(x, y) for x, y in zip(xs, ys) if not isinstance(y, str)]
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label,
                           marker="o" if len(xs) < 20 else None, markersize=3)[0]
            for x, y in zip(xs, ys):
                if isinstance(y, str):  # a value with no place on the axis (TIES): its name at that step
                    lo, hi = ax.get_xlim()
                    ax.set_xlim(min(lo, x - 0.5), max(hi, x + 0.5))
                    ax.annotate(y, (x, 0.5), xycoords=("data", "axes fraction"), ha="center", fontsize=8,
                                color=line.get_color())
        ax.set_ylabel(ylabel)
        ax.set_xlabel(xlabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelbottom=True)  # sharex hides inner panels' tick labels by default
        ax.grid(alpha=0.3)
        if len(series_) > 1 or series_[0][0]:
            ax.legend(fontsize=8)
    for ax in flat[len(panels):]:
        ax.remove()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_series(path: str, title: str, panels: Sequence[Panel], *, ncols: int = 1, sharex: bool = True) -> str | None:
    """`make_figure(...)` saved as a PNG at `path`; returns the path (None when there was nothing to plot)."""
    fig = make_figure(title, panels, ncols=ncols, sharex=sharex)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def series(rows: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) of `key` in `rows`. A pair accuracy of a record whose pairs all tied (`ties` == 1: a
    reward model's zero head at step 0 scores every response alike) is "ties", not the 0.0 it computes to:
    the plots write "ties" there instead of a point."""
    pts = [(r["step"], TIES if key.split("/")[0] == "accuracy" and r.get("ties") == 1 else r[key])
           for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]
