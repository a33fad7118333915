"""The RL step's experience, as named steps: generate -> score -> rewards -> advantages -> (update).

    models = Models(cfg, tok, info, n_updates)            # actor, critic (if the estimator needs one), ref, reward
    rollout = generate(models.actor, prompts, group, sampling, eos_id, pad_id)   # sample responses
    scored = models.score(rollout, cfg)                                           # rlhf/rollout.py: the 4 models
    exp = build_experience(rollout..., scored, kl_coef=..., estimator="gae", ...) # rewards + advantages
    a_stats, c_stats = update(models, exp, cfg, (actor_loss, critic_loss), ptx, run)  # mini-batch steps
    record = step_metrics(rollout, exp, a_stats, c_stats, cfg, kl_coef, times)    # over all ranks

Every tensor is one rank's rows. Layout (P = prompt width, T = response width):
    sequences, attention_mask, position_ids   [B, P+T]  prompts LEFT-padded, responses right-padded
    response_mask, logp_old, logp_ref, values,
    rewards, kl, advantages, returns          [B, T]    column t = response token t
    score, group                              [B]       reward model's score; the prompt answered
`values`/`returns` are None when the advantage estimator needs no critic (ppo_math registry).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch

from engine import FrozenEngine, TrainEngine, atomic_directories, hf_base_model
from engine.checkpoint import kill_point, published, read_meta
from engine.distributed import all_reduce_sum
from engine.ema import ParamEMA
from rlhf import ppo_math
from rlhf.config import ConfigError, ModelConfig, PPOConfig, engine_config, optim_config, rollout_rows
from rlhf.data import collate_sft
from rlhf.data.stage import StepOrder
from rlhf.models import (
    MODEL_SUBDIR, check_context, disable_dropout, export_hf, load_causal_lm, load_tokenizer, load_value_model,
    tokenizer_mismatch, use_packing,
)
from rlhf.roles import Policy, ValueModel
from rlhf.reward_math import sequence_scores
from rlhf.rollout import position_ids_from_mask, row_values, score_rollout

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


def empty_responses(responses: torch.Tensor, response_mask: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """[B] bool: rows whose response has no token before its EOS (nothing was said)."""
    first_is_eos = torch.isin(responses[:, 0], torch.tensor(eos_ids, device=responses.device))
    return (response_mask.sum(1) == 0) | first_is_eos


@torch.no_grad()
def generate(actor, prompts: dict, group: torch.Tensor, sampling, eos_id: int, pad_id: int) -> Rollout:
    """Sample responses to `prompts` (collated, left-padded) in the actor engine's generation mode."""
    device = actor.info.device
    with actor.generation() as gen:
        g = gen.generate(prompts["input_ids"].to(device), prompts["attention_mask"].to(device), sampling,
                         eos_token_id=eos_id, pad_token_id=pad_id)
    empty = empty_responses(g.responses, g.response_mask, [eos_id])
    eos = torch.tensor([eos_id], device=g.responses.device)
    truncated = (~empty) & (g.response_mask.sum(1) == sampling.max_new_tokens) & ~torch.isin(g.responses[:, -1], eos)
    return Rollout(sequences=g.sequences, attention_mask=g.attention_mask,
                   response_mask=g.response_mask.masked_fill(empty[:, None], 0), responses=g.responses,
                   prompt_len=g.prompt_len, group=group.to(g.sequences.device), empty=empty, truncated=truncated)


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


@dataclass
class Experience:
    sequences: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    logp_old: torch.Tensor
    logp_ref: torch.Tensor
    values: torch.Tensor | None
    score: torch.Tensor
    group: torch.Tensor
    rewards: torch.Tensor
    kl: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor | None
    prompt_len: int

    def rows(self, idx: list[int]) -> dict:
        """A micro-batch dict of the given rows (every tensor field sliced), with `prompt_len`."""
        out = {f.name: getattr(self, f.name)[idx] for f in fields(self)
               if f.name != "prompt_len" and getattr(self, f.name) is not None}
        out["prompt_len"] = self.prompt_len
        return out


