"""Reward-hacking alarms (rlhf/rl/alarms.py): each fires on a constructed series and stays quiet on a
steady one; the monitor's WARN lines, metrics fields and resume state; report.py's section;
train.stop_on_alarm through the command line (a checkpoint, then a clean end); and the gen alarm on a
forced sampler/trainer gap through the command line."""
from __future__ import annotations

import importlib.util
import logging
import math
import subprocess
import sys

import pytest

from conftest import ROOT, cli_env, metrics, run_stage, summary
from rlhf.config import AlarmsConfig
from rlhf.rl.alarms import (
    Monitor,
    clip_high,
    entropy_collapse,
    kl_growth,
    length_drift,
    record,
    reward_up_gold_down,
    slope,
    train_alarms,
)

W = 4


def test_slope_is_least_squares():
    assert slope([1.0, 3.0, 5.0]) == 2.0
    assert slope([2.0, 0.0, 2.0, 0.0]) == pytest.approx(-0.4)  # sum((x-1.5)(y-1)) / sum((x-1.5)^2) = -2/5
    assert slope([7.0]) == 0.0


def test_kl_growth():
    steady = [0.5, 0.52, 0.49, 0.51, 0.5, 0.5]
    a = kl_growth(steady, W, 0.1)
    assert not a.fired and abs(a.figures["slope"]) < 0.01
    rising = [0.1, 0.1, 0.2, 0.4, 0.6, 0.8]  # last 4: 0.2 0.4 0.6 0.8 -> 0.2 nats/step
    a = kl_growth(rising, W, 0.1)
    assert a.fired and a.figures["slope"] == pytest.approx(0.2) and a.figures["now"] == 0.8
    assert "0.2000 nats/step" in a.text and "alarms.kl_slope=0.1" in a.text
    assert kl_growth(rising[:3], W, 0.1) is None  # fewer steps than the window
    assert kl_growth([0.2, 0.4, math.nan, 0.8], W, 0.1).figures["slope"] == pytest.approx(0.2)  # NaN skipped


def test_entropy_collapse():
    assert not entropy_collapse([1.0] * 8, W, 0.5).fired
    a = entropy_collapse([1.0, 1.2, 0.8, 1.0, 0.5, 0.3, 0.2, 0.2], W, 0.5)  # baseline 1.0, now 0.3
    assert a.fired and a.figures["ratio"] == pytest.approx(0.3) and a.figures["baseline"] == pytest.approx(1.0)
    assert entropy_collapse([1.0] * 7, W, 0.5) is None  # baseline and window must not overlap


def test_length_drift_either_way():
    assert not length_drift([8.0, 7.0, 9.0, 8.0, 8.5, 7.5, 8.0, 8.0], W, 0.5).fired
    longer = length_drift([8.0] * 4 + [14.0] * 4, W, 0.5)
    assert longer.fired and longer.figures["drift"] == pytest.approx(0.75) and "+75%" in longer.text
    shorter = length_drift([8.0] * 4 + [2.0] * 4, W, 0.5)
    assert shorter.fired and shorter.figures["drift"] == pytest.approx(-0.75)


def test_clip_fraction_high():
    assert not clip_high([0.01, 0.0, 0.02, 0.01], W, 0.2).fired
    a = clip_high([0.0, 0.1, 0.3, 0.3, 0.4], W, 0.2)  # mean of the last 4 = 0.275
    assert a.fired and a.figures["mean"] == pytest.approx(0.275)
    assert clip_high([0.5] * 3, W, 0.2) is None


def test_reward_up_gold_down():
    reward = [0.0, 0.2, 0.4, 0.6, 1.0, 1.2, 1.4, 1.6]  # steps 1..8, rising
    # best gold at step 4 (reward then: steps 1-4, mean 0.3), now step 8 (steps 5-8, mean 1.3), 10 points down
    a = reward_up_gold_down(reward, [(0, 50.0), (4, 90.0), (8, 80.0)], W, 8.0)
    assert a.fired and a.figures == {"drop": 10.0, "now": 80.0, "best": 90.0, "reward": pytest.approx(1.3),
                                     "reward_then": pytest.approx(0.3)}
    assert "90.0 -> 80.0" in a.text and "step 4 -> 8" in a.text
    assert not reward_up_gold_down(reward, [(0, 50.0), (4, 90.0), (8, 95.0)], W, 8.0).fired  # gold rising
    assert not reward_up_gold_down(reward, [(0, 50.0), (4, 90.0), (8, 85.0)], W, 8.0).fired  # fell less than 8
    falling = list(reversed(reward))
    assert not reward_up_gold_down(falling, [(0, 50.0), (4, 90.0), (8, 80.0)], W, 8.0).fired  # reward fell too
    # the evaluation before training (step 0) takes the first window's reward as "then"
    b = reward_up_gold_down(reward, [(0, 90.0), (8, 70.0)], W, 8.0)
    assert b.fired and b.figures["reward_then"] == pytest.approx(0.3)
    assert reward_up_gold_down(reward, [(0, 90.0)], W, 8.0) is None  # one evaluation: nothing to compare


