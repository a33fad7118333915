"""The rollout: one rank's sampled responses, and the steps that read only them and the models' scores.

    rollout = generate(models.actor, prompts, group, sampling, eos_id, pad_id)   # sample responses
    scored = score_rollout(rollout.sequences, ..., actor=..., reference=..., critic=...)  # log-probs, values
    mask_nonfinite(rollout, scored)            # a NaN/inf row leaves the update, counted and named
    drop_uniform_groups(rollout, score)        # DAPO's dynamic sampling (ppo.dynamic_sampling)

Layout (P = prompt width, T = response width), every tensor one rank's rows:
    sequences, attention_mask                 [B, P+T]  prompts LEFT-padded, responses right-padded
    responses, response_mask                  [B, T]    column t = response token t
    logp_gen                                  [B, T]    the sampler's log-prob of token t (0 off-mask)
    group, empty, truncated                   [B]       the prompt row answered; what became of the row
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from engine.distributed import all_reduce_max
from engine.inference import stream_seed
from rlhf.algos.rl import uniform_groups
from rlhf.data.microbatch import bin_cost, pad_response, row_extents, token_budget_bins, trim_columns
from rlhf.modeling.forward import position_ids_from_mask, token_logprobs, token_values

logger = logging.getLogger("rlhf.ppo")


@dataclass
class Rollout:
    """What generation mode returns for one rank's prompts."""

    sequences: torch.Tensor      # [B, P+T]
    attention_mask: torch.Tensor  # [B, P+T]
    response_mask: torch.Tensor  # [B, T] real response tokens; empty responses masked out entirely
    responses: torch.Tensor      # [B, T]
    prompt_len: int
    group: torch.Tensor          # [B] the dataset row of each prompt: the n samples of one prompt share it
    empty: torch.Tensor          # [B] bool: nothing said before the EOS (dropped from the update)
    truncated: torch.Tensor      # [B] bool: hit max_new_tokens without an EOS
    nonfinite: torch.Tensor | None = None  # [B] bool: a model scored it NaN/inf (dropped; mask_nonfinite)
    dropped: torch.Tensor | None = None  # [B] bool: its group's scores were all equal (drop_uniform_groups)
    # [B, T] the sampler's log-probs of the tokens it drew (the distribution it drew from: temperature,
    # top-k/top-p applied and renormalised; SamplingParams), 0 off the response mask; None when the
    # generation was asked for none (evaluation)
    logp_gen: torch.Tensor | None = None
    # Multi-turn episodes (rlhf/rl/multiturn.py; None for single-turn rollouts). The response region then
    # holds the model's turns and the observations inserted between them (with the template's glue);
    # response_mask is 1 on the policy's own tokens only, so observations and glue are out of the policy
    # loss, the KL and the critic's targets. answer_mask [B, T]: the last model turn's tokens, what the text
    # reward sources (judge, answer, function, http) read as the response; env_failed [B] bool: the
    # environment faulted (raised, timed out, garbage, worker died): the row is masked out of the update.
    answer_mask: torch.Tensor | None = None
    env_failed: torch.Tensor | None = None

    @classmethod
    def from_generation(cls, g: Any, group: torch.Tensor, eos_id: int, max_new_tokens: int, *,
                        drop_empty: bool = True) -> Rollout:
        """The rollout of a generation result `g` (engine.generation's: sequences, attention_mask,
        responses, response_mask, prompt_len): which rows are empty or truncated, and with
        `drop_empty` the empty rows' response mask zeroed (they leave the update)."""
        empty = empty_responses(g.responses, g.response_mask, [eos_id])
        eos = torch.tensor([eos_id], device=g.responses.device)
        truncated = (~empty) & (g.response_mask.sum(1) == max_new_tokens) & ~torch.isin(g.responses[:, -1], eos)
        response_mask = g.response_mask.masked_fill(empty[:, None], 0) if drop_empty else g.response_mask
        logp_gen = getattr(g, "logprobs", None)
        if logp_gen is not None:
            logp_gen = torch.where(g.response_mask.bool(), logp_gen.float(), 0.0)
        return cls(sequences=g.sequences, attention_mask=g.attention_mask, response_mask=response_mask,
                   responses=g.responses, prompt_len=g.prompt_len, group=group.to(g.sequences.device), empty=empty,
                   truncated=truncated, logp_gen=logp_gen)