def build_experience(
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    prompt_len: int,
    scored: dict[str, torch.Tensor],
    *,
    kl_coef: float,
    kl_estimator: str,
    clip_reward_value: float,
    gamma: float,
    lam: float,
    estimator: str = "gae",
    group: torch.Tensor | None = None,
    whiten: bool = False,
    norm_by_std: bool = True,
) -> Experience:
    """Rewards (KL penalty per token + clipped score on the last), then advantages and returns by
    the registered `estimator` (optionally whitened over every rank's response tokens). The
    estimator's declared options (ppo_math.register_advantage) get `norm_by_std` and a sum over ranks."""
    mask = response_mask.float()
    rewards, kl = ppo_math.compute_rewards(scored["logp_old"], scored["logp_ref"], scored["score"], mask,
                                           kl_coef, clip_reward_value, kl_estimator)
    group = torch.arange(mask.shape[0], device=mask.device) if group is None else group
    values = scored.get("values")
    est = ppo_math.advantage_estimator(estimator)
    options = {"norm_by_std": norm_by_std, "all_reduce_sum": all_reduce_sum}
    advantages, returns = est.fn(
        ppo_math.AdvantageInputs(rewards=rewards, score=scored["score"], values=values, mask=mask, group=group),
        gamma=gamma, lam=lam, **{k: options[k] for k in est.options})
    if whiten:
        world_whiten_(advantages, mask)
    return Experience(
        sequences=sequences, attention_mask=attention_mask, position_ids=scored["position_ids"], response_mask=mask,
        logp_old=scored["logp_old"], logp_ref=scored["logp_ref"], values=values, score=scored["score"], group=group,
        rewards=rewards, kl=kl, advantages=advantages, returns=returns, prompt_len=prompt_len,
    )


def world_whiten_(advantages: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Advantages to mean 0, std 1 over the response tokens of every rank (in place)."""
    return advantages.copy_(ppo_math.whiten_across(advantages, mask, all_reduce_sum, eps))


def drop_uniform_groups(rollout: Rollout, score: torch.Tensor) -> int:
    """Dynamic sampling (DAPO), without the re-sampling: the rows of every prompt group whose valid
    rows' scores are all equal leave the update (their response mask is zeroed; an outcome
    estimator would give them advantage 0, so they carry no signal and only dilute the loss). Groups
    are whole on each rank. In place; sets `rollout.dropped` [B]; returns this rank's dropped groups."""
    valid = rollout.response_mask.bool().any(1)
    uniform = ppo_math.uniform_groups(score, rollout.group, valid) & valid
    rollout.response_mask = rollout.response_mask.masked_fill(uniform[:, None], 0)
    rollout.dropped = uniform
    return int(torch.unique(rollout.group[uniform]).numel())


# ----------------------------------------------------------------------------- the engines and the update


def model_cfg(cfg: PPOConfig, path: str, lora=None) -> ModelConfig:
    return dataclasses.replace(cfg.model, name_or_path=path, lora=lora or dataclasses.replace(cfg.model.lora, r=0))


class RewardSource(Protocol):
    """Scores whole responses: `score(rollout)` -> [B] float32, one per row (every rank its rows).

    The reward model is one (`RewardModelScore`). Another source is one class with this method: e.g.
    a verifiable reward that decodes the responses and judges them against the dataset rows that
    `rollout.group` indexes. `Models(..., reward_source=...)` takes it instead of the reward model."""

    def score(self, rollout: Rollout) -> torch.Tensor: ...


class RewardModelScore:
    """The frozen reward model's value at the last real token of prompt + response (rlhf/reward_math.py),
    its forwards packed as the other RL passes are when `pack_length` is set (data.packing=true)."""

    def __init__(self, engine: FrozenEngine, micro_batch_size: int, pack_length: int | None = None):
        self.engine, self.micro_batch_size, self.pack_length = engine, micro_batch_size, pack_length

    @torch.no_grad()
    def score(self, rollout: Rollout) -> torch.Tensor:
        ids, mask = rollout.sequences, rollout.attention_mask
        positions = position_ids_from_mask(mask)
        parts = []
        for s in range(0, ids.shape[0], self.micro_batch_size):  # the same forwards on every rank
            sl = slice(s, s + self.micro_batch_size)
            values = row_values(self.engine.model, {"sequences": ids[sl], "attention_mask": mask[sl],
                                                    "position_ids": positions[sl], "pack_length": self.pack_length})
            parts.append(sequence_scores(values.float(), mask[sl]))
        return torch.cat(parts)