def steady(n: int) -> list[dict]:
    return [{"reward": 1.0, "kl": 0.5, "entropy": 0.1, "response_len": 7.5, "clipfrac": 0.0} for _ in range(n)]


def test_steady_run_is_quiet_and_records_every_figure():
    cfg = AlarmsConfig(window=W)
    alarms = train_alarms(steady(2 * W), cfg)
    assert [a.name for a in alarms] == ["kl", "entropy", "length", "clipfrac"] and not any(a.fired for a in alarms)
    rec = record(alarms)
    assert rec["alarm_kl"] == rec["alarm_entropy"] == rec["alarm_length"] == rec["alarm_clipfrac"] == 0
    assert rec["alarm_entropy_ratio"] == 1.0 and rec["alarm_length_drift"] == 0.0
    assert [a.name for a in train_alarms(steady(W), cfg)] == ["kl", "clipfrac"]  # 2 x window for the others


def test_monitor_warns_once_per_episode_and_resumes(caplog):
    cfg = AlarmsConfig(window=W)
    hist = steady(6) + [dict(h, clipfrac=0.9) for h in steady(3)] + steady(6)
    mon = Monitor(cfg)
    fired = []
    with caplog.at_level(logging.WARNING, logger="rlhf.alarms"):
        for i, h in enumerate(hist[:8], 1):
            mon.after_step(i, h)
            fired.append(list(mon.fired))
        state = mon.state_dict()
        for i, h in enumerate(hist[8:], 9):
            mon.after_step(i, h)
            fired.append(list(mon.fired))
    # clip fraction mean over 4 steps >= 0.2 from step 7 (0.225) while a 0.9 is in the window (to step 12)
    assert [i + 1 for i, f in enumerate(fired) if f] == [7, 8, 9, 10, 11, 12]
    assert caplog.text.count("ALARM clipfrac at step 7") == 1 and caplog.text.count("ALARM") == 1
    assert mon.first_fired == {"clipfrac": 7}
    # a monitor restored from the step-8 state continues identically
    again = Monitor(cfg)
    again.load_state_dict(state)
    assert [again.after_step(i, h) for i, h in enumerate(hist[8:], 9)] == _replay(cfg, hist)[8:]
    # disabled: nothing computed
    off = Monitor(AlarmsConfig(window=W, enabled=False))
    assert off.after_step(1, hist[0]) == {} and off.after_eval(0, {"gold_score": 50.0}) == {"gold_score": 50.0}


def _replay(cfg, hist):
    mon = Monitor(cfg)
    return [mon.after_step(i, h) for i, h in enumerate(hist, 1)]


def test_monitor_gold_alarm_at_evaluations(caplog):
    mon = Monitor(AlarmsConfig(window=2, gold_drop=8.0))
    assert mon.after_eval(0, {"gold_score": 60.0}) == {"gold_score": 60.0}  # one evaluation: nothing yet
    for i, r in enumerate([0.0, 0.2, 0.4, 0.6], 1):
        mon.after_step(i, {"reward": r})
    ev = mon.after_eval(2, {"gold_score": 90.0})
    assert ev["alarm_gold"] == 0 and mon.fired == []
    with caplog.at_level(logging.WARNING, logger="rlhf.alarms"):
        ev = mon.after_eval(4, {"gold_score": 80.0, "kl": 1.0})
    assert ev["alarm_gold"] == 1 and ev["kl"] == 1.0 and mon.fired == ["gold"]
    assert ev["alarm_gold_reward_then"] == pytest.approx(0.1) and ev["alarm_gold_reward"] == pytest.approx(0.5)
    assert "ALARM gold at step 4" in caplog.text
    assert mon.after_eval(5, {"gold_score": None}) == {"gold_score": None}  # no judge: no gold alarm


