"""logger=wandb|tensorboard|mlflow|trackio|csv: each logger's own files, read back, hold the scalars of
metrics.jsonl at the same steps and each evaluation's samples (samples.jsonl); a missing library is a
ConfigError naming the pip extra; DeepSpeed's monitor blocks in tests/test_ds_config.py. The run
explorer (`python -m rlhf.report`) over the same run: its data, and in headless Chromium where one is
installed."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import sqlite3
import struct
import subprocess
import sys

import pytest

from conftest import ROOT, SMALL_MODEL, cli_env, metrics, run_stage

from rlhf.config import LoggerConfig
from rlhf.config.validate import LOGGER_LIBRARIES, validate_logger
from rlhf.core.errors import ConfigError
from rlhf.report import main as report_main
from rlhf.run.explorer import config_diff, curves, find_runs, fired_alarms, load_run, page_data
from rlhf.run.loggers import markdown_table, mlflow_file_name, scalar_values
from rlhf.run.runlog import TIES, RunLog, make_figure, read_samples, series

INSTALLED = [n for n, (module, _) in LOGGER_LIBRARIES.items() if module is None or importlib.util.find_spec(module)]
EVAL_STEPS = [0, 1, 2]


def needs(name: str):
    module, extra = LOGGER_LIBRARIES[name]
    return pytest.mark.skipif(name not in INSTALLED, reason=f"{module} not installed (pip install -e '.[{extra}]')")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One SFT run of 2 steps, evaluated at 0, 1, 2 on 4 prompts, with every installed logger on."""
    root = tmp_path_factory.mktemp("loggers")
    out = root / "sft"
    run_stage("sft", f"output_dir={out}", *SMALL_MODEL, "train.max_steps=2", "train.eval_every=1", "train.log_every=1",
              "train.save_every=0", "data.num_eval_prompts=4", f"logger=[{','.join(INSTALLED)}]",
              env={"WANDB_MODE": "offline", "TRACKIO_DIR": str(root / "trackio")})
    return out


def expected(run_dir) -> dict[tuple[str, int], float]:
    """{(logger name, step): value} of every scalar in metrics.jsonl."""
    return {(name, r["step"]): v for r in metrics(run_dir) for name, v in scalar_values(r).items()}


def assert_same(got: dict[tuple[str, int], float], want: dict[tuple[str, int], float], what: str, rel: float = 1e-12):
    assert set(got) == set(want), f"{what}: names/steps differ: missing {sorted(set(want) - set(got))[:5]}, " \
                                  f"extra {sorted(set(got) - set(want))[:5]}"
    bad = [(k, got[k], want[k]) for k in want if got[k] != pytest.approx(want[k], rel=rel, abs=1e-30)]
    assert not bad, f"{what}: values differ from metrics.jsonl: {bad[:5]}"


def samples_by_step(run_dir) -> dict[int, list[dict]]:
    return {s: [{k: v for k, v in r.items() if k != "step"} for r in read_samples(str(run_dir), s)] for s in EVAL_STEPS}


# ----------------------------------------------------------------------------- metrics.jsonl and samples.jsonl


def test_samples_jsonl_holds_every_evaluation_and_agrees_with_its_gold_score(run_dir):
    evals = {r["step"]: r for r in metrics(run_dir, "eval")}
    assert sorted(evals) == EVAL_STEPS
    for step, rows in samples_by_step(run_dir).items():
        assert len(rows) == 4 and all(set(r) == {"task", "prompt", "response", "gold", "length"} for r in rows)
        assert all(r["length"] == len(r["response"]) and r["gold"] in (0.0, 1.0) for r in rows)
        assert 100 * sum(r["gold"] for r in rows) / 4 == pytest.approx(evals[step]["gold_score"])
        assert sum(r["length"] for r in rows) / 4 == pytest.approx(evals[step]["response_len"])


# ----------------------------------------------------------------------------- each logger read back


def tfrecords(path: str) -> list[bytes]:
    """The records of a TFRecord file (TensorBoard's event files): u64 length, u32 crc, data, u32 crc."""
    with open(path, "rb") as f:
        data = f.read()
    out, i = [], 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i : i + 8])
        out.append(data[i + 12 : i + 12 + n])
        i += 12 + n + 4
    return out


