"""Reward-hacking alarms: pure functions over a run's metric history, and the monitor the RL loop keeps.

A policy that games its reward shows it in the figures every step already logs, before the gold
score (when there is one) says so. Five alarms (thresholds: `alarms.*` in rlhf/config/schema.py), each
computed from the last `alarms.window` steps W, against the first `window` steps B (the baseline),
a sixth on the reward ensemble's disagreement, and a seventh on the train <-> generate boundary,
checked on each step alone:

    kl        KL to the reference grows fast:   least-squares slope of the rollouts' KL over W
                                                >= alarms.kl_slope (nats per response, per step)
    entropy   the policy's entropy collapses:   mean(W) <= alarms.entropy_ratio x mean(B)
    length    the response length drifts:       |mean(W) / mean(B) - 1| >= alarms.length_drift
    clipfrac  the updates are clipped a lot:    mean clip fraction over W >= alarms.clipfrac
    gold      reward up, gold down (only with a gold judge, checked at each evaluation): the held-out
              gold score is >= alarms.gold_drop points below its best earlier value while the
              training reward (mean of the `window` steps before each evaluation) is above its value
              at that best evaluation
    disagreement  the reward ensemble's members disagree more and more (reward.ensemble_models): the mean
              of the step's reward_disagreement (the members' std per response) over W >= alarms.disagreement_ratio
              x its mean over B: the policy moves where the reward models no longer agree, the over-optimisation
              of a learned reward that an ensemble can see before a gold judge does (Eisenstein et al. 2023)
    gen       the sampler and the trainer disagree on the sampled tokens' log-probs: the step's gen_kl
              (k3 KL(sampler || trainer) per token, rlhf/rl/metrics.py sampler_gap) >= alarms.gen_kl.
              Not a trend: a weight that did not reach the sampler, or a temperature applied on one side
              only, shows at once (its figures: kl, gap = mean |logp_old - logp_gen|, gap_max)

    tools     (multi-turn runs, rollout.env) tool use or episode length collapses: the mean tool calls or
              model turns per episode over W <= alarms.tool_collapse x their mean over B (a policy that
              stops calling its tool, or answers in one turn, is gaming or losing what the tool gave)

`entropy`, `length`, `tools` and `disagreement` need 2 x window steps (W and B apart); the others `window` steps (gold: two
evaluations). Every computed alarm adds `alarm_<name>` (0 or 1) and its figures
(`alarm_<name>_<figure>`) to the step's train record (gold: to the evaluation's record); one that
fires, having been quiet, logs one WARN line with the numbers. `train.stop_on_alarm=true` then ends
the run cleanly (a checkpoint first; rlhf/run/stage.py `Run.stop`).

    monitor = Monitor(cfg.alarms)
    rec.update(monitor.after_step(step, rec))     # in the loop, every step (rec: the step's metrics)
    ev = monitor.after_eval(step, ev)             # wraps each evaluation
    monitor.fired                                  # names fired at the last check; monitor.first_fired
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlhf.config import AlarmsConfig

logger = logging.getLogger("rlhf.alarms")

# what the history keeps per step
TRAIN_KEYS = ("reward", "kl", "entropy", "response_len", "clipfrac", "gen_kl", "gen_logprob_gap",
              "gen_logprob_gap_max", "tool_calls", "turns", "reward_disagreement")
NAMES = ("kl", "entropy", "length", "clipfrac", "gold", "gen", "tools", "disagreement")


@dataclass(frozen=True)
class Alarm:
    name: str
    fired: bool
    figures: dict[str, float]
    text: str  # the WARN line's body: what happened, with the numbers and the threshold


def _finite(xs: Sequence[float]) -> list[float]:
    return [float(x) for x in xs if x is not None and math.isfinite(x)]


def _mean(xs: Sequence[float]) -> float | None:
    xs = _finite(xs)
    return sum(xs) / len(xs) if xs else None


def slope(ys: Sequence[float]) -> float:
    """Least-squares slope of ys against 0, 1, 2, ... (per step); a NaN is left out (its step kept);
    0 for fewer than two finite points."""
    pts = [(i, float(y)) for i, y in enumerate(ys) if y is not None and math.isfinite(y)]
    n = len(pts)
    if n < 2:
        return 0.0
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


# ----------------------------------------------------------------------------- the alarms (pure)


def kl_growth(kl: Sequence[float], window: int, threshold: float) -> Alarm | None:
    """KL per step (one value per step, oldest first): its slope over the last `window` steps."""
    w = _finite(kl[-window:])
    if len(kl) < window or len(w) < 2:
        return None
    s = slope(kl[-window:])
    return Alarm("kl", s >= threshold, {"slope": s, "now": w[-1]},
                 f"KL to the reference grows {s:.4f} nats/step over the last {window} steps (now {w[-1]:.3f}; "
                 f"alarms.kl_slope={threshold})")


def _vs_baseline(xs: Sequence[float], window: int) -> tuple[float, float] | None:
    """(the first window's mean, the last window's), once there are two windows and both are positive."""
    if len(xs) < 2 * window:
        return None
    base, now = _mean(xs[:window]), _mean(xs[-window:])
    return None if base is None or now is None or base <= 0 else (base, now)


def entropy_collapse(entropy: Sequence[float], window: int, ratio: float) -> Alarm | None:
    """Policy entropy per step: the last window's mean against the first window's."""
    if (means := _vs_baseline(entropy, window)) is None:
        return None
    base, now = means
    r = now / base
    return Alarm("entropy", r <= ratio, {"ratio": r, "now": now, "baseline": base},
                 f"policy entropy collapsed to {r:.2f}x its start ({now:.4f} vs {base:.4f} over the first "
                 f"{window} steps; alarms.entropy_ratio={ratio})")


def length_drift(lengths: Sequence[float], window: int, drift: float) -> Alarm | None:
    """Mean response length per step: the last window's mean against the first window's."""
    if (means := _vs_baseline(lengths, window)) is None:
        return None
    base, now = means
    d = now / base - 1
    return Alarm("length", abs(d) >= drift, {"drift": d, "now": now, "baseline": base},
                 f"response length drifted {d:+.0%} ({now:.2f} vs {base:.2f} tokens over the first {window} steps; "
                 f"alarms.length_drift={drift})")


def tool_collapse(tool_calls: Sequence[float], turns: Sequence[float], window: int, ratio: float) -> Alarm | None:
    """Tool calls and model turns per episode, per step (NaN / missing for a single-turn run): each one's last
    window's mean against its first window's; fires when either fell to `ratio` x its baseline or below."""
    found = {name: m for name, xs in (("tool_calls", tool_calls), ("turns", turns))
             if (m := _vs_baseline(xs, window)) is not None}
    if not found:
        return None
    ratios = {name: now / base for name, (base, now) in found.items()}
    worst = min(ratios, key=ratios.get)
    base, now = found[worst]
    return Alarm("tools", ratios[worst] <= ratio, {f"{k}_ratio": v for k, v in ratios.items()},
                 f"{worst.replace('_', ' ')} per episode collapsed to {ratios[worst]:.2f}x its start ({now:.3f} vs "
                 f"{base:.3f} over the first {window} steps; alarms.tool_collapse={ratio})")


def disagreement_growth(std: Sequence[float], window: int, ratio: float) -> Alarm | None:
    """The reward ensemble's disagreement per step (mean std of its members' scores; NaN or missing
    without an ensemble): the last window's mean against the first window's."""
    if (means := _vs_baseline(std, window)) is None:
        return None
    base, now = means
    r = now / base
    return Alarm("disagreement", r >= ratio, {"ratio": r, "now": now, "baseline": base},
                 f"the reward ensemble's disagreement grew {r:.2f}x ({now:.4f} vs {base:.4f} over the first {window} "
                 f"steps; alarms.disagreement_ratio={ratio}): the policy is where the reward models no longer agree")


def clip_high(clipfrac: Sequence[float], window: int, threshold: float) -> Alarm | None:
    """Policy clip fraction per step: its mean over the last `window` steps."""
    m = _mean(clipfrac[-window:])
    if len(clipfrac) < window or m is None:
        return None
    return Alarm("clipfrac", m >= threshold, {"mean": m},
                 f"clip fraction {m:.3f} over the last {window} steps (alarms.clipfrac={threshold})")


def sampler_trainer_gap(gen_kl: Sequence[float], gap: Sequence[float], gap_max: Sequence[float],
                        threshold: float) -> Alarm | None:
    """The last step's gen_kl (and its mean / max |log-prob gap|, reported with it) against `threshold`;
    None when the step has no sampler log-probs (NaN or missing)."""
    if not gen_kl or not _finite(gen_kl[-1:]):
        return None
    kl, g, gm = float(gen_kl[-1]), _mean(gap[-1:]), _mean(gap_max[-1:])
    g, gm = (math.nan if g is None else g), (math.nan if gm is None else gm)
    return Alarm("gen", kl >= threshold, {"kl": kl, "gap": g, "gap_max": gm},
                 f"sampler and trainer disagree on the sampled tokens: gen_kl {kl:.4g} nats/token, mean |log-prob "
                 f"gap| {g:.4g}, max {gm:.4g} (alarms.gen_kl={threshold}; a weight or a sampling setting differs "
                 f"between generation and scoring, or top-k/top-p truncate the sampler's distribution)")


def reward_up_gold_down(reward: Sequence[float], gold: Sequence[tuple[int, float]], window: int,
                        drop: float) -> Alarm | None:
    """`reward[i]`: the training reward of step i + 1; `gold`: (step, gold score) of each evaluation
    so far (step 0 = before training). Compares the last evaluation with the best earlier one; the
    training reward "at" step s is the mean over steps max(1, s - window + 1) .. max(s, window)
    (an evaluation before training takes the first `window` steps)."""
    if len(gold) < 2:
        return None

    def reward_at(step: int) -> float | None:
        hi = min(max(step, window), len(reward))
        return _mean(reward[max(0, hi - window) : hi])

    best_step, best = max(gold[:-1], key=lambda g: (g[1], -g[0]))  # the earliest best
    step, now = gold[-1]
    r_then, r_now = reward_at(best_step), reward_at(step)
    if r_then is None or r_now is None:
        return None
    fell = best - now
    return Alarm("gold", fell >= drop and r_now > r_then,
                 {"drop": fell, "now": now, "best": best, "reward": r_now, "reward_then": r_then},
                 f"training reward rose {r_then:.3f} -> {r_now:.3f} while the held-out gold score fell "
                 f"{best:.1f} -> {now:.1f} (step {best_step} -> {step}; alarms.gold_drop={drop})")


def train_alarms(history: Sequence[dict], cfg: AlarmsConfig) -> list[Alarm]:
    """The per-step alarms over `history` (one dict of TRAIN_KEYS per step, oldest first)."""
    col = {k: [h.get(k, math.nan) for h in history] for k in TRAIN_KEYS}
    w = cfg.window
    found = (kl_growth(col["kl"], w, cfg.kl_slope), entropy_collapse(col["entropy"], w, cfg.entropy_ratio),
             length_drift(col["response_len"], w, cfg.length_drift), clip_high(col["clipfrac"], w, cfg.clipfrac),
             sampler_trainer_gap(col["gen_kl"], col["gen_logprob_gap"], col["gen_logprob_gap_max"], cfg.gen_kl),
             tool_collapse(col["tool_calls"], col["turns"], w, cfg.tool_collapse),
             disagreement_growth(col["reward_disagreement"], w, cfg.disagreement_ratio))
    return [a for a in found if a is not None]


def record(alarms: Sequence[Alarm]) -> dict[str, float]:
    """metrics.jsonl fields: alarm_<name> (0/1) and alarm_<name>_<figure>."""
    out: dict[str, float] = {}
    for a in alarms:
        out[f"alarm_{a.name}"] = int(a.fired)
        out.update({f"alarm_{a.name}_{k}": v for k, v in a.figures.items()})
    return out


# ----------------------------------------------------------------------------- the monitor (state)


class Monitor:
    """The history the alarms read (checkpointed with the run: `state_dict`), and the WARN lines."""

    def __init__(self, cfg: AlarmsConfig):
        self.cfg = cfg
        self.history: list[dict] = []          # TRAIN_KEYS of every step so far
        self.gold: list[tuple[int, float]] = []  # (step, gold score) of every evaluation with a judge
        self.quiet: dict[str, bool] = {n: True for n in NAMES}
        self.first_fired: dict[str, int] = {}  # name -> the first step it fired
        self.fired: list[str] = []             # names that fired at the last check

    def after_step(self, step: int, rec: dict[str, Any]) -> dict[str, float]:
        """Record step `step` (1-based) and check the per-step alarms; returns the record's alarm fields."""
        self.history.append({k: rec.get(k) for k in TRAIN_KEYS})
        return self._check(step, train_alarms(self.history, self.cfg)) if self.cfg.enabled else {}

    def after_eval(self, step: int, ev: dict[str, Any]) -> dict[str, Any]:
        """Record an evaluation's gold score (when it has one) and check the gold alarm; `ev` + alarm fields."""
        if not self.cfg.enabled or ev.get("gold_score") is None:
            self.fired = []
            return ev
        self.gold = [g for g in self.gold if g[0] < step] + [(step, float(ev["gold_score"]))]
        reward = [h.get("reward") for h in self.history[:step]]
        alarm = reward_up_gold_down(reward, self.gold, self.cfg.window, self.cfg.gold_drop)
        return {**ev, **self._check(step, [alarm] if alarm else [])}

    def _check(self, step: int, alarms: list[Alarm]) -> dict[str, float]:
        self.fired = [a.name for a in alarms if a.fired]
        for a in alarms:
            if a.fired and self.quiet[a.name]:
                logger.warning("ALARM %s at step %d: %s", a.name, step, a.text)
                self.first_fired.setdefault(a.name, step)
            self.quiet[a.name] = not a.fired
        return record(alarms)

    def state_dict(self) -> dict:
        return {"history": [dict(h) for h in self.history], "gold": list(self.gold), "quiet": dict(self.quiet),
                "first_fired": dict(self.first_fired)}

    def load_state_dict(self, state: dict) -> None:
        self.history, self.gold = list(state["history"]), [tuple(g) for g in state["gold"]]
        # an alarm added since the checkpoint was written starts quiet
        self.quiet = {**{n: True for n in NAMES}, **state["quiet"]}
        self.first_fired = {k: int(v) for k, v in state["first_fired"].items()}


def stop_run(run, monitor: Monitor, stop_on_alarm: bool) -> None:
    """train.stop_on_alarm: end `run` (rlhf/run/stage.py Run.stop) after this step when an alarm fired
    (the same figures on every rank, so every rank stops)."""
    if stop_on_alarm and monitor.fired:
        run.stop(f"train.stop_on_alarm: alarm {', '.join(monitor.fired)} fired")