class Models:
    """The engines of a PPO run: actor, critic (None when the advantage estimator needs none),
    reference and reward model; saved and resumed together (`rlhf/stage.py` Checkpointable)."""

    def __init__(self, cfg: PPOConfig, tok: Any, info, n_updates: int, reward_source: RewardSource | None = None):
        ecfg = engine_config(cfg.engine, info)
        ref_path = cfg.reference.model or cfg.actor.model
        rm_path = cfg.reward_model.model or cfg.critic.model
        needs_critic = ppo_math.advantage_estimator(cfg.ppo.advantage_estimator).needs_critic
        if cfg.model.tokenizer is None:  # each model brings its own: they must all be the actor's
            loaded = (("reference", ref_path), ("critic", cfg.critic.model if needs_critic else None),
                      ("reward_model", None if reward_source else rm_path))
            for key, path in loaded:
                if path and path != cfg.actor.model and (
                        why := tokenizer_mismatch(tok, load_tokenizer(model_cfg(cfg, path), key))):
                    raise ConfigError(f"{key}.model={path!r} was saved with another tokenizer than actor.model "
                                      f"({why}): the PPO models must share one (set model.tokenizer to force one)")
        fused = cfg.engine.kernels
        actor = Policy(disable_dropout(load_causal_lm(model_cfg(cfg, cfg.actor.model, cfg.actor.lora), tok,
                                                      seed=cfg.seed, key="actor")), fused=fused)
        critic = ValueModel(disable_dropout(load_value_model(
            model_cfg(cfg, cfg.critic.model, cfg.critic.lora), tok, seed=cfg.seed, key="critic"))) if needs_critic else None
        ref = Policy(disable_dropout(load_causal_lm(model_cfg(cfg, ref_path), tok, seed=cfg.seed, key="reference",
                                                    lora=False)), fused=fused)
        rm = None if reward_source else ValueModel(disable_dropout(load_value_model(
            model_cfg(cfg, rm_path), tok, seed=cfg.seed, key="reward_model", lora=False)))
        for key, m in (("critic", critic), ("reward_model", rm)):
            if m is not None and hf_base_model(m).config.num_labels != 1:
                raise ConfigError(f"{key}.model must be a reward/value model with one output (num_labels=1)")
        for m in (actor, critic, ref, rm):
            if m is not None:
                check_context(m, cfg.data.max_prompt_len + cfg.rollout.max_new_tokens,
                              "data.max_prompt_len + rollout.max_new_tokens")
        self.pack_length = rl_pack_length(cfg, [m for m in (actor, critic, ref, rm) if m is not None])
        self.info = info
        self.actor = TrainEngine(actor, ecfg, optim_config(cfg.actor, "actor"), total_steps=n_updates, info=info)
        self.critic = critic and TrainEngine(critic, ecfg, optim_config(cfg.critic, "critic"), total_steps=n_updates,
                                             info=info)
        self.reference = FrozenEngine(ref, dataclasses.replace(ecfg, offload=cfg.reference.offload), info)
        self.reward = rm and FrozenEngine(rm, dataclasses.replace(ecfg, offload=cfg.reward_model.offload), info)
        self.reward_source = reward_source or RewardModelScore(self.reward, cfg.rollout.micro_batch_size,
                                                               self.pack_length)
        self.ema = ParamEMA(self.actor.unwrapped, cfg.ppo.ema_decay) if cfg.ppo.ema_decay > 0 else None
        for e in (self.actor, self.critic, self.reference, self.reward):
            if e is not None:
                e.eval()  # dropout is off anyway; eval() keeps HF modules from training-only branches

    def engines(self) -> dict[str, Any]:
        """The engines this run built, by role: a critic-free run has no critic, and a run whose reward
        source is not the reward model has no reward model."""
        return {k: e for k, e in (("actor", self.actor), ("critic", self.critic), ("reference", self.reference),
                                  ("reward_model", self.reward)) if e is not None}

    def memory_report(self) -> dict:
        """The actor's memory report (engine.memory), plus `models`: the bytes of parameters, gradients
        and optimizer state this rank holds per model, for every model this run holds."""
        report = self.actor.memory_report()
        report["models"] = {k: e.memory_report()["model_state_bytes"] for k, e in self.engines().items()}
        return report

    def score(self, rollout, cfg: PPOConfig) -> dict[str, torch.Tensor]:
        """The "score" step: old and reference log-probs, critic values, and the reward source's scores."""
        scored = score_rollout(rollout.sequences, rollout.attention_mask, rollout.prompt_len, actor=self.actor.model,
                               reference=self.reference.model, critic=self.critic.model if self.critic else None,
                               micro_batch_size=cfg.rollout.micro_batch_size, temperature=cfg.rollout.temperature,
                               pack_length=self.pack_length)
        scored["score"] = self.reward_source.score(rollout)
        return scored

    def save_checkpoint(self, path: str, extra_state: dict) -> None:
        """Actor + critic (+ this rank's EMA shards) in one checkpoint, published atomically. Collective."""
        with published(path, {"step": extra_state["step"], "extra_state": extra_state}, self.info.is_main) as tmp:
            self.actor.write_state(os.path.join(tmp, "actor"), rank_extra=self.ema.state_dict() if self.ema else None)
            kill_point("between_models")
            if self.critic is not None:
                self.critic.write_state(os.path.join(tmp, "critic"))

    def export(self, tok: Any, cfg: PPOConfig) -> str:
        """model/ (the actor), critic/ and model_ema/ (those this run has) as HF directories under
        output_dir, published together (summary.json, written after, marks them complete). Collective:
        every rank consolidates, rank 0 writes. Returns the actor's directory."""
        actor_sd = self.actor.full_state_dict()
        critic_sd = self.critic.full_state_dict() if self.critic is not None else None
        ema_sd = None
        if self.ema is not None:
            with self.ema.swapped_in():
                ema_sd = self.actor.full_state_dict()
        if self.info.is_main:
            actor_cfg = model_cfg(cfg, cfg.actor.model, cfg.actor.lora)
            exports = [(sd, like, name, mcfg) for sd, like, name, mcfg in (
                (actor_sd, self.actor.inner, MODEL_SUBDIR, actor_cfg),
                (critic_sd, self.critic and self.critic.inner, "critic", model_cfg(cfg, cfg.critic.model, cfg.critic.lora)),
                (ema_sd, self.actor.inner, "model_ema", actor_cfg)) if sd is not None]
            with atomic_directories(*(os.path.join(cfg.output_dir, e[2]) for e in exports)) as tmps:
                for tmp, (sd, like, _, mcfg) in zip(tmps, exports):
                    export_hf(sd, like, tok, tmp, mcfg, add_bos=cfg.data.add_bos, atomic=False)
        return os.path.join(cfg.output_dir, MODEL_SUBDIR)

    def load_checkpoint(self, path: str) -> dict:
        if self.critic is not None:
            self.critic.read_state(os.path.join(path, "critic"))
        self.actor.read_state(os.path.join(path, "actor"))  # last: its RNG state is the one kept
        if self.ema is not None:
            if self.actor.rank_extra is None:
                raise ConfigError(f"{path} holds no EMA state for this rank (ppo.ema_decay was 0, or another "
                                  "world size): resume with the same ppo.ema_decay and number of ranks")
            self.ema.load_state_dict(self.actor.rank_extra)
        return read_meta(path)["extra_state"]