@needs("tensorboard")
def test_tensorboard_event_files(run_dir):
    from tensorboardX.proto import event_pb2

    scalars, texts = {}, {}
    for path in glob.glob(str(run_dir / "tensorboard" / "events.out.tfevents.*")):
        for rec in tfrecords(path):
            ev = event_pb2.Event()
            ev.ParseFromString(rec)
            for v in ev.summary.value:
                if v.HasField("simple_value"):
                    scalars[(v.tag, ev.step)] = v.simple_value
                elif v.HasField("tensor"):
                    texts[(v.tag, ev.step)] = v.tensor.string_val[0].decode()
    assert_same(scalars, expected(run_dir), "TensorBoard", rel=1e-6)  # event files hold float32
    for step, rows in samples_by_step(run_dir).items():
        columns = list(rows[0])
        assert texts[("eval/samples/text_summary", step)] == markdown_table(columns, [list(r.values()) for r in rows])


@needs("mlflow")
def test_mlflow_file_store(run_dir):
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient("file://" + str(run_dir / "mlruns"))
    (run,) = client.search_runs([client.get_experiment_by_name("rlhf").experiment_id])
    want = expected(run_dir)
    got = {(name, m.step): m.value for name in {k for k, _ in want}
           for m in client.get_metric_history(run.info.run_id, mlflow_file_name(name))}
    assert_same(got, want, "MLflow")
    assert run.data.params["train.max_steps"] == "2" and run.data.params["logger.mlflow"] == "True"
    for step, rows in samples_by_step(run_dir).items():
        path = glob.glob(str(run_dir / "mlruns" / "*" / run.info.run_id / "artifacts" / "samples" / f"step_{step:07d}.json"))
        with open(path[0]) as f:
            table = json.load(f)
        assert [dict(zip(table["columns"], r)) for r in table["data"]] == rows


@needs("trackio")
def test_trackio_local_store(run_dir):
    con = sqlite3.connect(run_dir.parent / "trackio" / "rlhf.db")
    got, tables = {}, {}
    for step, blob in con.execute("select step, metrics from metrics order by id"):
        for k, v in json.loads(blob).items():
            if isinstance(v, dict):
                tables[(k, step)] = v["_value"]
            else:
                got[(k, step)] = v
    assert_same(got, expected(run_dir), "trackio")
    assert {step: tables[("eval/samples", step)] for step in EVAL_STEPS} == samples_by_step(run_dir)


