"""The run explorer: one self-contained HTML page over one or many runs (`python -m rlhf.report`).

    runs = find_runs(["outputs"])                 # every directory under the paths holding a metrics.jsonl
    html = explorer_html(runs)                    # plotly.min.js inlined from the plotly package, data embedded

A run is a stage's output_dir: metrics.jsonl (the curves), config.yaml (the config diff against the
first run), summary.json (the summary figures), samples.jsonl (the samples browser). The page needs
no network: the charting library (plotly's own bundled plotly.min.js, MIT licence, ~4.8 MB) and the
data are inside it. What it shows, read at a glance:
  - a summary row per run first, stages in pipeline order: its stage, steps, time and the figures a
    person opens the page for (gold score before -> after, held-out pair accuracy, reward, KL);
  - the curves, one section per stage (stages never share a step axis: SFT's 2,000 steps would squash
    PPO's 31 to a sliver), one chart per metric (`kind/name`) with the runs of that stage overlaid, the
    key metrics first (gold score, reward, KL, accuracy, loss; held-out before training), hover values;
    x (the step) shared within a stage: zooming one chart zooms its stage's; a log y axis where the
    values span two decades or more (all positive); a pair accuracy whose pairs all tied is marked
    "ties" (rlhf/run/runlog.py `series`); a series that never changes (in every run) is folded into
    one line under its stage instead of a chart; titles left-aligned, the mode bar vertical at the
    right, so neither covers the other;
  - each run's config keys that differ from the first run's, its summary.json, the alarms that fired;
  - the samples browser: a step slider over the evaluations, a filter on task / text and on a minimum
    score, each prompt's samples side by side across runs; a prompt's row opens it across every step.
"""
from __future__ import annotations

import html
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from rlhf.run.runlog import METRICS, SUMMARY, read_metrics, read_samples

CONFIG = "config.yaml"
SKIP_DIRS = {"checkpoints", "wandb", "tensorboard", "mlruns", "csv", ".git"}


@dataclass
class RunData:
    name: str
    path: str
    metrics: list[dict] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)


def find_runs(paths: list[str]) -> list[str]:
    """Every run directory (one holding metrics.jsonl) at or under `paths`, in the order given, each path's
    runs sorted; a path that holds none is a ValueError naming it."""
    found: list[str] = []
    for p in paths:
        if not os.path.isdir(p):
            raise ValueError(f"{p}: no such directory")
        mine = []
        for root, dirs, files in os.walk(p):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(".tmp-"))
            if METRICS in files:
                mine.append(root)
        if not mine:
            raise ValueError(f"{p}: no run in it (no {METRICS} at or under it)")
        found += [r for r in sorted(mine) if r not in found]
    return found


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def load_run(path: str, name: str) -> RunData:
    run = RunData(name=name, path=os.path.abspath(path), metrics=read_metrics(path), samples=read_samples(path))
    if os.path.exists(os.path.join(path, CONFIG)):
        with open(os.path.join(path, CONFIG)) as f:
            run.config = flatten(yaml.safe_load(f) or {})
    if os.path.exists(os.path.join(path, SUMMARY)):
        with open(os.path.join(path, SUMMARY)) as f:
            run.summary = json.load(f)
    return run


def run_names(paths: list[str]) -> list[str]:
    """Short names: each path relative to the paths' common parent (the directory's own name for one run)."""
    absolute = [os.path.abspath(p) for p in paths]
    if len(absolute) == 1:
        return [os.path.basename(absolute[0])]
    common = os.path.commonpath(absolute)
    return [os.path.relpath(p, common) for p in absolute]


def config_diff(first: dict[str, Any], other: dict[str, Any]) -> list[list[Any]]:
    """[key, first run's value, this run's value] for every key whose value differs ("(absent)" where missing)."""
    return [[k, first.get(k, "(absent)"), other.get(k, "(absent)")] for k in sorted(set(first) | set(other))
            if first.get(k, "(absent)") != other.get(k, "(absent)")]