def empty_responses(responses: torch.Tensor, response_mask: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """[B] bool: rows whose response has no token before its EOS (nothing was said)."""
    first_is_eos = torch.isin(responses[:, 0], torch.tensor(eos_ids, device=responses.device))
    return (response_mask.sum(1) == 0) | first_is_eos


@torch.no_grad()
def generate(actor, prompts: dict, group: torch.Tensor, sampling, eos_id: int, pad_id: int,
             row_seeds: torch.Tensor | None = None) -> Rollout:
    """Sample responses to `prompts` (collated, left-padded) in the actor engine's generation mode, with
    the sampler's log-probs (`Rollout.logp_gen`: the step's gen_logprob_gap and ppo.is_correction);
    `row_seeds` [B]: each row's own sampling stream (`rollout_seeds`; engine.deterministic)."""
    device = actor.info.device
    with actor.generation() as gen:
        g = gen.generate(prompts["input_ids"].to(device), prompts["attention_mask"].to(device), sampling,
                         eos_token_id=eos_id, pad_token_id=pad_id, return_logprobs=True,
                         **({} if row_seeds is None else {"row_seeds": row_seeds.to(device)}))
    return Rollout.from_generation(g, group, eos_id, sampling.max_new_tokens)


def rollout_seeds(seed: int, step: int, rows: list[int], n_samples: int) -> torch.Tensor:
    """[B] per-row sampling seeds of one step's rollout rows (`rows`: the dataset row of each, each prompt's
    `n_samples` samples in a row): stream_seed(seed, step, prompt row, sample index), so a response's
    draws depend on what it answers and not on its batch, rank or position (engine.deterministic)."""
    return torch.tensor([stream_seed(seed, step, row, k % n_samples) for k, row in enumerate(rows)], dtype=torch.long)


# What each scored quantity comes from, for the message that names it.
SCORED_BY = {"score": "the reward source", "logp_old": "the actor", "logp_ref": "the reference", "values": "the critic"}


def mask_nonfinite(rollout: Rollout, scored: dict[str, torch.Tensor]) -> dict[str, int]:
    """Rows where a model gave a non-finite value (score [B], or log-prob/value [B, T] on a response
    token) are dropped from the update: their response mask is zeroed and the values set to 0, so
    rewards, advantages and whitening stay finite for the other rows. In place; sets
    `rollout.nonfinite`; returns {quantity: rows} (this rank's) for the ones that had any."""
    bad, counts = nonfinite_rows(scored, rollout.response_mask)
    rollout.response_mask = rollout.response_mask.masked_fill(bad[:, None], 0)
    rollout.nonfinite = bad
    return counts


def nonfinite_rows(scored: dict[str, torch.Tensor], response_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, int]]:
    """[B] bool: the rows with a non-finite score or response-token value, and {quantity: rows};
    those values are set to 0 in `scored` (in place); one WARN line names the models."""
    mask = response_mask.bool()
    bad = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    counts = {}
    for key in SCORED_BY:
        t = scored.get(key)
        if t is None:
            continue
        finite = torch.isfinite(t)
        rows = ~finite if t.dim() == 1 else (~finite & mask).any(1)
        if rows.any():
            counts[key] = int(rows.sum())
            bad |= rows
        scored[key] = torch.where(finite, t, torch.zeros_like(t))
    if counts:
        logger.warning("%s: non-finite values, those rows left out (of the update, or of the held-out figures)", ", ".join(
            f"{n} row(s) from {SCORED_BY[k]} ({k})" for k, n in counts.items()))
    return bad, counts


def drop_uniform_groups(rollout: Rollout, score: torch.Tensor) -> int:
    """Dynamic sampling (DAPO), without the re-sampling: the rows of every prompt group whose valid
    rows' scores are all equal leave the update (their response mask is zeroed; an outcome
    estimator would give them advantage 0, so they carry no signal and only dilute the loss). Groups
    are whole on each rank. In place; sets `rollout.dropped` [B]; returns this rank's dropped groups."""
    valid = rollout.response_mask.bool().any(1)
    uniform = uniform_groups(score, rollout.group, valid) & valid
    rollout.response_mask = rollout.response_mask.masked_fill(uniform[:, None], 0)
    rollout.dropped = uniform
    return int(torch.unique(rollout.group[uniform]).numel())


def budget_micro_batches(attention_mask: torch.Tensor, prompt_len: int, budget: int, *,
                         groups: torch.Tensor | None = None, packed: bool = False) -> list[list[int]]:
    """This rank's rows (of a [B, P+T] rollout batch) in micro-batches of at most `budget` computed tokens
    (rollout.micro_batch_tokens; rlhf/data/microbatch.py token_budget_bins), as many on every rank: the
    ranks' counts are all-reduced (max) and each rank splits its costliest micro-batches up to it
    (collective). `groups` [B]: rows kept together (a prompt's samples, rollout.shared_prompt_forward).
    A unit over the budget runs alone, logged."""
    prompt, extent = row_extents(attention_mask, prompt_len)
    g = None if groups is None else groups.tolist()
    bins = token_budget_bins(prompt, extent, budget, groups=g, packed=packed)
    count = torch.tensor([len(bins)], dtype=torch.long, device=attention_mask.device)
    bins = token_budget_bins(prompt, extent, budget, groups=g, packed=packed, min_bins=int(all_reduce_max(count)))
    over = [b for b in bins if bin_cost(prompt, extent, b, packed) > budget]
    if over:
        logger.warning("rollout.micro_batch_tokens=%d: %d micro-batch(es) of one %s over the budget run alone "
                       "(costs %s tokens)", budget, len(over), "row" if groups is None else "prompt group",
                       [bin_cost(prompt, extent, b, packed) for b in over])
    return bins


