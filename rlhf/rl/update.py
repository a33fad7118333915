"""The RL update: the actor's loss (clipped surrogate + KL term + ptx) and the critic's (clipped value
loss), and the mini-batch steps that apply them (`update`). Each loss returns (loss summed over its
weight units, the weight, stats), as `engine.TrainEngine.train_step` takes it; the math is in
rlhf/algos/rl.py."""
from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from engine.distributed import all_reduce_sum
from rlhf.algos import rl as rl_math
from rlhf.config import PPOConfig
from rlhf.config.validate import rollout_rows, trainer_truncation
from rlhf.data import collate_sft
from rlhf.data.microbatch import trim_columns
from rlhf.data.tokenize import IGNORE_INDEX
from rlhf.data.stage import StepOrder
from rlhf.modeling.forward import sft_loss, token_logprobs, token_values
from rlhf.rl.experience import Experience
from rlhf.rl.models import Models
from rlhf.rl.rollout import batching_counts, budget_micro_batches


def make_actor_loss(cliprange: float, temperature: float, ptx_coef: float, *, cliprange_low: float | None = None,
                    cliprange_high: float | None = None, loss_agg: str = "token_mean", horizon: float | None = None,
                    kl_loss_coef: float | Callable[[], float] = 0.0, kl_loss_estimator: str = "k3", policy_loss: str = "clip",
                    is_correction: str = "none", is_cap: float = 2.0, is_low: float = 0.5, is_high: float = 2.0,
                    is_level: str = "token", truncate: tuple[int, float] | None = None):
    """The actor's loss: the registered `policy_loss` (rl_math.POLICY_LOSSES: clip, the clipped
    surrogate, ratio clipped to [1 - low, 1 + high], low/high defaulting to cliprange; gspo; cispo),
    aggregated by `loss_agg` (rl_math.aggregate_loss: sum over its weight units, so micro-batches and
    ranks combine into the whole mini-batch's aggregate; a per-sequence loss weighs rows), +
    kl_loss_coef x KL to the reference (aggregated alike; a callable: its value at each call, what
    ppo.adaptive_kl moves when the KL is in the loss), + ptx_coef x the SFT loss (weighted like
    the rest). `is_correction` tis|mis: the policy loss's per-token terms are weighted by
    rl_math.is_weights(logp_old vs the sampler's logp_gen), detached (rl_math.is_weighted_advantages).
    `truncate` (ppo.trainer_logprobs=sampler): (top_k, top_p) the new log-probs are taken under, as the old."""
    low = cliprange if cliprange_low is None else cliprange_low
    pl = rl_math.policy_loss_fn(policy_loss)
    given = {"cliprange_low": low, "cliprange_high": cliprange_high, "loss_agg": loss_agg, "horizon": horizon}
    options = {k: given[k] for k in pl.options}
    weight_agg = "seq_mean_token_mean" if pl.per_sequence else loss_agg

    def actor_loss(model: torch.nn.Module, mb: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
        logp, entropy = token_logprobs(model, mb, temperature, with_entropy=True, truncate=truncate)
        mask = mb["response_mask"]
        advantages = mb["advantages"]
        if is_correction != "none":
            if mb.get("logp_gen") is None:
                raise ValueError(f"ppo.is_correction={is_correction} needs the sampler's log-probs (logp_gen) "
                                 "in the experience; the rollout has none")
            w = rl_math.is_weights(is_correction, mb["logp_old"], mb["logp_gen"], mask, cap=is_cap, low=is_low,
                                   high=is_high, level=is_level)
            advantages = rl_math.is_weighted_advantages(advantages, w)
        loss, stats = pl.fn(logp, mb["logp_old"], advantages, mask, **options)
        n = rl_math.loss_weight(mask, weight_agg)  # tokens (token_mean) or rows
        # mb["global_weights"] (`update`): the mini-batch's global weight of each term, all-reduced once before
        # the forwards; each term then enters in the policy's units divided by its own global weight, so the
        # mini-batch's loss is the same however its rows are split into micro-batches and ranks. Without it, the
        # KL and ptx terms are this micro-batch's means, weighted by the policy's units.
        glob = mb.get("global_weights")
        coef = kl_loss_coef() if callable(kl_loss_coef) else kl_loss_coef
        total, kl_n = loss * n, None
        if coef:
            kl_sum, kl_n = rl_math.aggregate_loss(rl_math.kl_loss_tokens(logp, mb["logp_ref"], mask, kl_loss_estimator),
                                                   mask, loss_agg, horizon)
            kl = kl_sum / kl_n.clamp(min=1)
            scale = glob["policy"] / max(glob["kl"], 1.0) if glob else n / kl_n.clamp(min=1)
            total = total + coef * kl_sum * scale
            stats["kl_loss"] = kl.detach()
        stats["entropy"] = rl_math.masked_mean(entropy, mask)
        if ptx_coef:
            device = mb["sequences"].device
            ptx_sum, ptx_n = torch.zeros((), device=device), torch.zeros((), device=device)
            for batch in ptx_list(mb["ptx"]):  # a micro-batch may carry none, one or several SFT batches
                s, c, _ = sft_loss(model, {k: v.to(device) for k, v in batch.items()})
                ptx_sum, ptx_n = ptx_sum + s, ptx_n + c
            scale = glob["policy"] / max(glob["ptx"], 1.0) if glob else n / ptx_n.clamp(min=1)
            total = total + ptx_coef * ptx_sum * scale  # its mean enters the mini-batch mean like a token loss
            stats["ptx_loss"] = (ptx_sum / ptx_n.clamp(min=1)).detach()
        if glob:
            # NOTE: the engine averages a stat weighted by `n`; scaled here to its share of the mini-batch's mean
            # over its own units (tokens, rows, KL units, ptx tokens), each stat is that mean exactly whatever the
            # micro-batching (a micro-batch with n = 0, every response empty, adds only its ptx rows' share: lost)
            tokens, valid = mask.sum(), rl_math.loss_weight(mask, "seq_mean_token_mean")
            for k in stats:
                units, whole = ((valid, glob["rows"]) if k in pl.row_stats else (kl_n, glob["kl"]) if k == "kl_loss"
                                else (ptx_n, glob["ptx"]) if k == "ptx_loss" else (tokens, glob["tokens"]))
                stats[k] = stats[k] * units / n.clamp(min=1) * (glob["policy"] / max(whole, 1.0))
        return total, n, stats

    actor_loss.weight_agg = weight_agg  # the units `update` all-reduces for the policy term
    actor_loss.kl_agg = loss_agg
    return actor_loss


def make_critic_loss(cliprange_value: float):
    def critic_loss(model: torch.nn.Module, mb: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
        mask = mb["response_mask"]
        loss, stats = rl_math.value_loss(token_values(model, mb), mb["values"], mb["returns"], mask, cliprange_value)
        return loss * mask.sum(), mask.sum(), stats  # a token mean: its weight units are tokens

    return critic_loss


def actor_loss(cfg: PPOConfig, kl_loss_coef: Callable[[], float] | None = None):
    """The actor loss of `cfg`'s algorithm (make_actor_loss with the ppo.* keys; `kl_loss_coef`: the adaptive
    KL-loss coefficient instead of ppo.kl_loss_coef)."""
    p, r = cfg.ppo, cfg.rollout
    return make_actor_loss(p.cliprange, r.temperature, p.ptx_coef, cliprange_low=p.cliprange_low,
                           cliprange_high=p.cliprange_high, loss_agg=p.loss_agg, horizon=r.max_new_tokens,
                           kl_loss_coef=p.kl_loss_coef if kl_loss_coef is None else kl_loss_coef,
                           kl_loss_estimator=p.kl_loss_estimator,
                           policy_loss=p.policy_loss, is_correction=p.is_correction, is_cap=p.is_cap,
                           is_low=p.is_low, is_high=p.is_high, is_level=p.is_level, truncate=trainer_truncation(cfg))


def ptx_list(ptx) -> list[dict]:
    """A micro-batch's SFT batches for the ptx loss: a list (token budgets: none, one or several), or one batch."""
    return ptx if isinstance(ptx, list) else [ptx]


def ptx_tokens(ptx) -> float:
    """The ptx loss's weight units in a micro-batch's SFT batches: the target tokens (as sft_loss counts them)."""
    return float(sum((b["labels"][:, 1:] != IGNORE_INDEX).sum() for b in ptx_list(ptx)))


def global_weights(micro: list[dict], weight_agg: str, loss_agg: str) -> dict[str, float]:
    """The mini-batch's weight of each loss term over every rank, all-reduced once (a collective): policy (the
    actor loss's units, `weight_agg`), kl (ppo.loss_agg's), ptx (SFT target tokens), tokens (the critic's and
    the token stats'), rows (with a response token: the row stats')."""
    local = torch.zeros(5, dtype=torch.float64, device=micro[0]["response_mask"].device)
    for mb in micro:
        m = mb["response_mask"]
        local += torch.stack([rl_math.loss_weight(m, weight_agg).double(), rl_math.loss_weight(m, loss_agg).double(),
                              torch.tensor(ptx_tokens(mb["ptx"]) if "ptx" in mb else 0.0, dtype=torch.float64,
                                           device=local.device), m.sum().double(),
                              rl_math.loss_weight(m, "seq_mean_token_mean").double()])
    policy, kl, ptx, tokens, rows = all_reduce_sum(local).tolist()
    return {"policy": policy, "kl": kl, "ptx": ptx, "tokens": tokens, "rows": rows}


def micro_batches(exp: Experience, rows: list[int], r, models: Models) -> list[list[int]]:
    """One mini-batch's rows (this rank's) as micro-batches: rollout.micro_batch_size rows each, or by the
    rollout.micro_batch_tokens budget (rlhf/rl/rollout.py budget_micro_batches: as many on every rank, a
    prompt's rows together when its prompt runs once). Collective with a budget."""
    if r.micro_batch_tokens is None:
        return [rows[i : i + r.micro_batch_size] for i in range(0, len(rows), r.micro_batch_size)]
    idx = torch.tensor(rows, dtype=torch.long, device=exp.attention_mask.device)
    groups = exp.group[idx] if models.shared_prompts_update else None
    bins = budget_micro_batches(exp.attention_mask[idx], exp.prompt_len, r.micro_batch_tokens, groups=groups,
                                packed=models.pack_length is not None)
    return [[rows[i] for i in b] for b in bins]


def update(models: Models, exp: Experience, cfg: PPOConfig, losses: tuple, ptx_batches, run) -> tuple[list, list]:
    """The "update" step: `ppo.ppo_epochs` passes over shuffled mini-batches of this rank's rows, one
    actor (and critic) optimizer step per mini-batch; `ptx_batches()` gives the SFT rows of the ptx loss,
    mini_batch_size / world size / micro_batch_size batches per mini-batch whatever the micro-batching
    (with token budgets they are dealt round-robin to the micro-batches). Every loss term is normalised by
    its global weight, all-reduced once per mini-batch (`global_weights`). With token budgets the actor's stats
    get this rank's micro_batches, computed_tokens and real_tokens of the mini-batch (rlhf/rl/metrics.py)."""
    r, p, info = cfg.rollout, cfg.ppo, models.info
    rows = rollout_rows(r)  # prompts_per_step x n_samples_per_prompt; the batch sizes count rows
    per_rank, mini_rows = rows // info.world_size, r.mini_batch_size // info.world_size
    packed = models.pack_length is not None
    weight_agg, kl_agg = getattr(losses[0], "weight_agg", None), getattr(losses[0], "kl_agg", None)
    a_stats, c_stats = [], []
    for _ in range(p.ppo_epochs):
        perm = torch.randperm(per_rank).tolist()
        for k in range(rows // r.mini_batch_size):
            rows_k = perm[k * mini_rows : (k + 1) * mini_rows]
            bins = micro_batches(exp, rows_k, r, models)
            micro = [exp.rows(b) for b in bins]
            if r.micro_batch_tokens is not None:
                micro = [trim_columns(mb, exp.prompt_len) for mb in micro]  # each at its own width
            for mb in micro:
                mb["pack_length"] = models.pack_length  # the losses' forwards pack like the scoring's
                mb["shared_prompts"] = models.shared_prompts_update  # and share prompts (Models)
            if ptx_batches is not None:
                sft = [ptx_batches() for _ in range(max(mini_rows // r.micro_batch_size, 1))]
                for i, mb in enumerate(micro):
                    mb["ptx"] = sft[i :: len(micro)]
            known = None
            if weight_agg is not None:  # the actor loss of make_actor_loss: exact global normalisation
                gw = global_weights(micro, weight_agg, kl_agg)
                for mb in micro:
                    mb["global_weights"] = gw
                known = gw
            a_stats.append(models.actor.train_step(micro, losses[0], None if known is None else known["policy"]))
            if r.micro_batch_tokens is not None:  # the budgets' figures (row counts log none: as before)
                a_stats[-1].update(batching_counts(exp.attention_mask, exp.prompt_len, bins, packed=packed))
            if models.critic is not None:
                c_stats.append(models.critic.train_step(micro, losses[1], None if known is None else known["tokens"]))
            run.check(a_stats[-1], *c_stats[-1:])  # the critic's skips count toward the limit too
            if models.ema is not None:
                models.ema.update()
    return a_stats, c_stats


def ptx_batches(feats: list, order: StepOrder, first: int, info, pad_id: int) -> Callable[[], dict]:
    """The SFT micro-batches of one step's ptx loss, from position `first` on (a function of the step,
    so a resumed run reads the same rows)."""
    position = itertools.count(first)
    return lambda: collate_sft([feats[i] for i in order.rank_rows(next(position), info.rank, info.world_size, 1)[0]],
                               pad_id)