def fired_alarms(rows: list[dict]) -> list[dict[str, Any]]:
    """The reward-hacking alarms (rlhf/rl/alarms.py) that fired in `rows`: name, first step, how many records
    had it, the alarm's figures at its first step; in the order they first fired."""
    fired: dict[str, list[dict]] = {}
    for r in rows:
        for key, v in r.items():
            name = key[len("alarm_"):]
            if key.startswith("alarm_") and "_" not in name and v == 1:
                fired.setdefault(name, []).append(r)
    return [{"name": name, "step": hits[0]["step"], "records": len(hits),
             "figures": {k[len(f"alarm_{name}_"):]: v for k, v in hits[0].items() if k.startswith(f"alarm_{name}_")}}
            for name, hits in sorted(fired.items(), key=lambda x: x[1][0]["step"])]


STAGES = ("sft", "reward", "dpo", "ppo", "evaluate", "serve")  # a pipeline's order (the summary rows', the sections')
# The figures a person opens the page for, first among a stage's charts (held-out before training at each).
KEY_METRICS = ("gold_score", "reward", "kl", "accuracy", "loss")
KINDS = ("eval", "train")
# summary.json's headline figures, in the summary row (a stage has those of them it writes)
SUMMARY_KEYS = ("gold_score_before", "gold_score_after", "eval_accuracy", "reward_after", "kl", "steps", "time_s")


def stage_of(run: RunData) -> str:
    """The stage a run is: its summary.json's `stage`, else its directory's name (reward_2 -> reward) when
    that names a stage, else "run"."""
    if run.summary.get("stage"):
        return str(run.summary["stage"])
    base = os.path.basename(run.path.rstrip(os.sep)).split("_")[0]
    return base if base in STAGES else "run"


def chart_order(chart: dict[str, Any]) -> tuple:
    """Key metrics first (KEY_METRICS' order, held-out before train), then the rest as first seen."""
    kind, key = chart["name"].split("/", 1)
    rank = KEY_METRICS.index(key) if key in KEY_METRICS else len(KEY_METRICS)
    return (rank, KINDS.index(kind) if rank < len(KEY_METRICS) and kind in KINDS else 0, chart["seen"])


def curves(runs: list[RunData]) -> list[dict[str, Any]]:
    """One chart per stage and `kind/name`: per run its steps and values; `stage` (`stage_of`: runs of different
    stages never share a chart); `log` where every value is positive and they span two decades or more; `ties`:
    the steps where a pair accuracy's pairs all tied; `constant`: True when every run's values are one and the
    same (or none is finite), `value` that value, so the page folds the chart away. Ordered by stage (STAGES),
    then `chart_order` (the key metrics first)."""
    charts: dict[tuple[str, str], dict[str, Any]] = {}
    for i, run in enumerate(runs):
        stage = stage_of(run)
        for r in run.metrics:
            for k, v in r.items():
                if k in ("step", "kind") or isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue
                name = f"{r.get('kind', 'train')}/{k}"
                chart = charts.setdefault((stage, name), {"name": name, "stage": stage, "id": f"{stage}:{name}",
                                                          "runs": {}, "seen": len(charts)})
                xs = chart["runs"].setdefault(run.name, {"x": [], "y": [], "ties": []})
                xs["x"].append(r["step"])
                xs["y"].append(v)
                if k.split("/")[0] == "accuracy" and r.get("ties") == 1:
                    xs["ties"].append(r["step"])
    for chart in charts.values():
        values = [y for s in chart["runs"].values() for y in s["y"] if math.isfinite(y)]
        chart["log"] = bool(values) and min(values) > 0 and max(values) / min(values) >= 100
        chart["constant"] = len(set(values)) <= 1 and not any(s["ties"] for s in chart["runs"].values())
        chart["value"] = values[0] if chart["constant"] and values else None
    stages = [st for st in STAGES if any(c["stage"] == st for c in charts.values())]
    stages += sorted({c["stage"] for c in charts.values()} - set(stages))
    out = sorted(charts.values(), key=lambda c: (stages.index(c["stage"]), *chart_order(c)))
    for c in out:
        del c["seen"]
    return out


