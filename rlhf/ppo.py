"""Stage 3: PPO with four models: actor (trained), critic (trained), reference and reward (frozen).

    python -m rlhf.ppo                                        # from outputs/sft + outputs/reward, CPU
    python -m rlhf.ppo actor.model=/runs/sft critic.model=/runs/rm ppo.kl_coef=0.05
    torchrun --nproc_per_node 2 -m rlhf.ppo engine=zero3 rollout.micro_batch_size=16

One PPO step (DeepSpeed-Chat's defaults; rlhf/ppo_math.py holds the math):
  1. generation mode: the actor's parameters are gathered once and `rollout.prompts_per_step`
     prompts are answered by sampling (temperature / top-k / top-p); every row stops at its own EOS;
  2. scoring (no grad): actor log-probs (old), reference log-probs, critic values, and the reward
     model's value at the last real token of prompt + response (the EOS when one was generated);
     responses with nothing before their EOS are dropped (masked out) and counted;
  3. rewards: -kl_coef * KL on every response token, + clip(score, ±clip_reward_value) on the last;
  4. GAE advantages (gamma, lam), returns = advantages + values, optional whitening (over all ranks);
  5. `ppo.ppo_epochs` passes over shuffled mini-batches: one actor step (clipped surrogate, + ptx)
     and one critic step (clipped value loss) per mini-batch; optional EMA of the actor.
Dropout is disabled in all four models, so old and new log-probs come from the same function.
Writes to `output_dir`: config.yaml, metrics.jsonl, ppo.png, checkpoints/, model/ (the actor, HF),
critic/, model_ema/ (with ppo.ema_decay), summary.json.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch

from engine import FrozenEngine, TrainEngine, format_memory_report, init_distributed
from engine.checkpoint import new_tmp_path, publish, read_meta, write_meta
from engine.distributed import all_reduce_sum, barrier, broadcast_object
from engine.ema import ParamEMA
from engine.generation import SamplingParams
from rlhf import ppo_math
from rlhf.app import (
    ConfigError, checkpoint_root, count_skips, fresh_checkpoints, progress, resolve_resume, save_config,
    seed_everything, setup_logging, stage_main,
)
from rlhf.config import ModelConfig, PPOConfig, engine_config, optim_config, validate_ppo
from rlhf.data import collate_prompts, collate_sft, load_rows, parse_prompts, parse_sft, tokenize_prompts, tokenize_sft
from rlhf.data.stage import StepOrder, stage_rows
from rlhf.evaluate import gold_eval, load_eval_prompts
from rlhf.hub import check_local
from rlhf.models import (
    MODEL_SUBDIR, disable_dropout, export_hf, load_causal_lm, load_tokenizer, load_value_model, per_token_values,
)
from rlhf.rollout import build_experience, empty_responses, score_rollout, token_logprobs, token_values
from rlhf.runlog import RunLog, format_summary, plot_series, read_metrics, series, write_summary
from rlhf.sft import sft_loss

logger = logging.getLogger("rlhf.ppo")


# ----------------------------------------------------------------------------- losses


def make_actor_loss(cliprange: float, temperature: float, ptx_coef: float):
    def actor_loss(model: torch.nn.Module, mb: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Clipped surrogate summed over response tokens (+ ptx_coef x SFT loss, weighted alike)."""
        logp, entropy = token_logprobs(model, mb, temperature, with_entropy=True)
        mask = mb["response_mask"]
        loss, stats = ppo_math.policy_loss(logp, mb["logp_old"], mb["advantages"], mask, cliprange)
        n = mask.sum()
        total = loss * n
        stats["entropy"] = ppo_math.masked_mean(entropy, mask)
        if ptx_coef:
            device = mb["sequences"].device
            ptx_sum, ptx_n, _ = sft_loss(model, {k: v.to(device) for k, v in mb["ptx"].items()})
            ptx = ptx_sum / ptx_n.clamp(min=1)
            total = total + ptx_coef * ptx * n  # its mean enters the mini-batch mean like a token loss
            stats["ptx_loss"] = ptx.detach()
        return total, n, stats

    return actor_loss


