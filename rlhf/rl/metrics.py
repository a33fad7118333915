"""One RL step's metrics over every rank's rows (a collective): reward, KL, response length, the losses'
statistics, skipped updates, and the step's time split."""
from __future__ import annotations

from typing import Any

import torch

from engine.distributed import all_reduce_sum
from rlhf.algos.rl import masked_sum
from rlhf.config import PPOConfig
from rlhf.rl.experience import Experience
from rlhf.rl.rollout import Rollout


def step_metrics(rollout: Rollout, exp: Experience, a_stats: list, c_stats: list, cfg: PPOConfig, kl_coef: float,
                times: tuple[float, ...], dropped_groups: int = 0) -> dict[str, Any]:
    """One step's metrics over every rank's rows (a collective). reward: over the scored rows (not
    empty, finite); kl and response_len: over the rows in the update (those less the dropped groups')."""
    p = cfg.ppo
    nonfinite = rollout.nonfinite if rollout.nonfinite is not None else torch.zeros_like(rollout.empty)
    dropped = rollout.dropped if rollout.dropped is not None else torch.zeros_like(rollout.empty)
    kept = (~rollout.empty & ~nonfinite).float()
    sums = all_reduce_sum(torch.stack([
        (exp.score * kept).sum(), (exp.score.clamp(-p.clip_reward_value, p.clip_reward_value) * kept).sum(),
        masked_sum(exp.kl, exp.response_mask, dim=1).sum(), exp.response_mask.sum(1).sum(), kept.sum(),
        rollout.empty.sum(), rollout.truncated.sum(), torch.tensor(float(rollout.attention_mask.sum())),
        nonfinite.sum(), dropped.sum(), torch.tensor(float(dropped_groups)),
    ]).double().cpu()).tolist()
    n_kept, n_update = max(sums[4], 1.0), max(sums[4] - sums[9], 1.0)
    t0, t1, t2, t3 = times
    rec = {
        "reward": sums[0] / n_kept, "reward_clipped": sums[1] / n_kept, "kl": sums[2] / n_update,
        "kl_coef": kl_coef, "response_len": sums[3] / n_update, "empty_responses": int(sums[5]),
        "truncated_responses": int(sums[6]), "nonfinite_rows": int(sums[8]),
        "actor_loss": _mean(a_stats, "loss"), "critic_loss": _mean(c_stats, "loss"),
        "entropy": _mean(a_stats, "entropy"), "clipfrac": _mean(a_stats, "clipfrac"),
        "approx_kl": _mean(a_stats, "approx_kl"), "value_error": _mean(c_stats, "value_error"),
        "vf_clipfrac": _mean(c_stats, "vf_clipfrac"), "actor_grad_norm": _mean(a_stats, "grad_norm"),
        "critic_grad_norm": _mean(c_stats, "grad_norm"), "actor_lr": a_stats[-1]["lr"],
        "skipped_updates": sum(bool(s["skipped"]) for s in a_stats + c_stats),  # non-finite or empty
        "generation_s": t1 - t0, "scoring_s": t2 - t1, "training_s": t3 - t2,
        "tokens_per_s": sums[7] / max(t3 - t0, 1e-9),
    }
    if p.ptx_coef:
        rec["ptx_loss"] = _mean(a_stats, "ptx_loss")
    if p.kl_loss_coef:
        rec["kl_loss"] = _mean(a_stats, "kl_loss")
    if p.dynamic_sampling:
        rec["dropped_groups"], rec["dropped_rows"] = int(sums[10]), int(sums[9])
    return rec


def _mean(stats: list[dict], key: str) -> float:
    vals = [s[key] for s in stats if key in s]
    return sum(vals) / len(vals) if vals else float("nan")
