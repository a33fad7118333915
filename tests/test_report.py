"""report.py and the plots, on a run directory written by hand (no training): what the figures show
(read back from matplotlib's axes) and what report.md says about the KL."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytest.importorskip("matplotlib")
from rlhf.run.runlog import make_figure


def load_report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "scripts" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_run(root, kl: float, estimator: str = "k1") -> None:
    """The files report.py reads: three summaries, metrics.jsonl per stage, ppo/config.yaml."""
    stages = {
        "sft": ({"stage": "sft", "time_s": 10.0, "gold_score_before": 0.0, "gold_score_after": 40.0, "eval_loss_after": 1.6},
                [{"step": s, "kind": "train", "loss": 3.0 - s / 10} for s in (5, 10, 15)]
                + [{"step": s, "kind": "eval", "loss": 3.1 - s / 10, "gold_score": 2.0 * s} for s in (0, 15)]),
        "reward": ({"stage": "reward", "time_s": 5.0, "eval_accuracy": 0.8},
                   [{"step": s, "kind": "train", "loss": 0.6, "accuracy": 0.5 + s / 100} for s in (10, 20, 30, 40)]),
        "ppo": ({"stage": "ppo", "time_s": 7.0, "steps": 3, "gold_score_before": 40.0, "gold_score_after": 42.5,
                 "kl": kl, "step_generation_s": 0.1, "step_scoring_s": 0.1, "step_training_s": 0.2},
                [{"step": s, "kind": "train", "reward": 0.1 * s, "kl": kl} for s in (1, 2, 3)]
                + [{"step": s, "kind": "eval", "gold_score": 40.0 + s, "kl": kl} for s in (0, 3)]),
    }
    for stage, (summ, rows) in stages.items():
        d = root / stage
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps(summ))
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "ppo" / "config.yaml").write_text(f"ppo:\n  kl_coef: 0.3\n  kl_estimator: {estimator}\n")


def test_figure_shares_x_with_integer_ticks_and_labels_every_panel():
    fig = make_figure("t", [
        ("loss", [("train", [1, 2, 3], [3.0, 2.0, 1.0])]),
        ("gold score (% exact)", [("held-out", [0, 3], [10.0, 20.0])]),
        ("empty", [("x", [], [])]),  # skipped
    ])
    axes = fig.axes
    assert len(axes) == 2
    assert axes[0].get_xlim() == axes[1].get_xlim()
    for ax in axes:
        assert ax.get_xlabel() == "step"
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        assert all(label.get_visible() for label in ax.get_xticklabels())  # not hidden by sharex
    assert "%" in axes[1].get_ylabel()
    assert make_figure("t", [("empty", [("x", [], [])])]) is None


def test_pipeline_figure_shows_every_stage(tmp_path):
    report = load_report()
    write_run(tmp_path, kl=0.05)
    fig = make_figure("p", report.pipeline_panels(str(tmp_path)), ncols=3, sharex=False)
    axes = fig.axes
    assert [ax.get_xlabel() for ax in axes] == ["SFT step", "reward step", "PPO step"]
    assert "%" in axes[2].get_ylabel() and "gold" in axes[2].get_ylabel()
    # each stage keeps its own step range: SFT reaches 15, reward 40, PPO 3
    assert axes[0].get_xlim()[1] >= 15 and axes[1].get_xlim()[1] >= 40 and axes[2].get_xlim()[1] < 10
    for ax in axes:
        assert all(float(t).is_integer() for t in ax.get_xticks())


@pytest.mark.parametrize("kl, estimator", [(-0.0224, "k1"), (0.31, "k3")])
def test_report_names_the_kl_estimator_and_explains_a_negative_kl(tmp_path, kl, estimator):
    write_run(tmp_path, kl=kl, estimator=estimator)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "report.py"), str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "report.md").read_text()
    assert f"ppo.kl_estimator={estimator}" in text and f"{kl:.4f} nats per response" in text
    assert "sampled estimate" in text
    assert ("negative only through sampling noise" in text) == (kl < 0)
    assert "gold score (%)" in text and "+2.5 points" in text
    assert (tmp_path / "pipeline.png").is_file()


def test_report_says_which_step_a_kl_budget_exported(tmp_path):
    write_run(tmp_path, kl=0.29)
    summ = json.loads((tmp_path / "ppo" / "summary.json").read_text())
    summ.update(steps=31, exported_step=20, exported_by="the last evaluation within train.kl_budget=0.5 (held-out KL "
                "to the reference)", gold_score_after=96.0, kl=0.2856, last_step_eval={"gold_score": 97.0, "kl": 0.8192},
                kl_budget=0.5, kl_budget_exceeded={"step": 30, "kl": 0.76})
    (tmp_path / "ppo" / "summary.json").write_text(json.dumps(summ))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "report.py"), str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "report.md").read_text()
    assert ("The exported actor is step 20's (the last evaluation within train.kl_budget=0.5 (held-out KL to the "
            "reference)): gold 96.0 at KL 0.286; the last step's (step 31): gold 97.0 at KL 0.819.") in text, text
    write_run(tmp_path / "plain", kl=0.29)  # the last step's actor exported: no such line
    subprocess.run([sys.executable, str(ROOT / "scripts" / "report.py"), str(tmp_path / "plain")], cwd=ROOT, check=True,
                   capture_output=True, timeout=120)
    assert "The exported actor" not in (tmp_path / "plain" / "report.md").read_text()


def test_dpo_pipeline_report(tmp_path):
    """PIPELINE=dpo: sft/ and dpo/ only; the gold score SFT -> DPO, the DPO section and its panels."""
    sft = {"stage": "sft", "time_s": 10.0, "gold_score_before": 0.0, "gold_score_after": 40.0}
    dpo = {"stage": "dpo", "time_s": 20.0, "steps": 4, "loss_type": "sigmoid", "reference": "precompute",
           "gold_score_before": 40.0, "gold_score_after": 57.5, "gold_score/sort_before": 30.0,
           "gold_score/sort_after": 60.0, "eval_loss_before": 0.693, "eval_loss_after": 0.41,
           "eval_accuracy_before": 0.0, "eval_accuracy_after": 0.9, "eval_margin_before": 0.0, "eval_margin_after": 1.5,
           "peak_rss_mb": 612.0}
    rows = {"sft": [{"step": s, "kind": "train", "loss": 3.0 - s / 10} for s in (5, 10)],
            "dpo": [{"step": s, "kind": "train", "accuracy": 0.5 + s / 10} for s in (1, 2, 3, 4)]
            + [{"step": s, "kind": "eval", "accuracy": s / 4, "gold_score": 40.0 + s} for s in (0, 4)]}
    for stage, summ in (("sft", sft), ("dpo", dpo)):
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "summary.json").write_text(json.dumps(summ))
        (tmp_path / stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[stage]))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "report.py"), str(tmp_path)],  # pipeline detected
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "report.md").read_text()
    assert "| after DPO | 57.5 |" in text and "DPO changed the gold score by **+17.5 points**" in text
    assert "| sort | 30 | 60 |" in text and "(SFT 10 s, DPO 20 s)" in text
    assert "preference accuracy 0 -> 0.9" in text and "reference precompute" in text and "612" in text
    axes = make_figure("p", load_report().dpo_panels(str(tmp_path)), ncols=3, sharex=False).axes
    assert [ax.get_xlabel() for ax in axes] == ["SFT step", "DPO step", "DPO step"]
    assert "gold" in axes[2].get_ylabel()


def summaries(sft_gold: float, acc: float, ppo_gold: float, kl: float, times=(10.0, 5.0, 7.0), sft_loss=None) -> dict:
    """The three summaries `report.figures` reads, with the given figures."""
    return {"sft": {"time_s": times[0], "gold_score_after": sft_gold, "eval_loss_after": sft_loss},
            "reward": {"time_s": times[1], "eval_accuracy": acc, "gold_auc": None},
            "ppo": {"time_s": times[2], "gold_score_after": ppo_gold, "kl": kl}}


def test_report_json_holds_the_headline_figures(tmp_path):
    write_run(tmp_path, kl=0.05)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "report.py"), str(tmp_path), "--total-s", "30"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads((tmp_path / "report.json").read_text())
    assert got == {"sft_gold": 40.0, "sft_loss": 1.6, "rm_accuracy": 0.8, "rm_gold_auc": None, "ppo_gold": 42.5,
                   "gold_gain": 2.5, "kl": 0.05, "sft_s": 10.0, "reward_s": 5.0, "ppo_s": 7.0, "total_s": 30.0}


def test_aggregate_by_hand():
    report = load_report()
    agg = report.aggregate([{"a": 1.0, "b": None}, {"a": 2.0, "b": 5.0}, {"a": 6.0, "b": None}])
    # mean 3, sample variance ((-2)^2 + (-1)^2 + 3^2) / 2 = 7
    assert agg["a"] == {"mean": 3.0, "std": pytest.approx(7 ** 0.5), "min": 1.0, "max": 6.0, "n": 3}
    assert agg["b"] == {"mean": 5.0, "std": None, "min": 5.0, "max": 5.0, "n": 1}  # runs without it left out


def test_seed_sweep_table(tmp_path):
    report = load_report()
    runs = {1: summaries(60.0, 0.90, 85.0, 0.5, (100.0, 200.0, 300.0), 0.138),
            2: summaries(70.0, 0.94, 95.0, 0.7, (110.0, 210.0, 310.0), 0.094),
            3: summaries(65.0, 0.95, 91.0, 0.6, (120.0, 220.0, 320.0), 0.101)}
    for seed, s in runs.items():
        (tmp_path / f"seed_{seed}").mkdir()
        total = sum(st["time_s"] for st in s.values()) + 10
        (tmp_path / f"seed_{seed}" / "report.json").write_text(json.dumps(report.figures(s, total)))
    (tmp_path / "seed_4").mkdir()  # a directory of another sweep: not read
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "report.py"), str(tmp_path), "--sweep", "1", "2", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    table = [line for line in (tmp_path / "sweep.md").read_text().splitlines() if line.startswith("| ")]
    assert table[0].split(" | ")[:8] == ["| seed", "SFT gold (%)", "SFT held-out loss", "RM held-out accuracy", "RM gold AUC", "PPO gold (%)",
                                         "PPO gain (points)", "KL (nats)"]
    # gains 25, 25, 26: mean 25.333, std sqrt(((-1/3)^2 + (-1/3)^2 + (2/3)^2) / 2) = 0.577
    # rows worst PPO gold first: seed 1 (85), seed 3 (91), seed 2 (95)
    assert [line.split(" | ")[0] for line in table[1:4]] == ["| 1", "| 3", "| 2"]
    assert table[1] == "| 1 | 60.0 | 0.138 | 0.900 | – | 85.0 | +25.0 | 0.500 | 100 | 200 | 300 | 610 |"
    assert table[2] == "| 3 | 65.0 | 0.101 | 0.950 | – | 91.0 | +26.0 | 0.600 | 120 | 220 | 320 | 670 |"
    assert table[4] == ("| mean ± std | 65.0 ± 5.0 | 0.111 ± 0.024 | 0.930 ± 0.026 | – | 90.3 ± 5.0 | +25.3 ± 0.6 | 0.600 ± 0.100 "
                        "| 110 ± 10 | 210 ± 10 | 310 ± 10 | 640 ± 30 |")
    assert table[5] == "| min | 60.0 | 0.094 | 0.900 | – | 85.0 | +25.0 | 0.500 | 100 | 200 | 300 | 610 |"
    assert table[6] == "| max | 70.0 | 0.138 | 0.950 | – | 95.0 | +26.0 | 0.700 | 120 | 220 | 320 | 670 |"
    assert len(table) == 7
    text = (tmp_path / "sweep.md").read_text()
    assert "accuracy 0.930 ± 0.026 (min 0.900)" in text and "gain +25.3 ± 0.6 (min +25.0) points" in text
    assert "Worst seed: 1 (PPO gold 85 at KL 0.5, reward-model accuracy 0.9)." in text
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["seeds"] == [1, 2, 3] and saved["aggregate"]["gold_gain"]["min"] == 25.0
    assert saved["aggregate"]["rm_accuracy"]["std"] == pytest.approx(0.026458, abs=1e-6)

    missing = subprocess.run([sys.executable, str(ROOT / "scripts" / "report.py"), str(tmp_path), "--sweep", "1", "4"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "seed_4/report.json is missing (did the pipeline for seed 4 finish?)" in missing.stderr


def test_tool_task_seed_sweep_ranks_by_the_gold_with_the_tool(tmp_path):
    """TASK=tools' report.json rows: the sweep's columns are the tool task's, the worst seed the one with the
    lowest gold with the tool; the control arm (tool off) is ranked by its gold without."""
    report = load_report()

    def row(tool, rl_tool, rl, seconds):
        return {"task": "tools", "tool": tool, "sft_gold": 0.0, "rl_gold": rl, "sft_gold_tool": 100.0 if tool == "on" else None,
                "rl_gold_tool": rl_tool, "tool_calls": 1.0 if tool == "on" else None, "turns": 2.0, "env_errors": 0,
                "sft_s": seconds, "rl_s": 100.0, "total_s": seconds + 110}

    for arm, rows in {"on": {1: row("on", 99.5, 0.0, 300.0), 2: row("on", 97.0, 0.0, 320.0)},
                      "off": {1: row("off", None, 2.5, 280.0), 2: row("off", None, 0.5, 290.0)}}.items():
        root = tmp_path / arm
        for seed, r in rows.items():
            (root / f"seed_{seed}").mkdir(parents=True)
            (root / f"seed_{seed}" / "report.json").write_text(json.dumps(r))
        lines = report.sweep(str(root), [1, 2])
        table = [line for line in lines if line.startswith("| ")]
        assert [line.split(" | ")[0] for line in table[1:3]] == ["| 2", "| 1"]  # both arms: seed 2 is worse
        text = "\n".join(lines)
        if arm == "on":
            assert table[0].split(" | ")[:3] == ["| seed", "RL gold with the tool (%)", "SFT gold with the tool (%)"]
            assert table[1] == "| 2 | 97.0 | 100.0 | 0.0 | 0.0 | 1.00 | 0 | 320 | 100 | 430 |"
            assert "Worst seed: 2 (RL gold with the tool 97, without it 0; tool calls per episode 1)." in text
            assert "RL gold with the tool 98.2 ± 1.8 (min 97.0)" in text and "(lowest RL gold with the tool," in text
        else:
            assert table[0] == "| seed | SFT gold without (%) | RL gold without (%) | SFT (s) | RL (s) | total (s) |"
            assert table[1] == "| 2 | 0.0 | 0.5 | 290 | 100 | 400 |"
            assert "Worst seed: 2 (the control arm, no tool: SFT gold 0, RL gold 0.5)." in text
            assert "(lowest RL gold without the tool," in text and "after RL 1.5 ± 1.4 (min 0.5)" in text


def test_seed_sweep_names_the_sft_start_each_seed_continued(tmp_path):
    # sft:starts.n > 1: summary.json's start_seed becomes the table's first column (a label: not aggregated)
    report = load_report()
    runs = {1: summaries(60.0, 0.90, 85.0, 0.5), 2: summaries(70.0, 0.94, 95.0, 0.7)}
    runs[1]["sft"]["start_seed"], runs[2]["sft"]["start_seed"] = 1001, 2
    for seed, s in runs.items():
        (tmp_path / f"seed_{seed}").mkdir()
        (tmp_path / f"seed_{seed}" / "report.json").write_text(json.dumps(report.figures(s, 30.0)))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "report.py"), str(tmp_path), "--sweep", "1", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    table = [line for line in (tmp_path / "sweep.md").read_text().splitlines() if line.startswith("| ")]
    assert table[0].startswith("| seed | SFT start (seed) | SFT gold (%) |")
    assert table[1].startswith("| 1 | 1001 | 60.0 |") and table[2].startswith("| 2 | 2 | 70.0 |")
    assert table[3].startswith("| mean ± std | – | 65.0 ± 7.1 |") and table[4].startswith("| min | – | 60.0 |")