def summary_rows(runs: list[RunData]) -> list[dict[str, Any]]:
    """One row per run, stages in pipeline order (STAGES, then the rest; runs of a stage as given): run,
    stage, and the SUMMARY_KEYS its summary.json has (None for those it lacks)."""
    order = {st: i for i, st in enumerate(STAGES)}
    ranked = sorted(enumerate(runs), key=lambda x: (order.get(stage_of(x[1]), len(STAGES)), x[0]))
    return [{"run": r.name, "stage": stage_of(r), **{k: r.summary.get(k) for k in SUMMARY_KEYS}} for _, r in ranked]


def page_data(runs: list[RunData]) -> dict[str, Any]:
    first = runs[0]
    return {
        "runs": [{"name": r.name, "path": r.path, "summary": r.summary, "config_diff": config_diff(first.config, r.config),
                  "alarms": fired_alarms(r.metrics), "samples": r.samples} for r in runs],
        "first": first.name,
        "summary_rows": summary_rows(runs),
        "summary_keys": list(SUMMARY_KEYS),
        "charts": curves(runs),
    }


def plotly_js() -> str:
    """plotly.min.js as the plotly Python package ships it (the same file its `write_html` inlines)."""
    try:
        import plotly  # deferred: only the explorer needs it (the report extra)
    except ImportError:
        raise ValueError('the run explorer needs plotly, which is not installed: pip install -e ".[report]"') from None

    path = os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js")
    with open(path, encoding="utf-8") as f:
        return f.read()


def script_safe(text: str) -> str:
    """Text to put inside <script>: no "</" can end the element early."""
    return text.replace("</", "<\\/")


def explorer_html(runs: list[RunData], title: str = "RLHF runs") -> str:
    data = json.dumps(page_data(runs), allow_nan=True).replace("NaN", "null").replace("Infinity", "null")
    return PAGE.format(title=html.escape(title), plotly=script_safe(plotly_js()), data=script_safe(data), js=SCRIPT,
                       css=CSS)


def write_explorer(paths: list[str], out: str) -> tuple[str, list[RunData]]:
    dirs = find_runs(paths)
    runs = [load_run(d, n) for d, n in zip(dirs, run_names(dirs))]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(explorer_html(runs, f"RLHF runs: {', '.join(r['run'] for r in summary_rows(runs))}"))  # pipeline order
    os.replace(tmp, out)
    return out, runs


CSS = """
body{font-family:system-ui,sans-serif;margin:0 1.5em 2em;color:#222}
h1{font-size:1.4em} h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;font-size:.85em;margin:.4em 0} td,th{border:1px solid #ddd;padding:2px 6px;
vertical-align:top;text-align:left} th{background:#f3f3f3}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:6px}
.chart{height:260px} h3.stage{margin:.8em 0 .2em} details.folded{font-size:.85em;margin:.2em 0 .6em}
.resp{white-space:pre-wrap;font-family:monospace} .fig{color:#555;font-size:.9em}
#controls{display:flex;gap:1.2em;align-items:center;flex-wrap:wrap;margin:.5em 0}
tr.prompt-row{cursor:pointer} tr.prompt-row:hover{background:#f6f9ff}
"""

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title><style>{css}</style>
<script>{plotly}</script></head>
<body>
<h1>{title}</h1>
<nav><a href="#summary-title">summary</a> · <a href="#curves">curves</a> ·
<a href="#runs">runs: config diff, summary, alarms</a> · <a href="#samples">samples</a></nav>
<h2 id="summary-title">Summary</h2><div id="summary"></div>
<h2 id="curves">Curves</h2><div id="charts"></div>
<h2 id="runs">Runs</h2><div id="run-tables"></div>
<h2 id="samples">Samples</h2>
<div id="controls">
 <label>step <input type="range" id="samples-step" min="0" max="0" value="0"> <b id="samples-step-label"></b></label>
 <label>filter <input type="text" id="samples-filter" placeholder="task, prompt or response text"></label>
 <label>min score <input type="number" id="samples-min" step="any" style="width:6em"></label>
 <span id="samples-count"></span>