def batching_counts(attention_mask: torch.Tensor, prompt_len: int, bins: list[list[int]], *, trimmed: bool = True,
                    packed: bool = False) -> dict[str, int]:
    """{micro_batches, computed_tokens, real_tokens} of this rank's forwards over `bins` (row indices of
    `attention_mask` [B, P+T]): computed at each micro-batch's trimmed width (rlhf/data/microbatch.py
    bin_cost), the full width P+T when not `trimmed`, the real tokens when `packed`. What the step's padding
    share is made of."""
    prompt, extent = row_extents(attention_mask, prompt_len)
    real = attention_mask.sum(1).tolist()
    width = attention_mask.shape[1]
    computed = sum(sum(real[i] for i in b) if packed else bin_cost(prompt, extent, b) if trimmed else len(b) * width
                   for b in bins)
    return {"micro_batches": len(bins), "computed_tokens": int(computed),
            "real_tokens": int(sum(real[i] for b in bins for i in b))}


@torch.no_grad()
def score_rollout(sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, *,
                  actor: torch.nn.Module | None, reference: torch.nn.Module, critic: torch.nn.Module | None,
                  micro_batch_size: int, temperature: float, pack_length: int | None = None,
                  shared_prompts: bool = False, truncate: tuple[int, float] | None = None,
                  micro_batch_tokens: int | None = None, group: torch.Tensor | None = None,
                  batching: dict | None = None) -> dict[str, torch.Tensor]:
    """Old log-probs (without an actor: none, the caller has the sampler's), reference log-probs and values
    (without a critic: none), in batches of `micro_batch_size` rows (rollout.score_batch_size), and the
    position ids they used; the scores come from a reward source (rlhf/rl/rewards.py).

    Every rank runs the same number of forwards (FSDP all-gathers inside them are collective).
    `micro_batch_tokens` (rollout.micro_batch_tokens, not None): micro-batches by that budget of computed
    tokens instead (`budget_micro_batches`; with `shared_prompts` a prompt's rows, `group` [B], stay
    together), each forward at its own trimmed width, the outputs padded back to [B, T].
    `pack_length` (not None): each forward runs on the micro-batch's real tokens packed (`Repacked`).
    `shared_prompts` (rollout.shared_prompt_forward): a prompt several rows of a forward share runs once.
    `truncate` (ppo.trainer_logprobs=sampler): (top_k, top_p) applied to the logits as the sampler did.
    `batching` (a dict): gets this rank's `batching_counts` of the forwards.
    """
    B, T = sequences.shape[0], sequences.shape[1] - prompt_len
    base = {"sequences": sequences, "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask), "prompt_len": prompt_len, "pack_length": pack_length,
            "shared_prompts": shared_prompts}
    packed = pack_length is not None
    if micro_batch_tokens is None:
        bins = [list(range(s, min(s + micro_batch_size, B))) for s in range(0, B, micro_batch_size)]
    else:
        bins = budget_micro_batches(attention_mask, prompt_len, micro_batch_tokens,
                                    groups=group if shared_prompts else None, packed=packed)
    parts: dict[str, list[torch.Tensor]] = {"logp_old": [], "logp_ref": [], "values": []}
    for rows in bins:
        if micro_batch_tokens is None:
            mb = {k: (v[rows[0] : rows[-1] + 1] if torch.is_tensor(v) else v) for k, v in base.items()}
        else:
            mb = trim_columns(base, prompt_len, rows)
        if actor is not None:
            parts["logp_old"].append(pad_response(token_logprobs(actor, mb, temperature, truncate=truncate), T))
        parts["logp_ref"].append(pad_response(token_logprobs(reference, mb, temperature, truncate=truncate), T))
        if critic is not None:
            parts["values"].append(pad_response(token_values(critic, mb), T))
    order = torch.tensor([i for rows in bins for i in rows], dtype=torch.long, device=sequences.device)
    out = {}
    for k, v in parts.items():
        if v:
            cat = torch.cat(v)
            out[k] = cat if micro_batch_tokens is None else torch.empty_like(cat).index_copy_(0, order, cat)
    out["position_ids"] = base["position_ids"]
    if batching is not None:
        batching.update(batching_counts(attention_mask, prompt_len, bins, trimmed=micro_batch_tokens is not None,
                                        packed=packed))
    return out