def wandb_records(path: str) -> list[bytes]:
    """The records of a .wandb file: a 7-byte header, then LevelDB's log format (32 KiB blocks of chunks:
    u32 crc, u16 length, u8 type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    out, pos, buf, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            out.append(buf)
    return out


@needs("wandb")
def test_wandb_offline_files(run_dir):
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    got, tables = {}, {}
    for data in wandb_records(path):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") != "history":
            continue
        items = {it.key or "/".join(it.nested_key): json.loads(it.value_json) for it in rec.history.item}
        step = items["_step"]
        got.update({(k, step): v for k, v in items.items() if not k.startswith(("_", "eval/samples/"))})
        if "eval/samples/path" in items:
            tables[step] = items["eval/samples/path"]
    assert_same(got, expected(run_dir), "W&B")
    for step, rows in samples_by_step(run_dir).items():
        with open(os.path.join(os.path.dirname(path), "files", tables[step])) as f:
            table = json.load(f)
        assert [dict(zip(table["columns"], r)) for r in table["data"]] == rows


def test_csv_monitor_files(run_dir):
    got = {}
    for path in glob.glob(str(run_dir / "csv" / "*.csv")):
        with open(path) as f:
            header, *rows = [line.strip().split(",") for line in f if line.strip()]
        assert header[0] == "step" and os.path.basename(path) == header[1].replace("/", "_") + ".csv"
        got.update({(header[1], int(s)): float(v) for s, v in rows})
    assert_same(got, expected(run_dir), "CSV")


# ----------------------------------------------------------------------------- config, resume, plots


def test_a_missing_library_names_its_pip_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboardX" else real(name, *a))
    with pytest.raises(ConfigError, match=re.escape('logger.tensorboard=true (logger=tensorboard) needs the tensorboardX '
                                                    'package, which is not installed: pip install -e ".[tensorboard]"')):
        validate_logger(LoggerConfig(tensorboard=True))
    validate_logger(LoggerConfig(csv=True))  # no library
    with pytest.raises(ConfigError, match="logger.mlflow must be true or false, got 'yes'"):
        validate_logger(LoggerConfig(mlflow="yes"))
    with pytest.raises(ConfigError, match="logger.mode must be online, offline or disabled, got 'on'"):
        validate_logger(LoggerConfig(wandb=True, mode="on"))


def test_logger_list_on_the_command_line_turns_each_on():
    proc = subprocess.run([sys.executable, "-m", "rlhf.sft", "logger=[tensorboard,csv]", "--cfg", "job"], cwd=ROOT,
                          env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    block = proc.stdout.split("\nlogger:\n")[1]
    flags = dict(re.findall(r"^  (wandb|tensorboard|mlflow|trackio|csv): (\w+)$", block, re.M))
    assert flags == {"wandb": "false", "tensorboard": "true", "mlflow": "false", "trackio": "false", "csv": "true"}


def test_resume_drops_the_samples_after_the_resumed_step(tmp_path):
    log = RunLog(str(tmp_path), LoggerConfig(), is_main=True)
    for step in (0, 2, 4):
        log.log(step, "eval", gold_score=float(step))
        log.samples(step, [{"prompt": "p", "response": f"r{step}"}])
    RunLog(str(tmp_path), LoggerConfig(), is_main=True, resume_step=2)  # keeps step 2's evaluation
    assert [r["response"] for r in read_samples(str(tmp_path))] == ["r0", "r2"]
    RunLog(str(tmp_path), LoggerConfig(), is_main=True, resume_step=2, final=True)  # the last step evaluates again
    assert [r["response"] for r in read_samples(str(tmp_path))] == ["r0"]


def test_an_accuracy_whose_pairs_all_tie_is_plotted_as_ties():
    rows = [{"step": 0, "accuracy": 0.0, "ties": 1.0}, {"step": 5, "accuracy": 0.0, "ties": 0.5},
            {"step": 10, "accuracy": 0.75, "ties": 0.0}]
    assert series(rows, "accuracy") == ([0, 5, 10], [TIES, 0.0, 0.75])  # 0.0 with half the pairs tied stays 0.0
    assert series(rows, "ties") == ([0, 5, 10], [1.0, 0.5, 0.0])
    fig = make_figure("reward", [("pair accuracy", [("held-out", *series(rows, "accuracy"))])])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.texts] == ["ties"] and ax.texts[0].xy == (0, 0.5)
    assert list(ax.lines[0].get_xdata()) == [5, 10] and ax.get_xlim()[0] <= -0.5


# ----------------------------------------------------------------------------- the run explorer


@pytest.fixture(scope="module")
def two_runs(run_dir, tmp_path_factory):
    """The logged run and a copy whose config says another learning rate: two runs under one sweep dir."""
    root = tmp_path_factory.mktemp("sweep")
    for name in ("a", "b"):
        shutil.copytree(run_dir, root / name / "sft", ignore=shutil.ignore_patterns("model", "wandb", "mlruns"))
    cfg = root / "b" / "sft" / "config.yaml"
    cfg.write_text(re.sub(r"(?m)^  lr: .*$", "  lr: 0.5", cfg.read_text(), count=1))
    return root


def test_explorer_data_is_the_runs_files(two_runs):
    dirs = find_runs([str(two_runs)])
    assert dirs == [str(two_runs / "a" / "sft"), str(two_runs / "b" / "sft")]
    runs = [load_run(d, n) for d, n in zip(dirs, ["a/sft", "b/sft"])]
    data = page_data(runs)
    want = metrics(dirs[0])
    for chart in data["charts"]:
        kind, key = chart["name"].split("/", 1)
        rows = [r for r in want if r["kind"] == kind and isinstance(r.get(key), (int, float))]
        for name in ("a/sft", "b/sft"):
            assert chart["runs"][name]["x"] == [r["step"] for r in rows]
            assert chart["runs"][name]["y"] == [r[key] for r in rows]
    assert {c["name"] for c in data["charts"]} == {n for r in want for n in scalar_values(r)}
    assert data["runs"][1]["config_diff"] == [["train.lr", runs[0].config["train.lr"], 0.5]]
    assert [r["samples"] for r in data["runs"]] == [read_samples(dirs[0])] * 2


def test_explorer_curves_log_scale_ties_and_alarms():
    class R:  # what curves() reads of a run
        def __init__(self, name, metrics):
            self.name, self.metrics = name, metrics
    runs = [R("x", [{"step": 0, "kind": "eval", "accuracy": 0.0, "ties": 1.0, "loss": 5.0},
                    {"step": 1, "kind": "eval", "accuracy": 0.5, "ties": 0.0, "loss": 0.01}])]
    charts = {c["name"]: c for c in curves(runs)}
    assert charts["eval/loss"]["log"] is True and charts["eval/accuracy"]["log"] is False  # 500x vs a zero
    assert charts["eval/accuracy"]["runs"]["x"]["ties"] == [0] and charts["eval/loss"]["runs"]["x"]["ties"] == []
    rows = [{"step": 10, "alarm_kl": 0, "alarm_kl_slope": 0.1}, {"step": 20, "alarm_kl": 1, "alarm_kl_slope": 0.9},
            {"step": 30, "alarm_kl": 1, "alarm_kl_slope": 1.2}]
    assert fired_alarms(rows) == [{"name": "kl", "step": 20, "records": 2, "figures": {"slope": 0.9}}]
    assert config_diff({"a": 1, "b": 2}, {"a": 1, "c": 3}) == [["b", 2, "(absent)"], ["c", "(absent)", 3]]


EXTERNAL = re.compile(r"""<(?:script|link|img|iframe)[^>]+(?:src|href)\s*=\s*["']?(?:https?:)?//""", re.I)


