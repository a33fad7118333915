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
from rlhf.run.explorer import (
    KEY_METRICS, config_diff, curves, find_runs, fired_alarms, load_run, page_data, summary_rows,
)
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


class R:  # what curves() and summary_rows() read of a run
    def __init__(self, name, metrics, summary=None, path="/runs/x"):
        self.name, self.metrics, self.summary, self.path = name, metrics, summary or {}, path


def test_explorer_curves_log_scale_ties_and_alarms():
    runs = [R("x", [{"step": 0, "kind": "eval", "accuracy": 0.0, "ties": 1.0, "loss": 5.0},
                    {"step": 1, "kind": "eval", "accuracy": 0.5, "ties": 0.0, "loss": 0.01}])]
    charts = {c["name"]: c for c in curves(runs)}
    assert charts["eval/loss"]["log"] is True and charts["eval/accuracy"]["log"] is False  # 500x vs a zero
    assert charts["eval/accuracy"]["runs"]["x"]["ties"] == [0] and charts["eval/loss"]["runs"]["x"]["ties"] == []
    rows = [{"step": 10, "alarm_kl": 0, "alarm_kl_slope": 0.1}, {"step": 20, "alarm_kl": 1, "alarm_kl_slope": 0.9},
            {"step": 30, "alarm_kl": 1, "alarm_kl_slope": 1.2}]
    assert fired_alarms(rows) == [{"name": "kl", "step": 20, "records": 2, "figures": {"slope": 0.9}}]
    assert config_diff({"a": 1, "b": 2}, {"a": 1, "c": 3}) == [["b", 2, "(absent)"], ["c", "(absent)", 3]]


