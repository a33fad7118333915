"""The four models of an RL run as engines: actor (trained, hybrid: generation mode), critic (trained; only
for an estimator that needs one), reference and reward model (frozen; the reward model only when it is a
reward source). Built, saved, resumed and exported together.

    models = Models(cfg, tok, info, n_updates)             # tokenizers checked to be the actor's
    scored = models.score(rollout)                         # old/ref log-probs, values, reward scores
    models.save_checkpoint(path, extra_state); models.export(tok, cfg)
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from engine import FrozenEngine, TrainEngine, atomic_directories, hf_base_model
from engine.checkpoint import kill_point, published, read_meta
from engine.ema import ParamEMA
from rlhf.algos.rl import advantage_estimator
from rlhf.config import ModelConfig, PPOConfig
from rlhf.config.validate import (engine_config, optim_config, score_batch_size, score_batch_tokens, shared_prompts,
                                  trained_row_tokens, trainer_truncation)
from rlhf.core.errors import ConfigError
from rlhf.modeling.export import export_hf
from rlhf.modeling.load import (
    MODEL_SUBDIR, check_context, disable_dropout, load_causal_lm, load_tokenizer, load_value_model, tokenizer_mismatch,
    use_packing,
)
from rlhf.modeling.roles import Policy, ValueModel
from rlhf.rl.distill import is_distill, reference_path
from rlhf.rl.rewards import RewardEnsemble, RewardModelScore, RewardSource, begin as begin_rewards
from rlhf.rl.rollout import Rollout, score_rollout


logger = logging.getLogger("rlhf.ppo")

BEST_ACTOR = "best_actor.pt"  # in a checkpoint: train.export_best's snapshot of the best evaluation's actor


def model_cfg(cfg: PPOConfig, path: str, lora=None) -> ModelConfig:
    return dataclasses.replace(cfg.model, name_or_path=path, lora=lora or dataclasses.replace(cfg.model.lora, r=0))


class Models:
    """The engines of a PPO run: actor, critic (None when the advantage estimator needs none),
    reference and reward model; saved and resumed together (`rlhf/run/stage.py` Checkpointable)."""

    def __init__(self, cfg: PPOConfig, tok: Any, info, n_updates: int, reward_source: RewardSource | None = None):
        ecfg = engine_config(cfg.engine, info)
        if cfg.engine.placement == "split" and ecfg.generation == "vllm":
            # a split job's trainers sample no rollout (the generation ranks' vLLM engines do); their held-out
            # evaluations generate through transformers: an in-process vLLM engine here would create process groups
            # over the whole job, which the generation ranks never join (engine/vllm_backend.py, own_process)
            ecfg = dataclasses.replace(ecfg, generation="hf")
        ref_path = reference_path(cfg)  # algorithm=distill: the teacher (rlhf/rl/distill.py)
        ref_key = "teacher" if is_distill(cfg) else "reference"
        rm_path = cfg.reward_model.model or cfg.critic.model
        needs_critic = advantage_estimator(cfg.ppo.advantage_estimator).needs_critic
        # reward.ensemble_models: more reward models beside reward_model.model, one ensemble (rlhf/rl/rewards.py)
        members = [] if reward_source else [(f"reward.ensemble_models[{i}]", path)
                                            for i, path in enumerate(cfg.reward.ensemble_models)]
        if cfg.model.tokenizer is None:  # each model brings its own: they must all be the actor's
            loaded = ((ref_key, ref_path), ("critic", cfg.critic.model if needs_critic else None),
                      ("reward_model", None if reward_source else rm_path), *members)
            for key, path in loaded:
                if path and path != cfg.actor.model and (
                        why := tokenizer_mismatch(tok, load_tokenizer(model_cfg(cfg, path), key))):
                    raise ConfigError(f"{key if '[' in key else key + '.model'}={path!r} was saved with another "
                                      f"tokenizer than actor.model "
                                      f"({why}): the PPO models must share one (set model.tokenizer to force one)")
        fused = {"fused": cfg.engine.kernels, "max_logits_mb": cfg.engine.max_logits_mb}
        actor = Policy(disable_dropout(load_causal_lm(model_cfg(cfg, cfg.actor.model, cfg.actor.lora), tok,
                                                      seed=cfg.seed, key="actor")), **fused)
        critic = ValueModel(disable_dropout(load_value_model(
            model_cfg(cfg, cfg.critic.model, cfg.critic.lora), tok, seed=cfg.seed, key="critic"))) if needs_critic else None
        ref = Policy(disable_dropout(load_causal_lm(model_cfg(cfg, ref_path), tok, seed=cfg.seed, key=ref_key,
                                                    lora=False)), **fused)
        rm = None if reward_source else ValueModel(disable_dropout(load_value_model(
            model_cfg(cfg, rm_path), tok, seed=cfg.seed, key="reward_model", lora=False)))
        member_models = [(key, ValueModel(disable_dropout(load_value_model(
            model_cfg(cfg, path), tok, seed=cfg.seed, key=key, lora=False)))) for key, path in members]
        for key, m in (("critic", critic), ("reward_model", rm), *member_models):
            if m is not None and hf_base_model(m).config.num_labels != 1:
                raise ConfigError(f"{key if '[' in key else key + '.model'} must be a reward/value model with one output (num_labels=1)")
        for m in (actor, critic, ref, rm, *(m for _, m in member_models)):
            if m is not None:
                m.length_buckets = cfg.rollout.length_buckets  # shared-prompt forwards by length (roles.py)
                check_context(m, cfg.data.max_prompt_len + cfg.rollout.max_new_tokens,
                              "data.max_prompt_len + rollout.max_new_tokens")
        self.pack_length = rl_pack_length(cfg, [m for m in (actor, critic, ref, rm) if m is not None])
        self.shared_prompts = shared_prompts(cfg)  # rollout.shared_prompt_forward: every forward of a rollout
        # ... but the update's under engine.activation_checkpointing: a checkpointed block runs without a KV
        # cache (transformers drops it: the backward's recompute would write it twice), so those run whole rows
        self.shared_prompts_update = self.shared_prompts and not cfg.engine.activation_checkpointing
        if self.shared_prompts and not self.shared_prompts_update:
            logger.info("rollout.shared_prompt_forward: the scoring forwards share prompts; the update's run whole "
                        "rows (engine.activation_checkpointing recomputes blocks without a KV cache)")
        self.info = info
        # the no-grad scoring forwards run on rollout.score_batch_size rows (2 x the training micro-batch by
        # default): half the forwards of the default step, each on a fuller batch
        self.score_batch_size, self.temperature = score_batch_size(cfg.rollout, info.world_size), cfg.rollout.temperature
        # rollout.micro_batch_tokens: the scoring forwards by a token budget too, as many times the update's as
        # score_batch_size is micro_batch_size (rlhf/rl/rollout.py); score_batching: this rank's counts of the
        # last scoring pass (micro-batches, computed and real tokens; with a budget only)
        self.micro_batch_tokens, self.score_batching = score_batch_tokens(cfg.rollout), {}
        self.truncate = trainer_truncation(cfg)  # ppo.trainer_logprobs=sampler: (top_k, top_p), else None
        rows = trained_row_tokens(cfg)
        self.actor = TrainEngine(actor, ecfg, optim_config(cfg.actor, "actor"), total_steps=n_updates, info=info,
                                 row_tokens=rows)
        self.critic = critic and TrainEngine(critic, ecfg, optim_config(cfg.critic, "critic"), total_steps=n_updates,
                                             info=info, row_tokens=rows)
        self.reference_role = ref_key
        self.reference = FrozenEngine(ref, dataclasses.replace(ecfg, offload=getattr(cfg, self.reference_role).offload),
                                      info)
        self.reward = rm and FrozenEngine(rm, dataclasses.replace(ecfg, offload=cfg.reward_model.offload), info)
        self.reward_members = [FrozenEngine(m, dataclasses.replace(ecfg, offload=cfg.reward_model.offload), info)
                               for _, m in member_models]
        self.reward_source = reward_source or RewardModelScore(self.reward, self.score_batch_size, self.pack_length,
                                                                        self.shared_prompts)
        if self.reward_members:  # the reward model and the ensemble's other members, combined (reward.ensemble_agg)
            self.reward_source = RewardEnsemble(
                [self.reward_source] + [RewardModelScore(e, self.score_batch_size, self.pack_length, self.shared_prompts)
                                        for e in self.reward_members], cfg.reward.ensemble_agg, cfg.reward.ensemble_lambda)
        self.best_actor: dict | None = None  # train.export_best: the best evaluation's actor (main rank), checkpointed
        self.ema = ParamEMA(self.actor.unwrapped, cfg.ppo.ema_decay) if cfg.ppo.ema_decay > 0 else None
        for e in (self.actor, self.critic, self.reference, self.reward, *self.reward_members):
            if e is not None:
                e.eval()  # dropout is off anyway; eval() keeps HF modules from training-only branches

    def engines(self) -> dict[str, Any]:
        """The engines this run built, by role: a critic-free run has no critic, and a run whose reward
        source is not the reward model has no reward model."""
        return {k: e for k, e in (("actor", self.actor), ("critic", self.critic), (self.reference_role, self.reference),
                                  ("reward_model", self.reward),
                                  *((f"reward_model_{i + 1}", e) for i, e in enumerate(self.reward_members)))
                if e is not None}

    def memory_report(self) -> dict:
        """The actor's memory report (engine.memory), plus `models`: the bytes of parameters, gradients
        and optimizer state this rank holds per model, for every model this run holds."""
        report = self.actor.memory_report()
        report["models"] = {k: e.memory_report()["model_state_bytes"] for k, e in self.engines().items()}
        return report

    def score(self, rollout: Rollout, old_from_sampler: bool = False) -> dict[str, torch.Tensor]:
        """The "score" step: old and reference log-probs (at the sampling temperature), critic values, and
        the reward source's scores; the sampler's log-probs ride along as `logp_gen` (when the rollout
        has them). `old_from_sampler` (ppo.old_logprobs, rlhf/rl/old_logprobs.py): logp_old is the
        sampler's `logp_gen`, and the actor's scoring forward is skipped. A source that works in the
        background (http) is started first, so its requests run while the forwards here do."""
        if old_from_sampler and rollout.logp_gen is None:
            raise ValueError("old log-probs from the sampler, but the rollout has none (logp_gen)")
        begin_rewards(self.reward_source, rollout)
        scored = score_rollout(rollout.sequences, rollout.attention_mask, rollout.prompt_len,
                               actor=None if old_from_sampler else self.actor.model, reference=self.reference.model,
                               critic=self.critic.model if self.critic else None,
                               micro_batch_size=self.score_batch_size, temperature=self.temperature,
                               pack_length=self.pack_length, shared_prompts=self.shared_prompts,
                               truncate=self.truncate, micro_batch_tokens=self.micro_batch_tokens,
                               group=rollout.group,
                               batching=None if self.micro_batch_tokens is None else self.score_batching)
        if old_from_sampler:
            scored["logp_old"] = rollout.logp_gen
        scored["score"] = self.reward_source.score(rollout)
        if rollout.logp_gen is not None:
            scored["logp_gen"] = rollout.logp_gen
        return scored

    def save_checkpoint(self, path: str, extra_state: dict) -> None:
        """Actor + critic (+ this rank's EMA shards) in one checkpoint, published atomically. Collective."""
        with published(path, {"step": extra_state["step"], "extra_state": extra_state}, self.info.is_main) as tmp:
            self.actor.write_state(os.path.join(tmp, "actor"), rank_extra=self.ema.state_dict() if self.ema else None)
            kill_point("between_models")
            if self.critic is not None:
                self.critic.write_state(os.path.join(tmp, "critic"))
            if self.best_actor is not None and self.info.is_main:
                torch.save(self.best_actor, os.path.join(tmp, BEST_ACTOR))

    def snapshot_actor(self) -> None:
        """Keep the actor's weights now as the best (train.export_best): a CPU copy on the main rank. Collective."""
        sd = self.actor.full_state_dict()
        self.best_actor = {k: v.detach().to("cpu", copy=True) for k, v in sd.items()} if self.info.is_main else {}

    def export(self, tok: Any, cfg: PPOConfig, actor_state: dict | None = None) -> str:
        """model/ (the actor), critic/ and model_ema/ (those this run has) as HF directories under
        output_dir, published together (summary.json, written after, marks them complete). Collective:
        every rank consolidates, rank 0 writes. `actor_state`: the actor's weights to export instead of
        its current ones (train.export_best's snapshot). Returns the actor's directory."""
        actor_sd = self.actor.full_state_dict() if actor_state is None else actor_state
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
                for tmp, (sd, like, name, mcfg) in zip(tmps, exports):
                    export_hf(sd, like, tok, tmp, mcfg, add_bos=cfg.data.add_bos, atomic=False,
                              final_dir=os.path.join(cfg.output_dir, name))
        return os.path.join(cfg.output_dir, MODEL_SUBDIR)

    def load_checkpoint(self, path: str) -> dict:
        if self.critic is not None:
            self.critic.read_state(os.path.join(path, "critic"))
        self.actor.read_state(os.path.join(path, "actor"))  # last: its RNG state is the one kept
        best = os.path.join(path, BEST_ACTOR)
        if os.path.exists(best) and self.info.is_main:
            self.best_actor = torch.load(best, map_location="cpu", weights_only=True)
        elif os.path.exists(best):
            self.best_actor = {}
        if self.ema is not None:
            if self.actor.rank_extra is None:
                raise ConfigError(f"{path} holds no EMA state for this rank (ppo.ema_decay was 0, or another "
                                  "world size): resume with the same ppo.ema_decay and number of ranks")
            self.ema.load_state_dict(self.actor.rank_extra)
        return read_meta(path)["extra_state"]


def rl_pack_length(cfg: PPOConfig, models: list) -> int | None:
    """The RL passes' `pack_length` (rlhf/modeling/forward.py Repacked), or None for padded batches. Only
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