</div>
<div id="samples-table"></div>
<h2 id="prompt-view-title" style="display:none">One prompt across steps and runs</h2>
<div id="prompt-view"></div>
<script type="application/json" id="explorer-data">{data}</script>
<script>{js}</script>
</body></html>
"""

SCRIPT = r"""
const DATA = JSON.parse(document.getElementById('explorer-data').textContent);
const RUNS = DATA.runs.map(r => r.name);
const esc = s => String(s === null || s === undefined ? '' : s).replace(/[&<>"]/g,
  c => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;'}[c]));
const fmt = v => typeof v === 'number' ? (Number.isInteger(v) ? String(v) : v.toPrecision(4)) : esc(v);
window.EXPLORER = {data: DATA, charts: {}};

// ---- summary: one row per run, stages in pipeline order, the headline figures its summary.json has
const sumKeys = DATA.summary_keys.filter(k => DATA.summary_rows.some(r => r[k] !== null && r[k] !== undefined));
document.getElementById('summary').innerHTML = '<table id="summary-table"><tr><th>run</th><th>stage</th>' +
  sumKeys.map(k => '<th>' + esc(k) + '</th>').join('') + '</tr>' + DATA.summary_rows.map(r =>
    '<tr class="summary-row" data-stage="' + esc(r.stage) + '"><td>' + esc(r.run) + '</td><td>' + esc(r.stage) + '</td>' +
    sumKeys.map(k => '<td>' + (r[k] === null || r[k] === undefined ? '–' : fmt(r[k])) + '</td>').join('') + '</tr>').join('') +
  '</table>';

// ---- curves: a section per stage (stages never share a step axis), one chart per metric with the stage's runs
// overlaid, key metrics first (the data's order); a series constant in every run folded into one line
const chartsDiv = document.getElementById('charts');
window.EXPLORER.folded = {};
let syncing = false;
[...new Set(DATA.charts.map(c => c.stage))].forEach(stage => {
  const mine = DATA.charts.filter(c => c.stage === stage);
  const h = document.createElement('h3'); h.className = 'stage'; h.id = 'stage-' + stage;
  h.textContent = stage + ' (' + RUNS.filter(n => mine.some(c => c.runs[n])).length + ' run(s))';
  chartsDiv.appendChild(h);
  const grid = document.createElement('div'); grid.className = 'charts'; grid.dataset.stage = stage;
  chartsDiv.appendChild(grid);
  const flat = mine.filter(c => c.constant);
  if (flat.length) {
    const d = document.createElement('details'); d.className = 'folded'; d.dataset.stage = stage;
    d.innerHTML = '<summary>' + flat.length + ' series that never change (folded)</summary><p class="fig">' +
      flat.map(c => esc(c.name) + ' = ' + (c.value === null ? 'no finite value' : fmt(c.value))).join('; ') + '</p>';
    chartsDiv.appendChild(d);
    flat.forEach(c => { window.EXPLORER.folded[c.id] = c.value; });
  }
  const plots = [];  // this stage's charts: zooming one zooms them, never another stage's
  mine.filter(c => !c.constant).forEach(c => {
    const div = document.createElement('div'); div.className = 'chart'; div.id = 'chart-' + c.id;
    div.dataset.metric = c.name; div.dataset.stage = stage; grid.appendChild(div);
    const traces = RUNS.filter(n => c.runs[n]).map(n => {
      const s = c.runs[n];
      return {x: s.x, y: s.y, name: n, type: 'scatter', mode: s.x.length < 30 ? 'lines+markers' : 'lines',
              text: s.x.map(x => s.ties.includes(x) ? 'ties' : ''),
              marker: {symbol: s.x.map(x => s.ties.includes(x) ? 'x' : 'circle'), size: 6},
              hovertemplate: '%{y}%{text}<extra>' + esc(n) + '</extra>'};
    });
    window.EXPLORER.charts[c.id] = traces.map(t => ({run: t.name, x: t.x, y: t.y}));
    // the title left-aligned and the mode bar upright in the right margin: neither covers the other
    const layout = {title: {text: c.name, font: {size: 13}, x: 0.02, xanchor: 'left', xref: 'container'},
                    margin: {l: 50, r: 36, t: 30, b: 30}, modebar: {orientation: 'v'},
                    hovermode: 'x unified', showlegend: traces.length > 1, legend: {font: {size: 9}},
                    xaxis: {title: {text: 'step'}}, yaxis: {type: c.log ? 'log' : 'linear'}};
    Plotly.newPlot(div, traces, layout, {displaylogo: false, responsive: true});
    plots.push(div);
    div.on('plotly_relayout', ev => {
      if (syncing) return;
      const upd = {};
      if ('xaxis.range[0]' in ev) { upd['xaxis.range'] = [ev['xaxis.range[0]'], ev['xaxis.range[1]']]; }
      else if ('xaxis.autorange' in ev) { upd['xaxis.autorange'] = true; } else return;
      syncing = true;
      Promise.all(plots.filter(p => p !== div).map(p => Plotly.relayout(p, upd))).then(() => { syncing = false; });
    });
  });
});

// ---- runs: config diff against the first run, summary, alarms
const cfgValue = v => v === '(absent)' ? '<i>(absent)</i>' : esc(JSON.stringify(v));
const rt = document.getElementById('run-tables');
rt.innerHTML = DATA.runs.map((r, i) => {
  const diff = i === 0 ? '<p>(the first run: the others are compared with it)</p>' :
    (r.config_diff.length ? '<table class="config-diff"><tr><th>key</th><th>' + esc(DATA.first) + '</th><th>' +
      esc(r.name) + '</th></tr>' + r.config_diff.map(d => '<tr><td>' + esc(d[0]) + '</td><td>' + cfgValue(d[1]) +
      '</td><td>' + cfgValue(d[2]) + '</td></tr>').join('') + '</table>' : '<p>same config as the first run</p>');
  const summ = Object.keys(r.summary).length ? '<table class="summary">' + Object.entries(r.summary).map(
    ([k, v]) => '<tr><td>' + esc(k) + '</td><td>' + fmt(v) + '</td></tr>').join('') + '</table>' :
    '<p>no summary.json (unfinished?)</p>';
  const al = r.alarms.length ? '<ul class="alarms">' + r.alarms.map(a => '<li><b>' + esc(a.name) + '</b> fired at step ' +
    a.step + ' (' + a.records + ' record(s)): ' + Object.entries(a.figures).map(([k, v]) => esc(k) + ' ' + fmt(v)).join(', ') +
    '</li>').join('') + '</ul>' : '<p class="alarms">no alarm fired</p>';
  return '<h3 id="run-' + i + '">' + esc(r.name) + '</h3><p class="fig">' + esc(r.path) + '</p><h4>config diff</h4>' + diff +
    '<h4>summary</h4>' + summ + '<h4>alarms</h4>' + al;
}).join('');

// ---- samples: step slider, filter, each prompt across runs; a prompt row opens it across steps
// tool_transcript / tool_answer: a multi-turn run's greedy episode with its environment (rlhf/rl/multiturn.py)
const TEXT_KEYS = ['prompt', 'task', 'response', 'sampled_response', 'chosen', 'rejected', 'tool_transcript', 'tool_answer', 'tool_error'];
const SCORE_KEYS = ['gold', 'reward', 'score', 'margin'];
const steps = [...new Set(DATA.runs.flatMap(r => r.samples.map(s => s.step)))].sort((a, b) => a - b);
const slider = document.getElementById('samples-step');
slider.max = Math.max(0, steps.length - 1); slider.value = slider.max;
const sampleCell = s => {
  if (!s) return '<td class="fig">–</td>';
  const text = ['response', 'sampled_response', 'chosen', 'rejected', 'tool_transcript', 'tool_error'].filter(k => k in s && s[k] !== null).map(
    k => '<div><span class="fig">' + k + ':</span> <span class="resp">' + esc(s[k]) + '</span></div>').join('');
  const figs = Object.entries(s).filter(([k, v]) => !TEXT_KEYS.includes(k) && k !== 'step').map(
    ([k, v]) => esc(k) + ' ' + fmt(v)).join(', ');
  return '<td>' + text + '<div class="fig">' + figs + '</div></td>';
};
const score = s => { for (const k of SCORE_KEYS) if (typeof s[k] === 'number') return s[k]; return null; };
function keep(s) {
  const q = document.getElementById('samples-filter').value.toLowerCase();
  const m = parseFloat(document.getElementById('samples-min').value);
  if (q && !TEXT_KEYS.some(k => String(s[k] ?? '').toLowerCase().includes(q))) return false;
  if (!isNaN(m) && !(score(s) !== null && score(s) >= m)) return false;
  return true;
}
function prompts(step) {
  const order = [], by = {};
  DATA.runs.forEach(r => r.samples.filter(s => s.step === step).forEach(s => {
    if (!(s.prompt in by)) { by[s.prompt] = {}; order.push(s.prompt); }
    by[s.prompt][r.name] = s;
  }));
  return order.map(p => [p, by[p]]);
}
function renderSamples() {
  const step = steps[+slider.value];
  document.getElementById('samples-step-label').textContent = steps.length ? step : '(no samples)';
  const rows = steps.length ? prompts(step).filter(([p, byRun]) => Object.values(byRun).some(keep)) : [];
  document.getElementById('samples-count').textContent = rows.length + ' prompt(s)';
  document.getElementById('samples-table').innerHTML = '<table id="samples-grid"><tr><th>prompt</th>' +
    RUNS.map(n => '<th>' + esc(n) + '</th>').join('') + '</tr>' + rows.map(([p, byRun]) =>
      '<tr class="prompt-row" data-prompt="' + esc(p) + '"><td class="resp">' + esc(p) + '</td>' +
      RUNS.map(n => sampleCell(byRun[n])).join('') + '</tr>').join('') + '</table>';
  document.querySelectorAll('tr.prompt-row').forEach(tr => tr.onclick = () => showPrompt(tr.dataset.prompt));
}
function showPrompt(p) {
  document.getElementById('prompt-view-title').style.display = '';
  document.getElementById('prompt-view').innerHTML = '<p class="resp">' + esc(p) + '</p><table id="prompt-grid"><tr><th>step</th>' +
    RUNS.map(n => '<th>' + esc(n) + '</th>').join('') + '</tr>' + steps.map(st => '<tr><td>' + st + '</td>' +
      DATA.runs.map(r => sampleCell(r.samples.find(s => s.step === st && s.prompt === p))).join('') + '</tr>').join('') +
    '</table>';
  document.getElementById('prompt-view-title').scrollIntoView();
}
window.EXPLORER.showPrompt = showPrompt;
window.EXPLORER.steps = steps;
slider.oninput = renderSamples;
document.getElementById('samples-filter').oninput = renderSamples;
document.getElementById('samples-min').oninput = renderSamples;
renderSamples();
"""