def test_explorer_reads_at_a_glance_stages_apart_key_metrics_first_constants_folded():
    """A pipeline's SFT (2,000 steps) and PPO (31) runs, given out of order: the summary rows and the chart
    sections in pipeline order, every chart of one stage only, the key metrics first, constants folded."""
    sft = R("seed_1/sft", [{"step": 0, "kind": "eval", "gold_score": 10.0, "loss": 3.0},
                           {"step": 1000, "kind": "train", "loss": 2.0, "skipped_steps": 0, "lr": 1e-3},
                           {"step": 2000, "kind": "train", "loss": 1.0, "skipped_steps": 0, "lr": 1e-3},
                           {"step": 2000, "kind": "eval", "gold_score": 60.0, "loss": 1.5}],
            {"stage": "sft", "gold_score_before": 10.0, "gold_score_after": 60.0, "steps": 2000}, "/r/seed_1/sft")
    ppo = R("seed_1/ppo", [{"step": 0, "kind": "eval", "gold_score": 60.0, "kl": 0.0, "reward": 0.2},
                           {"step": 1, "kind": "train", "response_len": 5.0, "kl": 0.0, "reward": 0.1,
                            "reward_errors": 0},
                           {"step": 31, "kind": "train", "response_len": 4.0, "kl": 0.3, "reward": 0.9,
                            "reward_errors": 0},
                           {"step": 31, "kind": "eval", "gold_score": 95.0, "kl": 0.4, "reward": 0.8}],
            {"stage": "ppo", "gold_score_after": 95.0, "kl": 0.4}, "/r/seed_1/ppo")
    reward = R("seed_1/reward_2", [{"step": 0, "kind": "eval", "accuracy": 0.5}, {"step": 5, "kind": "eval",
                                                                                  "accuracy": 0.9}], {},
               "/r/seed_1/reward_2")  # unfinished: no summary.json, its stage from the directory's name
    charts = curves([ppo, reward, sft])
    assert [c["id"] for c in charts if not c["constant"]] == [
        "sft:eval/gold_score", "sft:eval/loss", "sft:train/loss", "reward:eval/accuracy",
        "ppo:eval/gold_score", "ppo:eval/reward", "ppo:train/reward", "ppo:eval/kl", "ppo:train/kl",
        "ppo:train/response_len"]
    assert {c["id"]: c["value"] for c in charts if c["constant"]} == {
        "sft:train/skipped_steps": 0, "sft:train/lr": 1e-3, "ppo:train/reward_errors": 0}
    for c in charts:  # a chart holds one stage's runs: SFT's steps never squash PPO's
        assert list(c["runs"]) == [{"sft": "seed_1/sft", "reward": "seed_1/reward_2", "ppo": "seed_1/ppo"}[c["stage"]]]
    assert charts[0]["name"].split("/")[1] in KEY_METRICS
    rows = summary_rows([ppo, reward, sft])
    assert [(r["run"], r["stage"]) for r in rows] == [("seed_1/sft", "sft"), ("seed_1/reward_2", "reward"),
                                                      ("seed_1/ppo", "ppo")]
    assert (rows[0]["gold_score_after"], rows[2]["gold_score_after"], rows[2]["kl"]) == (60.0, 95.0, 0.4)
    assert rows[1]["eval_accuracy"] is None and rows[0]["kl"] is None


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
        folded = page.evaluate("window.EXPLORER.folded")
        n_plots = page.evaluate("document.querySelectorAll('.js-plotly-plot').length")
        summary_rows = page.eval_on_selector_all("#summary-table tr.summary-row",
                                                 "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
        drawn = page.eval_on_selector_all(".js-plotly-plot", "ds => ds.map(d => d.dataset.stage + ':' + d.dataset.metric)")
        page.hover(".js-plotly-plot")  # the first chart's mode bar shown, as a person pointing at it sees it
        # what a person sees of each chart's title: inside its chart, clear of the mode bar (shown or not)
        titles = page.eval_on_selector_all(".js-plotly-plot", """ds => ds.map(d => {
            const b = d.getBoundingClientRect(), t = d.querySelector('.gtitle').getBoundingClientRect(),
                  m = d.querySelector('.modebar').getBoundingClientRect();
            return {text: d.querySelector('.gtitle').textContent, width: t.width,
                    inside: t.left >= b.left && t.right <= b.right && t.top >= b.top && t.bottom <= b.bottom,
                    clear: t.right <= m.left || m.right <= t.left || t.bottom <= m.top || m.bottom <= t.top};
        })""")
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
            page.evaluate("document.getElementById('run-1').scrollIntoView()")  # a run's summary, then the samples
            page.screenshot(path=os.environ["EXPLORER_SCREENSHOT"], full_page=False)
        browser.close()
    assert errors == [], errors
    assert requests == [url], f"the page fetched more than itself: {requests}"
    want = metrics(two_runs / "a" / "sft")
    names = {n for r in want for n in scalar_values(r)}
    assert n_plots == len(charts) and len(charts) + len(folded) == len(names)
    assert {i.split(":", 1)[1] for i in [*charts, *folded]} == names and folded  # every series: drawn or folded
    for i, value in folded.items():  # folded: the same value at every record of both runs
        kind, key = i.split(":", 1)[1].split("/", 1)
        assert {r[key] for r in want if r["kind"] == kind and key in r} == {value}, i
    assert drawn == list(charts)  # the page's order: the key metrics first
    key_drawn = [f"sft:{k}/{m}" for m in KEY_METRICS for k in ("eval", "train") if f"sft:{k}/{m}" in charts]
    assert drawn[:len(key_drawn)] == key_drawn and drawn[0] == "sft:eval/loss"  # gold 0 throughout: folded
    assert folded["sft:eval/gold_score"] == 0
    assert [t["text"] for t in titles] == [d.split(":", 1)[1] for d in drawn]
    assert all(t["inside"] and t["clear"] and t["width"] > 0 for t in titles), titles
    assert [row[:2] for row in summary_rows] == [["a/sft", "sft"], ["b/sft", "sft"]]
    assert summary_rows[0][2:] == summary_rows[1][2:] and len(summary_rows[0]) > 2  # the same run copied
    for chart_id, traces in charts.items():
        kind, key = chart_id.split(":", 1)[1].split("/", 1)
        rows = [r for r in want if r["kind"] == kind and isinstance(r.get(key), (int, float))]
        assert [t["run"] for t in traces] == ["a/sft", "b/sft"]
        assert all(t["x"] == [r["step"] for r in rows] and t["y"] == [r[key] for r in rows] for t in traces)
    step1 = read_samples(str(two_runs / "a" / "sft"), 1)
    assert shown == [s["prompt"] for s in step1] and cells == [s["response"] for s in step1]
    assert filtered == 0


def copy_run(src, dst) -> None:
    """A stage's output_dir without its model and checkpoints (what the explorer reads)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model", "checkpoints", "critic", "wandb", "mlruns"))


@pytest.mark.skipif(CHROMIUM is None or importlib.util.find_spec("playwright") is None,
                    reason="needs Chromium (apt-get install chromium) and playwright (pip install -e '.[browser]')")
def test_explorer_of_a_pipeline_and_of_two_ppo_runs_as_a_person_sees_them(tiny_stages, tmp_path):
    """A pipeline (SFT, reward, PPO) and two PPO runs compared, in Chromium: the summary rows and the stage sections
    in pipeline order, each section's charts its own stage's runs (no shared step axis), its first chart a key
    metric, titles clear of the mode bar. EXPLORER_SCREENSHOTS=<dir> writes the docs' two screenshots there
    (docs/looking-at-runs.md: explorer-pipeline.png, explorer-ppo-compare.png)."""
    from playwright.sync_api import sync_playwright

    pipeline, compare = tmp_path / "pipeline", tmp_path / "compare"
    for stage in ("sft", "reward"):
        copy_run(tiny_stages / stage, pipeline / stage)
    for name, kl in (("kl_0.05", 0.05), ("kl_0.5", 0.5)):
        run_stage("ppo", f"output_dir={compare / name}", f"actor.model={tiny_stages / 'sft'}",
                  f"critic.model={tiny_stages / 'reward'}", "train.max_steps=4", "train.eval_every=2", "train.save_every=0",
                  "rollout.prompts_per_step=8", "rollout.mini_batch_size=8", "rollout.micro_batch_size=8",
                  "rollout.max_new_tokens=6", "eval.max_new_tokens=6", "data.num_eval_prompts=4", "alarms.enabled=false",
                  f"ppo.kl_coef={kl}", "ppo.adaptive_kl=false", timeout=300)
    copy_run(compare / "kl_0.05", pipeline / "ppo")
    shots = os.environ.get("EXPLORER_SCREENSHOTS")
    seen = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        for what, root, shot in (("pipeline", pipeline, "explorer-pipeline.png"),
                                 ("compare", compare, "explorer-ppo-compare.png")):
            out = tmp_path / f"{what}.html"
            report_main([str(root), "--out", str(out)])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(out.as_uri())
            page.wait_for_function("window.EXPLORER && document.querySelectorAll('.js-plotly-plot').length > 0")
            seen[what] = page.evaluate("""() => ({
                rows: [...document.querySelectorAll('#summary-table tr.summary-row')].map(r => r.cells[0].textContent),
                sections: [...document.querySelectorAll('#charts div.charts')].map(g => g.dataset.stage),
                first: [...document.querySelectorAll('#charts div.charts')].map(
                    g => g.querySelector('.js-plotly-plot').dataset.metric),
                traces: Object.fromEntries(Object.entries(window.EXPLORER.charts).map(([k, t]) => [k, t.map(x => x.run)])),
                clear: [...document.querySelectorAll('.js-plotly-plot')].every(d => {
                    const t = d.querySelector('.gtitle').getBoundingClientRect(),
                          m = d.querySelector('.modebar').getBoundingClientRect();
                    return t.width > 0 && (t.right <= m.left || m.right <= t.left || t.bottom <= m.top || m.bottom <= t.top);
                }),
            })""")
            assert errors == [], errors
            if shots:
                os.makedirs(shots, exist_ok=True)
                page.screenshot(path=os.path.join(shots, shot), full_page=False)
            page.close()
        browser.close()
    pipe, comp = seen["pipeline"], seen["compare"]
    assert pipe["rows"] == ["sft", "reward", "ppo"] and pipe["sections"] == ["sft", "reward", "ppo"]
    for chart_id, runs in pipe["traces"].items():  # a stage's chart holds that stage's run alone
        assert runs == [chart_id.split(":")[0]], chart_id
    assert all(m.split("/", 1)[1] in KEY_METRICS for m in pipe["first"]), pipe["first"]
    assert pipe["first"][2] == "eval/gold_score" or pipe["first"][2].endswith(("/reward", "/kl"))
    assert comp["rows"] == ["kl_0.05", "kl_0.5"] and comp["sections"] == ["ppo"]
    assert all(runs == ["kl_0.05", "kl_0.5"] for runs in comp["traces"].values())  # compared on every chart
    assert pipe["clear"] and comp["clear"]