def test_report_command_writes_one_self_contained_page(two_runs, tmp_path, capsys):
    out = tmp_path / "explorer.html"
    report_main([str(two_runs), "--out", str(out)])  # python -m rlhf.report, in this process
    assert "2 run(s): a/sft, b/sft" in capsys.readouterr().out
    page = out.read_text()
    assert not EXTERNAL.search(page), EXTERNAL.search(page).group(0)
    assert "<script src" not in page and "<link" not in page  # every script inline, no stylesheet fetched
    data = json.loads(re.search(r'<script type="application/json" id="explorer-data">(.*?)</script>', page, re.S)
                      .group(1).replace("<\\/", "</"))
    assert [r["name"] for r in data["runs"]] == ["a/sft", "b/sft"]
    assert data == json.loads(json.dumps(page_data([load_run(str(two_runs / n / "sft"), f"{n}/sft") for n in "ab"])))
    with pytest.raises(SystemExit) as e:
        report_main([str(tmp_path / "nothing")])
    assert e.value.code == 2 and "nothing: no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        report_main([str(tmp_path / "empty")])
    assert "empty: no run in it (no metrics.jsonl at or under it)" in capsys.readouterr().err


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None or importlib.util.find_spec("playwright") is None,
                    reason="needs Chromium (apt-get install chromium) and playwright (pip install -e '.[browser]')")
def test_explorer_in_headless_chromium(two_runs, tmp_path):
    from playwright.sync_api import sync_playwright

    out = tmp_path / "explorer.html"
    subprocess.run([sys.executable, "-m", "rlhf.report", str(two_runs), "--out", str(out)], cwd=ROOT, env=cli_env(),
                   check=True, capture_output=True, timeout=300)
    url = out.as_uri()
    errors, requests = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(url)
        page.wait_for_function("window.EXPLORER && document.querySelectorAll('.js-plotly-plot').length > 0")
        charts = page.evaluate("window.EXPLORER.charts")
        n_plots = page.evaluate("document.querySelectorAll('.js-plotly-plot').length")
        # the samples browser at step 1: its 4 prompts, each run's response
        page.evaluate("s => { const el = document.getElementById('samples-step'); "
                      "el.value = window.EXPLORER.steps.indexOf(s); el.dispatchEvent(new Event('input')); }", 1)
        shown = page.eval_on_selector_all("#samples-grid tr.prompt-row", "rows => rows.map(r => r.dataset.prompt)")
        cells = page.eval_on_selector_all("#samples-grid tr.prompt-row td:nth-child(2) .resp",
                                          "els => els.map(e => e.textContent)")
        page.fill("#samples-filter", "zzz-no-such-text")
        filtered = page.eval_on_selector_all("#samples-grid tr.prompt-row", "rows => rows.length")
        if os.environ.get("EXPLORER_SCREENSHOT"):  # the docs' screenshot (docs/looking-at-runs.md)
            page.fill("#samples-filter", "")
            page.screenshot(path=os.environ["EXPLORER_SCREENSHOT"], full_page=False)
        browser.close()
    assert errors == [], errors
    assert requests == [url], f"the page fetched more than itself: {requests}"
    want = metrics(two_runs / "a" / "sft")
    assert n_plots == len(charts) == len({n for r in want for n in scalar_values(r)})
    for name, traces in charts.items():
        kind, key = name.split("/", 1)
        rows = [r for r in want if r["kind"] == kind and isinstance(r.get(key), (int, float))]
        assert [t["run"] for t in traces] == ["a/sft", "b/sft"]
        assert all(t["x"] == [r["step"] for r in rows] and t["y"] == [r[key] for r in rows] for t in traces)
    step1 = read_samples(str(two_runs / "a" / "sft"), 1)
    assert shown == [s["prompt"] for s in step1] and cells == [s["response"] for s in step1]
    assert filtered == 0
