"""One RL step's metrics over every rank's rows (a collective): reward, KL, response length, the losses'
statistics, skipped updates, the step's time split, and the sampler/trainer gap (`sampler_gap`)."""
from __future__ import annotations

from typing import Any

import torch

from engine.distributed import all_reduce_max, all_reduce_sum
from rlhf.algos import rl as rl_math
from rlhf.algos.rl import masked_sum
from rlhf.config import PPOAlgoConfig, PPOConfig
from rlhf.rl.experience import Experience
from rlhf.rl.rollout import Rollout


def step_metrics(rollout: Rollout, exp: Experience, a_stats: list, c_stats: list, cfg: PPOConfig, kl_coef: float,
                times: tuple[float, ...], dropped_groups: int = 0, old_from_sampler: bool = False,
                scoring: dict | None = None) -> dict[str, Any]:
    """One step's metrics over every rank's rows (a collective). reward: over the scored rows (not
    empty, finite); kl and response_len: over the rows in the update (those less the dropped groups').
    `old_from_sampler` (ppo.old_logprobs reused the sampler's log-probs): no trainer log-probs to set
    against the sampler's, so the sampler_gap figures are left out; `old_logprobs_sampler` says which.
    With token budgets (rollout.micro_batch_tokens), the forwards' batching: update_micro_batches (per rank, the
    step's optimizer steps together; equal on every rank), update_computed_per_real (the tokens the update's
    forwards computed over the real ones, every rank: 1 = no padding), and the same of the scoring pass from
    `scoring` (rlhf/rl/rollout.py batching_counts) as scoring_micro_batches, scoring_computed_per_real."""
    p = cfg.ppo
    nonfinite = rollout.nonfinite if rollout.nonfinite is not None else torch.zeros_like(rollout.empty)
    dropped = rollout.dropped if rollout.dropped is not None else torch.zeros_like(rollout.empty)
    failed = rollout.env_failed if rollout.env_failed is not None else torch.zeros_like(rollout.empty)
    kept = (~rollout.empty & ~nonfinite & ~failed).float()  # env_failed: a faulted episode (rl/multiturn.py)
    sums = all_reduce_sum(_stack([
        (exp.score * kept).sum(), (exp.score.clamp(-p.clip_reward_value, p.clip_reward_value) * kept).sum(),
        masked_sum(exp.kl, exp.response_mask, dim=1).sum(), exp.response_mask.sum(1).sum(), kept.sum(),
        rollout.empty.sum(), rollout.truncated.sum(), rollout.attention_mask.sum(),
        nonfinite.sum(), dropped.sum(), float(dropped_groups),
        sum(s.get("computed_tokens", 0) for s in a_stats), sum(s.get("real_tokens", 0) for s in a_stats),
        (scoring or {}).get("computed_tokens", 0), (scoring or {}).get("real_tokens", 0),
    ], exp.score.device).cpu()).tolist()
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
    if any("micro_batches" in s for s in a_stats):
        rec["update_micro_batches"] = sum(s.get("micro_batches", 0) for s in a_stats)
        rec["update_computed_per_real"] = sums[11] / max(sums[12], 1.0)
    if scoring:
        rec["scoring_micro_batches"] = scoring["micro_batches"]
        rec["scoring_computed_per_real"] = sums[13] / max(sums[14], 1.0)
    if p.ptx_coef:
        rec["ptx_loss"] = _mean(a_stats, "ptx_loss")
    if p.kl_loss_coef:
        rec["kl_loss"] = _mean(a_stats, "kl_loss")
    if p.dynamic_sampling:
        rec["dropped_groups"], rec["dropped_rows"] = int(sums[10]), int(sums[9])
    rec["old_logprobs_sampler"] = int(old_from_sampler)
    if not old_from_sampler:
        rec.update(sampler_gap(exp, p))
    return rec


def sampler_gap(exp: Experience, p: PPOAlgoConfig) -> dict[str, float]:
    """The sampler's log-probs against the scoring pass's (logp_old) on the response tokens of the
    update, over every rank (a collective; {} when the experience has no sampler log-probs). With
    d_t = logp_old_t - logp_gen_t (the trainer's minus the sampler's, same token):

        gen_logprob_gap      mean |d_t|                    gen_logprob_gap_max  max |d_t|
        gen_kl               mean exp(d_t) - d_t - 1       (k3 estimate of KL(sampler || trainer) per
                             token, from tokens the sampler drew: verl's `rollout_corr/k3_kl`,
                             verl/trainer/ppo/rollout_corr_helper.py; Schulman's k3)

    and with `ppo.is_correction` tis|mis the weights the actor loss applies (rl_math.is_weights):
    is_weight_mean / is_weight_max over the tokens, is_capped_tokens (tis: rho > is_cap),
    is_masked_tokens and is_masked_seqs (mis: weight 0; a response counts when all its tokens are).
    With top-k/top-p off the two sides compute one distribution and d is rounding (fp32 on CPU: < 1e-5,
    tests/test_sampler_gap.py); with them on, d also holds the truncation (the sampler's distribution
    is renormalised over the kept tokens, the trainer's is not), a real off-policy gap."""
    if exp.logp_gen is None:
        return {}
    m = exp.response_mask.bool()
    d = torch.where(m, exp.logp_old.float() - exp.logp_gen.float(), 0.0)
    k3 = torch.where(m, rl_math.kl_estimate(exp.logp_gen, exp.logp_old, "k3"), 0.0)
    sums = [d.abs().sum(), k3.sum(), m.sum()]
    maxes = [d.abs().max() if d.numel() else torch.zeros(())]
    if p.is_correction != "none":
        w = rl_math.is_weights(p.is_correction, exp.logp_old, exp.logp_gen, m, cap=p.is_cap, low=p.is_low,
                               high=p.is_high, level=p.is_level)
        rho = torch.exp(rl_math.sampler_log_ratio(exp.logp_old, exp.logp_gen, m, p.is_level))
        rejected = m & (w == 0)
        sums += [w.sum(), (m & (rho > p.is_cap)).sum() if p.is_correction == "tis" else torch.zeros(()),
                 rejected.sum(), (m.any(1) & (rejected.sum(1) == m.sum(1))).sum()]
        maxes.append(torch.where(m, w, 0.0).max() if w.numel() else torch.zeros(()))
    s = all_reduce_sum(_stack(sums, m.device)).tolist()
    mx = all_reduce_max(_stack(maxes, m.device)).tolist()
    n = max(s[2], 1.0)
    out = {"gen_logprob_gap": s[0] / n, "gen_logprob_gap_max": mx[0], "gen_kl": s[1] / n}
    if p.is_correction != "none":
        out.update(is_weight_mean=s[3] / n, is_weight_max=mx[1])
        if p.is_correction == "tis":
            out["is_capped_tokens"] = int(s[4])
        else:
            out.update(is_masked_tokens=int(s[5]), is_masked_seqs=int(s[6]))
    return out


def _stack(values: list, device: torch.device) -> torch.Tensor:
    """Scalars (tensors on any device, or Python numbers) as one float64 vector on `device`: one
    collective and one host copy for all of them; the rollout's tensors may sit on the CPU while the
    experience is on the GPU."""
    return torch.stack([torch.as_tensor(x).to(device=device, dtype=torch.float64) for x in values])


def _mean(stats: list[dict], key: str) -> float:
    vals = [s[key] for s in stats if key in s]
    return sum(vals) / len(vals) if vals else float("nan")