def test_report_lists_fired_alarms():
    spec = importlib.util.spec_from_file_location("report", ROOT / "scripts" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    rows = [{"step": 1, "kind": "train", "alarm_kl": 0, "alarm_kl_slope": 0.01},
            {"step": 2, "kind": "train", "alarm_kl": 1, "alarm_kl_slope": 0.25, "alarm_kl_now": 1.5},
            {"step": 3, "kind": "train", "alarm_kl": 1, "alarm_kl_slope": 0.3, "alarm_kl_now": 1.9}]
    lines = report.alarm_lines(rows, {"steps": 3, "stopped_early": "train.stop_on_alarm: alarm kl fired"})
    assert lines[0] == "- **kl** fired at step 2 (2 record(s) in all): slope 0.25, now 1.5"
    assert "stopped early after step 3: train.stop_on_alarm: alarm kl fired" in lines[1]
    assert report.alarm_lines(rows[:1], {"steps": 1}) == ["No alarm fired (kl)."]


def test_stop_on_alarm_saves_a_checkpoint_then_ends_cleanly(tiny_stages, tmp_path):
    """alarms.clipfrac=0 fires as soon as a window exists (a clip fraction is >= 0): the run stops
    after step 2 of 6 with a checkpoint, the final evaluation, the export and the summary. (The reward:
    the gold judge alone, so no reward model is loaded.)"""
    out = tmp_path / "o"
    proc = run_stage("ppo", f"output_dir={out}", f"actor.model={tiny_stages / 'sft'}", f"critic.model={tiny_stages / 'reward'}",
              "train.max_steps=6", "train.eval_every=0", "train.save_every=0", "rollout.prompts_per_step=8",
              "rollout.mini_batch_size=8", "rollout.micro_batch_size=8", "rollout.max_new_tokens=6",
              "eval.max_new_tokens=6", "data.num_eval_prompts=4", "alarms.window=2", "alarms.clipfrac=0",
              "train.stop_on_alarm=true", "reward.sources=[judge]",
              "engine.precision=fp32",  # on every host (auto runs bf16 on a CPU with native bf16): the gap bound is fp32's
              timeout=300)
    assert "reward: 1 x judge (no reward model loaded)" in proc.stdout + proc.stderr
    s = summary(out)
    assert s["steps"] == 2 and "clipfrac" in s["stopped_early"] and s["alarms_fired"]["clipfrac"] == 2
    train = metrics(out, "train")
    assert [r["step"] for r in train] == [1, 2]
    assert "alarm_clipfrac" not in train[0] and train[1]["alarm_clipfrac"] == 1
    assert [r["step"] for r in metrics(out, "eval")] == [0, 2]
    assert (out / "checkpoints" / "step_0000002" / "meta.json").is_file() and (out / "model" / "config.json").is_file()
    # no fault at the train <-> generate boundary: the sampler's log-probs are the scoring pass's (fp32)
    for r in train:
        assert r["gen_logprob_gap_max"] < 1e-4 and r["gen_kl"] < 1e-8 and r["alarm_gen"] == 0, r


def test_a_forced_sampler_trainer_gap_shows_in_the_metrics_and_fires_the_gen_alarm(tiny_stages, tmp_path):
    """The fault (#30): the sampler draws at temperature 1.0 while the scoring pass (rollout.temperature)
    uses 0.7: the real PPO app, its `sampling` patched in the child process. The gap is orders of
    magnitude above the no-fault run's (< 1e-4, previous test) and the gen alarm fires at step 1. The
    tiny model's next-token distributions are nearly flat, so its gen_kl is ~1e-3 (a peaked model's is
    ~0.1: tests/test_sampler_gap.py); alarms.gen_kl=1e-4 sits between the two runs. ppo.is_correction=tis
    runs on the gap (capped tokens counted)."""
    out = tmp_path / "o"
    code = ("import dataclasses, sys\nimport rlhf.ppo as P\norig = P.sampling\n"
            "P.sampling = lambda cfg: dataclasses.replace(orig(cfg), temperature=1.0)\n"
            "sys.argv = ['rlhf.ppo', *sys.argv[1:]]\nP.main()\n")
    proc = subprocess.run(
        [sys.executable, "-c", code, f"output_dir={out}", f"actor.model={tiny_stages / 'sft'}",
         f"critic.model={tiny_stages / 'reward'}", "train.max_steps=1", "train.eval_every=0", "train.save_every=0",
         "rollout.prompts_per_step=8", "rollout.mini_batch_size=8", "rollout.micro_batch_size=8",
         "rollout.max_new_tokens=6", "rollout.temperature=0.7", "eval.max_new_tokens=6", "data.num_eval_prompts=4",
         "reward.sources=[judge]", "alarms.gen_kl=1e-4", "ppo.is_correction=tis", "ppo.is_cap=1.05"],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = metrics(out, "train")
    assert r["gen_logprob_gap"] > 1e-2 and r["gen_logprob_gap_max"] > 3e-2 and r["gen_kl"] > 1e-4, r
    assert r["alarm_gen"] == 1 and r["alarm_gen_kl"] == r["gen_kl"]
    assert r["is_capped_tokens"] > 0 and 0 < r["is_weight_mean"] and r["is_weight_max"] <= 1.05 + 1e-6
    assert "ALARM gen at step 1: sampler and trainer disagree" in proc.stdout + proc.stderr
    assert summary(out)["alarms_fired"] == {"gen": 1}