def make_critic_loss(cliprange_value: float):
    def critic_loss(model: torch.nn.Module, mb: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
        mask = mb["response_mask"]
        loss, stats = ppo_math.value_loss(token_values(model, mb), mb["values"], mb["returns"], mask, cliprange_value)
        return loss * mask.sum(), mask.sum(), stats

    return critic_loss


# ----------------------------------------------------------------------------- pieces


def world_whiten_(advantages: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Advantages to mean 0, std 1 over the response tokens of every rank (in place)."""
    m = mask.bool()
    a = torch.where(m, advantages, torch.zeros_like(advantages)).double()
    stats = all_reduce_sum(torch.stack([a.sum(), (a * a).sum(), m.sum().double()]))
    n = stats[2].clamp(min=2)
    mean = stats[0] / n
    var = (stats[1] / n - mean * mean) * n / (n - 1)
    advantages.copy_(torch.where(m, ((a - mean) * torch.rsqrt(var + eps)).float(), torch.zeros_like(advantages)))
    return advantages


def sampling(cfg: PPOConfig) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, greedy=False, temperature=r.temperature, top_k=r.top_k,
                          top_p=r.top_p)


def model_cfg(cfg: PPOConfig, path: str, lora=None) -> ModelConfig:
    return dataclasses.replace(cfg.model, name_or_path=path, lora=lora or dataclasses.replace(cfg.model.lora, r=0))


class Models:
    """The four engines of a PPO run."""

    def __init__(self, cfg: PPOConfig, tok: Any, info, n_updates: int):
        ecfg = engine_config(cfg.engine, info)
        ref_path = cfg.reference.model or cfg.actor.model
        rm_path = cfg.reward_model.model or cfg.critic.model
        actor = disable_dropout(load_causal_lm(model_cfg(cfg, cfg.actor.model, cfg.actor.lora), tok, seed=cfg.seed,
                                               key="actor"))
        critic = disable_dropout(per_token_values(load_value_model(
            model_cfg(cfg, cfg.critic.model, cfg.critic.lora), tok, seed=cfg.seed, key="critic")))
        ref = disable_dropout(load_causal_lm(model_cfg(cfg, ref_path), tok, seed=cfg.seed, key="reference", lora=False))
        rm = disable_dropout(per_token_values(load_value_model(model_cfg(cfg, rm_path), tok, seed=cfg.seed,
                                                               key="reward_model", lora=False)))
        for key, m in (("critic", critic), ("reward_model", rm)):
            if getattr(m, "get_base_model", lambda: m)().config.num_labels != 1:
                raise ConfigError(f"{key}.model must be a reward/value model with one output (num_labels=1)")
        self.actor = TrainEngine(actor, ecfg, optim_config(cfg.actor, "actor"), total_steps=n_updates, info=info)
        self.critic = TrainEngine(critic, ecfg, optim_config(cfg.critic, "critic"), total_steps=n_updates, info=info)
        self.reference = FrozenEngine(ref, dataclasses.replace(ecfg, offload=cfg.reference.offload), info)
        self.reward = FrozenEngine(rm, dataclasses.replace(ecfg, offload=cfg.reward_model.offload), info)
        self.ema = ParamEMA(self.actor.unwrapped, cfg.ppo.ema_decay) if cfg.ppo.ema_decay > 0 else None
        for e in (self.actor, self.critic, self.reference, self.reward):
            e.eval()  # dropout is off anyway; eval() keeps HF modules from training-only branches

    def save(self, path: str, state: dict) -> None:
        """Actor + critic (+ EMA) under one directory, published atomically. Collective."""
        info = self.actor.info
        tmp = broadcast_object(new_tmp_path(path) if info.is_main else None)
        rank_extra = self.ema.state_dict() if self.ema else None
        self.actor.save_checkpoint(os.path.join(tmp, "actor"), state, rank_extra=rank_extra)
        self.critic.save_checkpoint(os.path.join(tmp, "critic"), state)
        if info.is_main:
            write_meta(tmp, {"step": state["step"], **state})
            publish(tmp, path)
        barrier()

    def load(self, path: str) -> dict:
        self.critic.load_checkpoint(os.path.join(path, "critic"))
        self.actor.load_checkpoint(os.path.join(path, "actor"))  # last: its RNG state is the one kept
        if self.ema is not None:
            if self.actor.rank_extra is None:
                raise ConfigError(f"{path} holds no EMA state for this rank (ppo.ema_decay was 0, or another "
                                  "world size): resume with the same ppo.ema_decay and number of ranks")
            self.ema.load_state_dict(self.actor.rank_extra)
        return read_meta(path)


# ----------------------------------------------------------------------------- evaluation


def evaluate(models: Models, prompts: list, tok: Any, cfg: PPOConfig) -> dict[str, Any]:
    """Greedy gold score, and the sampled policy's KL to the reference and reward score, on held-out prompts."""
    info = models.actor.info
    if not prompts:
        return {}
    n = len(prompts) // info.world_size  # equal rows per rank: the scoring forwards are collective
    mine = prompts[info.rank * n : (info.rank + 1) * n]
    batch = collate_prompts([{"input_ids": p.ids} for p in mine], tok.pad_token_id)
    ids, mask = batch["input_ids"].to(info.device), batch["attention_mask"].to(info.device)
    with models.actor.generation() as gen:
        out = gold_eval(gen, prompts, tok, cfg.eval, rank=info.rank, world=info.world_size, device=info.device)
        with torch.random.fork_rng(devices=[info.device] if info.device.type == "cuda" else []):
            torch.manual_seed(cfg.seed + 1)
            g = gen.generate(ids, mask, sampling(cfg), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    scored = score_rollout(g.sequences, g.attention_mask, g.response_mask, g.prompt_len,
                           actor=models.actor.model, reference=models.reference.model, critic=models.critic.model,
                           reward=models.reward.model, micro_batch_size=cfg.rollout.micro_batch_size,
                           temperature=cfg.rollout.temperature)
    # the same estimator as the reward penalty (ppo.kl_estimator), so the reported KL names one thing
    kl = ppo_math.masked_sum(ppo_math.kl_estimate(scored["logp_old"], scored["logp_ref"], cfg.ppo.kl_estimator),
                             g.response_mask.float(), dim=1)
    sums = all_reduce_sum(torch.stack([kl.sum(), scored["score"].sum(), torch.tensor(float(len(mine)))]).double())
    out["kl"] = (sums[0] / sums[2]).item()
    out["reward"] = (sums[1] / sums[2]).item()
    return out


# ----------------------------------------------------------------------------- the run


def run(cfg: PPOConfig) -> dict[str, Any]:
    t_start = time.time()
    info = init_distributed()
    setup_logging(info.is_main)
    validate_ppo(cfg, info)
    if cfg.model.name_or_path is not None:
        raise ConfigError("model.name_or_path is not used by PPO: set actor.model and critic.model "
                          "(reference.model / reward_model.model default to them)")
    seed_everything(cfg.seed)
    out_dir, r, p = cfg.output_dir, cfg.rollout, cfg.ppo
    for key, path in (("actor.model", cfg.actor.model), ("critic.model", cfg.critic.model)):
        check_local(path, key)  # names the stage to run first

    # ---- data
    tok = load_tokenizer(model_cfg(cfg, cfg.actor.model), key="actor")
    d = cfg.data
    rows, _ = stage_rows(d, stage=2)
    feats, stats = tokenize_prompts(parse_prompts(rows, tok), tok, d.max_prompt_len, d.overlong, d.add_bos)
    eval_prompts = load_eval_prompts(d, tok)
    order = StepOrder(len(feats), r.prompts_per_step, cfg.seed, key="rollout.prompts_per_step")
    total = cfg.train.max_steps or cfg.train.epochs * order.steps_per_epoch
    minis = r.prompts_per_step // r.mini_batch_size
    n_updates = total * p.ppo_epochs * minis
    ptx_feats, ptx_order = None, None
    if p.ptx_coef > 0:
        if not cfg.ptx_path:
            raise ConfigError("ppo.ptx_coef > 0 needs ptx_path (SFT data for the pretraining loss)")
        ptx_feats, _ = tokenize_sft(parse_sft(load_rows(cfg.ptx_path), tok), tok, d.max_len, d.max_prompt_len,
                                    d.overlong, d.add_bos)
        ptx_order = StepOrder(len(ptx_feats), r.micro_batch_size * info.world_size, cfg.seed + 1, key="ptx_path")
    logger.info("PPO: %d prompts (%s), %d eval prompts; %d steps of %d prompts, %d actor/critic updates",
                len(feats), stats, len(eval_prompts), total, r.prompts_per_step, n_updates)

    # ---- models
    models = Models(cfg, tok, info, n_updates)
    kl_ctl = ppo_math.make_kl_controller(p.kl_coef, p.adaptive_kl, p.kl_target, p.kl_horizon)
    resume = resolve_resume(cfg.train.resume, out_dir)
    start, before = 0, None
    if resume:
        meta = models.load(resume)
        start, before = meta["step"], meta.get("before")
        kl_ctl.load_state_dict(meta["kl_ctl"])
        logger.info("resumed from %s at step %d", resume, start)
    else:
        fresh_checkpoints(out_dir, info.is_main)
    log = RunLog(out_dir, cfg.logger, is_main=info.is_main, resume_step=start if resume else None)
    if info.is_main:
        save_config(out_dir, cfg)
    if before is None:
        before = evaluate(models, eval_prompts, tok, cfg)
        log.log(0, "eval", **{k: v for k, v in before.items() if k != "samples"})
        logger.info("before PPO: %s", _eval_line(before))
    before = {k: v for k, v in before.items() if k != "samples"}

    # ---- the loop
    actor_loss = make_actor_loss(p.cliprange, r.temperature, p.ptx_coef)
    critic_loss = make_critic_loss(p.cliprange_value)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    per_rank, mini_rows = r.prompts_per_step // info.world_size, r.mini_batch_size // info.world_size
    bar = progress(total, start, "ppo", info.is_main)
    skips, times = 0, {"generation_s": [], "scoring_s": [], "training_s": []}
    micro_per_step = p.ppo_epochs * minis * (mini_rows // r.micro_batch_size)
    for step in range(start, total):
        t0 = time.time()
        batch = collate_prompts([feats[i] for i in order.rank_rows(step, info.rank, info.world_size, 1)[0]], pad)
        with models.actor.generation() as gen:
            g = gen.generate(batch["input_ids"].to(info.device), batch["attention_mask"].to(info.device),
                             sampling(cfg), eos_token_id=eos, pad_token_id=pad)
        t1 = time.time()
        scored = score_rollout(g.sequences, g.attention_mask, g.response_mask, g.prompt_len,
                               actor=models.actor.model, reference=models.reference.model,
                               critic=models.critic.model, reward=models.reward.model,
                               micro_batch_size=r.micro_batch_size, temperature=r.temperature)
        empty = empty_responses(g.responses, g.response_mask, [eos])
        response_mask = g.response_mask.masked_fill(empty[:, None], 0)
        exp = build_experience(g.sequences, g.attention_mask, response_mask, g.prompt_len, scored,
                               kl_coef=kl_ctl.value, kl_estimator=p.kl_estimator,
                               clip_reward_value=p.clip_reward_value, gamma=p.gamma, lam=p.lam)
        if p.whiten_advantages:
            world_whiten_(exp.advantages, exp.response_mask)
        t2 = time.time()
        a_stats, c_stats = [], []
        n_ptx = step * micro_per_step  # the ptx data position follows from the step (exact resume)
        for _ in range(p.ppo_epochs):
            perm = torch.randperm(per_rank).tolist()
            for k in range(minis):
                rows_k = perm[k * mini_rows : (k + 1) * mini_rows]
                micro = [exp.rows(rows_k[i : i + r.micro_batch_size]) for i in range(0, mini_rows, r.micro_batch_size)]
                if ptx_feats is not None:
                    for mb in micro:
                        idx = ptx_order.rank_rows(n_ptx, info.rank, info.world_size, 1)[0]
                        mb["ptx"] = collate_sft([ptx_feats[i] for i in idx], pad)
                        n_ptx += 1
                a_stats.append(models.actor.train_step(micro, actor_loss))
                c_stats.append(models.critic.train_step(micro, critic_loss))
                skips = count_skips(skips, a_stats[-1], cfg.train.max_consecutive_skips)
                if models.ema is not None:
                    models.ema.update()
        t3 = time.time()
        done = step + 1
        if done == start + 1:
            logger.info("memory plan (actor):\n%s", format_memory_report(models.actor.memory_report()))

        # ---- metrics (all ranks' rows)
        m = exp.response_mask
        lengths = m.sum(1)
        kl_seq = ppo_math.masked_sum(exp.kl, m, dim=1)
        truncated = (~empty) & (g.response_mask.sum(1) == r.max_new_tokens) & ~torch.isin(
            g.responses[:, -1], torch.tensor([eos], device=g.responses.device))
        kept = (~empty).float()
        sums = all_reduce_sum(torch.stack([
            (exp.score * kept).sum(), (exp.score.clamp(-p.clip_reward_value, p.clip_reward_value) * kept).sum(),
            kl_seq.sum(), lengths.sum(), kept.sum(), empty.sum(), truncated.sum(),
            torch.tensor(float(g.attention_mask.sum())),
        ]).double().cpu()).tolist()
        n_kept = max(sums[4], 1.0)
        n_rows = r.prompts_per_step
        times["generation_s"].append(t1 - t0)
        times["scoring_s"].append(t2 - t1)
        times["training_s"].append(t3 - t2)
        rec = {
            "reward": sums[0] / n_kept, "reward_clipped": sums[1] / n_kept, "kl": sums[2] / n_kept,
            "kl_coef": kl_ctl.value, "response_len": sums[3] / n_kept, "empty_responses": int(sums[5]),
            "truncated_responses": int(sums[6]),
            "actor_loss": _mean(a_stats, "loss"), "critic_loss": _mean(c_stats, "loss"),
            "entropy": _mean(a_stats, "entropy"), "clipfrac": _mean(a_stats, "clipfrac"),
            "approx_kl": _mean(a_stats, "approx_kl"), "value_error": _mean(c_stats, "value_error"),
            "vf_clipfrac": _mean(c_stats, "vf_clipfrac"), "actor_grad_norm": _mean(a_stats, "grad_norm"),
            "critic_grad_norm": _mean(c_stats, "grad_norm"), "actor_lr": a_stats[-1]["lr"],
            "generation_s": t1 - t0, "scoring_s": t2 - t1, "training_s": t3 - t2,
            "tokens_per_s": sums[7] / max(t3 - t0, 1e-9),
        }
        if p.ptx_coef:
            rec["ptx_loss"] = _mean(a_stats, "ptx_loss")
        kl_ctl.update(rec["kl"], n_rows)
        bar.update(1)
        if done % cfg.train.log_every == 0 or done == total:
            log.log(done, "train", **rec)
            bar.set_postfix(reward=f"{rec['reward']:.3f}", kl=f"{rec['kl']:.3f}", len=f"{rec['response_len']:.1f}")
        if cfg.train.eval_every and done % cfg.train.eval_every == 0 and done < total:
            ev = evaluate(models, eval_prompts, tok, cfg)
            log.log(done, "eval", **{k: v for k, v in ev.items() if k != "samples"})
            bar.write(f"step {done}: {_eval_line(ev)}")
        if cfg.train.save_every and (done % cfg.train.save_every == 0 or done == total):
            from engine import prune_checkpoints

            models.save(os.path.join(checkpoint_root(out_dir), f"step_{done:07d}"),
                        {"step": done, "kl_ctl": kl_ctl.state_dict(), "before": before})
            if info.is_main:
                prune_checkpoints(checkpoint_root(out_dir), cfg.train.keep_last_n)
    bar.close()

    # ---- final evaluation, export, summary
    after = evaluate(models, eval_prompts, tok, cfg)
    log.log(total, "eval", **{k: v for k, v in after.items() if k != "samples"})
    actor_sd, critic_sd = models.actor.full_state_dict(), models.critic.full_state_dict()
    ema_sd = None
    if models.ema is not None:
        with models.ema.swapped_in():
            ema_sd = models.actor.full_state_dict()
    summary: dict[str, Any] = {}
    if info.is_main:
        actor_cfg = model_cfg(cfg, cfg.actor.model, cfg.actor.lora)
        export_hf(actor_sd, models.actor.unwrapped, tok, os.path.join(out_dir, MODEL_SUBDIR), actor_cfg,
                  add_bos=cfg.data.add_bos)
        export_hf(critic_sd, models.critic.unwrapped, tok, os.path.join(out_dir, "critic"),
                  model_cfg(cfg, cfg.critic.model, cfg.critic.lora), add_bos=cfg.data.add_bos)
        if ema_sd is not None:
            export_hf(ema_sd, models.actor.unwrapped, tok, os.path.join(out_dir, "model_ema"), actor_cfg,
                      add_bos=cfg.data.add_bos)
        _plot(out_dir, p.kl_estimator)
        n = max(len(times["generation_s"]), 1)
        summary = {
            "stage": "ppo",
            "time_s": round(time.time() - t_start, 1),
            "steps": total,
            "gold_score_before": before.get("gold_score"),
            "gold_score_after": after.get("gold_score"),
            **{f"{k}_before": v for k, v in before.items() if k.startswith("gold_score/")},
            **{f"{k}_after": v for k, v in after.items() if k.startswith("gold_score/")},
            "kl": after.get("kl"),
            "reward_before": before.get("reward"),
            "reward_after": after.get("reward"),
            "kl_coef_final": kl_ctl.value,
            "empty_responses": sum(x.get("empty_responses", 0) for x in read_metrics(out_dir, "train")),
            "generation_path": models.actor.generation_path,
            "step_generation_s": sum(times["generation_s"]) / n,
            "step_scoring_s": sum(times["scoring_s"]) / n,
            "step_training_s": sum(times["training_s"]) / n,
            "model_dir": os.path.join(out_dir, MODEL_SUBDIR),
        }
        write_summary(out_dir, summary)
        for s in after.get("samples", []):
            print(f"  sample: {s['prompt']!r} -> {s['response']!r} (gold {s['score']})")
        print(f"PPO done ({out_dir}):\n{format_summary(summary)}", flush=True)
    log.finish()
    return summary


def _mean(stats: list[dict], key: str) -> float:
    vals = [s[key] for s in stats if key in s]
    return sum(vals) / len(vals) if vals else float("nan")


def _eval_line(ev: dict) -> str:
    parts = []
    if ev.get("gold_score") is not None:
        tasks = " ".join(f"{k.split('/')[1]}={v:.0f}" for k, v in ev.items() if k.startswith("gold_score/"))
        parts.append(f"gold score {ev['gold_score']:.1f} ({tasks})")
    if "kl" in ev:
        parts.append(f"KL {ev['kl']:.3f}, reward {ev['reward']:.3f}")
    return ", ".join(parts) or "no eval prompts"


def _plot(out_dir: str, kl_estimator: str) -> None:
    train, ev = read_metrics(out_dir, "train"), read_metrics(out_dir, "eval")
    plot_series(os.path.join(out_dir, "ppo.png"), "PPO", [
        ("reward", [("rollouts", *series(train, "reward")), ("held-out (sampled)", *series(ev, "reward"))]),
        (f"KL to reference\n(nats, {kl_estimator} est.)", [("rollouts", *series(train, "kl")),
                                                             ("held-out", *series(ev, "kl"))]),
        ("gold score (% exact)", [("held-out (greedy)", *series(ev, "gold_score"))]),
        ("response length", [("rollouts (tokens)", *series(train, "response_len"))]),
    ])


def main() -> None:
    stage_main("ppo", PPOConfig, run)


if __name__ == "__main__":
    main()