def rl_pack_length(cfg: PPOConfig, models: list) -> int | None:
    """The RL passes' `pack_length` (rlhf/rollout.py Repacked), or None for padded batches. Only
    data.packing=true packs them (auto keeps them padded: their packing is newer and its speed
    unmeasured in a whole RL run); every model must support it (ConfigError naming data.packing)."""
    d = cfg.data
    if d.packing is not True:
        return None
    for m in models:
        use_packing(True, m)
    longest = d.max_prompt_len + cfg.rollout.max_new_tokens  # + bos: max_prompt_len counts it
    if d.pack_length is None:
        return longest
    if 0 < d.pack_length < longest:
        raise ConfigError(f"data.pack_length ({d.pack_length}) must be 0 or >= data.max_prompt_len + "
                          f"rollout.max_new_tokens ({longest}), the longest rollout row")
    return d.pack_length


def update(models: Models, exp: Experience, cfg: PPOConfig, losses: tuple, ptx_batches, run) -> tuple[list, list]:
    """The "update" step: `ppo.ppo_epochs` passes over shuffled mini-batches of this rank's rows, one
    actor (and critic) optimizer step per mini-batch; `ptx_batches()` gives each micro-batch's SFT rows."""
    r, p, info = cfg.rollout, cfg.ppo, models.info
    rows = rollout_rows(r)  # prompts_per_step x n_samples_per_prompt; the batch sizes count rows
    per_rank, mini_rows = rows // info.world_size, r.mini_batch_size // info.world_size
    a_stats, c_stats = [], []
    for _ in range(p.ppo_epochs):
        perm = torch.randperm(per_rank).tolist()
        for k in range(rows // r.mini_batch_size):
            rows_k = perm[k * mini_rows : (k + 1) * mini_rows]
            micro = [exp.rows(rows_k[i : i + r.micro_batch_size]) for i in range(0, mini_rows, r.micro_batch_size)]
            for mb in micro:
                mb["pack_length"] = models.pack_length  # the losses' forwards pack like the scoring's
            if ptx_batches is not None:
                for mb in micro:
                    mb["ptx"] = ptx_batches()
            a_stats.append(models.actor.train_step(micro, losses[0]))
            if models.critic is not None:
                c_stats.append(models.critic.train_step(micro, losses[1]))
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
        ppo_math.masked_sum(exp.kl, exp.response_mask, dim=1).sum(), exp.response_mask.sum(1).sum(), kept.sum(),
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
