"""The loggers a run writes to besides metrics.jsonl: W&B, TensorBoard, MLflow, trackio, CSV.

    logger=tensorboard                 # conf/logger/<name>.yaml turns on logger.<name>
    logger=[tensorboard,wandb,mlflow]  # several at once

Each goes through its own library, imported here only when turned on, on the main rank. Every one
gets the same scalars under the same names and steps as metrics.jsonl: a record {"step": s, "kind": k,
"x": v} is the scalar `k/x` at step s (numbers only: a NaN JSON writes as a string is left out). The
held-out samples of each evaluation (`RunLog.samples`) go to each logger's table or text view:

    wandb        wandb.Table under eval/samples            (offline by default: output_dir/wandb)
    tensorboard  add_scalar; a markdown table, add_text    (logger.tensorboard_dir, else output_dir/tensorboard)
    mlflow       log_batch; log_table samples/step_N.json  (logger.mlflow_tracking_uri, MLFLOW_TRACKING_URI, else
                                                            the file store output_dir/mlruns; in a file store
                                                            `eval/gold_score/add` is `eval/gold_score.add`)
    trackio      trackio.log; trackio.Table                (trackio's local store: TRACKIO_DIR)
    csv          <kind>_<name>.csv: step,value per scalar  (logger.csv_dir, else output_dir/csv; DeepSpeed's
                                                            csv_monitor layout)
"""
from __future__ import annotations

import csv
import importlib
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

from rlhf.config import LoggerConfig
from rlhf.config.validate import enabled_loggers

SAMPLES_TABLE = "eval/samples"


class Sink(Protocol):
    def scalars(self, step: int, values: dict[str, float]) -> None: ...
    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None: ...
    def finish(self) -> None: ...


def scalar_values(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record's scalars under the loggers' names: `kind/key` for every number but the step."""
    kind = record.get("kind", "train")
    return {f"{kind}/{k}": float(v) for k, v in record.items()
            if k not in ("step", "kind") and isinstance(v, (int, float))}


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    """A markdown table (TensorBoard's text view renders it); `|` and newlines escaped in cells."""
    def cell(v: Any) -> str:
        return "" if v is None else str(v).replace("|", "\\|").replace("\n", "\\n")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows])


class RunSink:
    """W&B and trackio: one API (`init(config=..., **options)` opens the current run, `log(values, step=)`,
    `Table(columns=, data=)`, `finish()`), so one sink over the library's module, named in SINKS with the
    options its `init` gets (RUN_OPTIONS)."""

    def __init__(self, module: str, cfg: LoggerConfig, output_dir: str, config: dict[str, Any]):
        self.lib = importlib.import_module(module)
        self.lib.init(config=config, **RUN_OPTIONS[module](cfg, output_dir))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.lib.log(values, step=step)

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.lib.log({SAMPLES_TABLE: self.lib.Table(columns=columns, data=rows)}, step=step)

    def finish(self) -> None:
        self.lib.finish()


RUN_OPTIONS: dict[str, Callable[[LoggerConfig, str], dict[str, Any]]] = {
    # offline by default (logger.mode): the run's files under output_dir/wandb; a resumed run continues it
    "wandb": lambda cfg, output_dir: dict(project=cfg.project, entity=cfg.entity, name=cfg.name, mode=cfg.mode,
                                          dir=output_dir, resume="allow"),
    # trackio's local store (TRACKIO_DIR); embed=False: no dashboard opened from a training run
    "trackio": lambda cfg, output_dir: dict(project=cfg.project, name=cfg.name, embed=False),
}


class TensorBoardSink:
    def __init__(self, cfg: LoggerConfig, output_dir: str, config: dict[str, Any]):
        from tensorboardX import SummaryWriter

        self.dir = cfg.tensorboard_dir or os.path.join(output_dir, "tensorboard")
        self.writer = SummaryWriter(logdir=self.dir)
        self.writer.add_text("config", markdown_table(["key", "value"], [[k, v] for k, v in config.items()]), 0)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.writer.add_text(SAMPLES_TABLE, markdown_table(columns, rows), step)

    def finish(self) -> None:
        self.writer.close()


def mlflow_uri(cfg: LoggerConfig, output_dir: str) -> str:
    """logger.mlflow_tracking_uri, else MLFLOW_TRACKING_URI, else the file store <output_dir>/mlruns."""
    return (cfg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            or "file://" + os.path.abspath(os.path.join(output_dir, "mlruns")))


def mlflow_file_name(name: str) -> str:
    """A scalar's name in an MLflow file store: `kind/` then the rest with "/" as "." (the file store keeps a
    metric as a file at its name's path, so `eval/gold_score` and `eval/gold_score/shift` could not both exist)."""
    kind, _, rest = name.partition("/")
    return f"{kind}/{rest.replace('/', '.')}" if rest else name


class MLflowSink:
    def __init__(self, cfg: LoggerConfig, output_dir: str, config: dict[str, Any]):
        self.uri = mlflow_uri(cfg, output_dir)
        self.file_store = self.uri.startswith("file:") or "://" not in self.uri
        if self.file_store:
            # NOTE: MLflow 3 refuses its file store unless asked for it; a file store is what a local run wants
            # (mlflow-skinny has no SQLAlchemy for the sqlite store)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric, self.client = Metric, MlflowClient(self.uri)
        exp = self.client.get_experiment_by_name(cfg.project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(cfg.project)
        self.run_id = self.client.create_run(exp_id, run_name=cfg.name).info.run_id
        params = [Param(k[:250], str(v)[:6000]) for k, v in config.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def scalars(self, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.Metric(mlflow_file_name(k) if self.file_store else k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        data = {c: [r[i] for r in rows] for i, c in enumerate(columns)}
        self.client.log_table(self.run_id, data=data, artifact_file=f"samples/step_{step:07d}.json")

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


class CsvSink:
    """DeepSpeed's csv_monitor layout: one file per scalar, `step,<name>` rows, appended as the run goes."""

    def __init__(self, cfg: LoggerConfig, output_dir: str, config: dict[str, Any]):
        self.dir = cfg.csv_dir or os.path.join(output_dir, "csv")
        os.makedirs(self.dir, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name.replace("/", "_") + ".csv")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            path = self.path(k)
            new = not os.path.exists(path)
            with open(path, "a", newline="") as f:
                w = csv.writer(f)
                if new:
                    w.writerow(["step", k])
                w.writerow([step, v])

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        pass  # the samples are in output_dir/samples.jsonl; a CSV monitor holds scalars only

    def finish(self) -> None:
        pass


SINKS = {"wandb": partial(RunSink, "wandb"), "tensorboard": TensorBoardSink, "mlflow": MLflowSink,
         "trackio": partial(RunSink, "trackio"), "csv": CsvSink}


def open_sinks(cfg: LoggerConfig, output_dir: str, config: dict[str, Any]) -> list[Sink]:
    """The loggers `cfg` turns on (validate_logger has checked their libraries are installed), opened."""
    return [SINKS[name](cfg, output_dir, config) for name in enabled_loggers(cfg)]


def table_of(samples: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Sample records -> (columns in first-seen order, rows; None where a sample lacks a column)."""
    columns: list[str] = []
    for s in samples:
        columns += [k for k in s if k not in columns]
    return columns, [[s.get(c) for c in columns] for s in samples]
