"""Stage 3: PPO with four models: actor (trained), critic (trained), reference and reward (frozen);
or a critic-free algorithm (GRPO, RLOO, REINFORCE++) without the critic.

    python -m rlhf.ppo                                        # from outputs/sft + outputs/reward, CPU
    python -m rlhf.ppo actor.model=/runs/sft critic.model=/runs/rm ppo.kl_coef=0.05
    torchrun --nproc_per_node 2 -m rlhf.ppo engine=zero3 rollout.micro_batch_size=16
    python -m rlhf.ppo algorithm=grpo                         # grpo | rloo | reinforce_pp | gspo (conf/algorithm/)
    python -m rlhf.ppo algorithm=online_dpo                   # DPO on each step's best-vs-worst samples
    python -m rlhf.ppo algorithm=distill teacher.model=outputs/ppo actor.model=/runs/small_sft
    torchrun --nproc_per_node 4 -m rlhf.ppo engine.placement=split engine.generation_ranks=1 rollout.mode=async

One step: generate (the actor gathered once, `rollout.prompts_per_step` prompts x
`rollout.n_samples_per_prompt` samples, a prompt's group on one rank) -> score (old log-probs: the actor's
forward, or the sampler's while their measured gap allows, `ppo.old_logprobs`, rlhf/rl/old_logprobs.py;
reference log-probs, critic values, in `rollout.score_batch_size` rows per forward; `reward.sources`: the
reward model, the gold judge, an `answer` match, a user function or a weighted sum; rlhf/rl/rewards.py) -> rewards (-kl_coef x KL per token + the clipped score
on the last) -> advantages (`ppo.advantage_estimator`, a registry in rlhf/rl_math.py: gae with the
critic, or critic-free grpo / rloo / reinforce_pp; `algorithm=` sets it with its other keys) ->
update (`ppo.ppo_epochs` passes of mini-batches; rlhf/rl/update.py) -> metrics and the reward-hacking
alarms (rlhf/rl/alarms.py; `train.stop_on_alarm`). Without a critic or the `model` reward source those
models are not loaded.
`algorithm=online_dpo` (rlhf/rl/online_dpo.py) replaces the rewards/advantages/update by the DPO loss on
each prompt group's best vs worst response; `algorithm=distill` (rlhf/rl/distill.py) puts teacher.model in
the reference's place and makes -kl_coef x its per-token reverse KL the only reward.
`engine.placement=split` (rlhf/rl/split.py): the last engine.generation_ranks ranks only generate (`generation_rank`),
the others train and receive each step's rollout from them instead of generating it, sending the new weights after
each step; `rollout.mode=async` lets the generation ranks sample up to `rollout.max_staleness` steps ahead.
Held-out prompts (KL to the reference, reward, and the greedy gold score where a judge applies): the first
`data.num_eval_prompts` of `data.eval_prompts_path` (the shipped task's while data.path is the shipped
file), else of `data.eval_path`, else of `data.eval_size` of data.path's prompts, held out of training.
Dropout is disabled in all four models, so old and new log-probs come from the same function.
Writes to `output_dir`: config.yaml, metrics.jsonl, ppo.png, checkpoints/, model/ (the actor, HF),
critic/, model_ema/ (with ppo.ema_decay), eval_rows.jsonl (the held-out prompt rows), summary.json.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from engine import set_deterministic
from engine.checkpoint import rng_state, set_rng_state
from engine.distributed import DistInfo, Placement, all_gather_object, all_reduce_sum, init_distributed, split_world
from engine.generation import SamplingParams
from engine.inference import stream_seed
from engine.weight_stream import GenerationReplica, WeightReceiver
from rlhf.algos import rl as rl_math
from rlhf.config import PPOConfig
from rlhf.config.validate import engine_config, rollout_rows, validate_ppo
from rlhf.core.errors import ConfigError
from rlhf.core.hub import check_local
from rlhf.data import collate_prompts, load_rows, parse_prompts, parse_sft, tokenize_prompts, tokenize_sft
from rlhf.data.stage import StepOrder, held_out_source, stage_rows
from rlhf.evaluation.gold import Judge, eval_line, eval_prompts_of, gold_applies, gold_eval, gold_summary
from rlhf.modeling.load import (
    check_causal_lm, check_generation_backend, check_reward_model, disable_dropout, load_causal_lm, load_tokenizer,
)
from rlhf.rl import alarms, distill, multiturn, online_dpo, rewards, split
from rlhf.rl.environments import load_environment, make_runner
from rlhf.rl.experience import build_experience
from rlhf.rl.metrics import step_metrics
from rlhf.rl.models import Models, model_cfg
from rlhf.rl.old_logprobs import OldLogprobs
from rlhf.rl.rollout import Rollout, drop_uniform_groups, generate, mask_nonfinite, nonfinite_rows, rollout_seeds
from rlhf.rl.update import actor_loss, make_critic_loss, ptx_batches, update
from rlhf.run.app import seed_everything, setup_logging, stage_main
from rlhf.run.runlog import read_metrics
from rlhf.run.stage import Run, without_samples

logger = logging.getLogger("rlhf.ppo")


# ----------------------------------------------------------------------------- pieces


def row_streams(cfg: PPOConfig) -> bool:
    """Each rollout row its own sampling stream (a seed of the run's seed, the step and the prompt): deterministic
    mode, and vLLM (one seeded request per row, so its runs repeat and resume exactly)."""
    return cfg.engine.deterministic or cfg.engine.generation == "vllm"


def sampling(cfg: PPOConfig) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, greedy=False, temperature=r.temperature, top_k=r.top_k,
                          top_p=r.top_p)


# ----------------------------------------------------------------------------- evaluation


def evaluate(models: Models, prompts: list, tok: Any, cfg: PPOConfig, group_offset: int = 0,
             gold: bool = True, tools: Any = None) -> dict[str, Any]:
    """Greedy gold score (with `gold`: a judge applies to the prompts), and the sampled policy's KL to the
    reference and reward score, on held-out prompts (prompt i is row `group_offset + i` of the reward
    source's table; a row it fails on is left out). With `tools` (rollout.env: (runner, settings, glue,
    rows)), also the greedy gold score with the environment (gold_score_tool; multiturn.tool_eval): the
    plain gold score is then the one without the tool."""
    info = models.actor.info
    if not prompts:
        return {}
    n = len(prompts) // info.world_size  # equal rows per rank: the scoring forwards are collective
    mine = prompts[info.rank * n : (info.rank + 1) * n]
    det = cfg.engine.deterministic  # a fixed prompt width and per-row streams: batch-invariant samples
    batch = collate_prompts([{"input_ids": p.ids} for p in mine], tok.pad_token_id,
                            max(len(p.ids) for p in prompts) if det else None)
    ids, mask = batch["input_ids"].to(info.device), batch["attention_mask"].to(info.device)
    group = group_offset + info.rank * n + torch.arange(n, device=info.device)
    seeds = {"row_seeds": torch.tensor([stream_seed(cfg.seed + 1, i) for i in group.tolist()])} if det else {}
    with models.actor.generation() as gen:
        out = gold_eval(gen, prompts, tok, cfg.eval, info) if gold else {}
        with torch.random.fork_rng(devices=[info.device] if info.device.type == "cuda" else []):
            torch.manual_seed(cfg.seed + 1)
            g = gen.generate(ids, mask, sampling(cfg), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             **seeds)
    # every row scored, the empty ones too (the training step drops those from its update)
    scored = models.score(Rollout.from_generation(g, group, tok.eos_token_id, cfg.rollout.max_new_tokens,
                                                  drop_empty=False))
    rewards.check_step(models.reward_source, scored["score"], "the held-out evaluation")  # no reward: stop
    kept = (~nonfinite_rows(scored, g.response_mask)[0]).double()  # a NaN/inf row is left out (counted)
    # the same estimator as the reward penalty (ppo.kl_estimator), so the reported KL names one thing
    kl = rl_math.masked_sum(rl_math.kl_estimate(scored["logp_old"], scored["logp_ref"], cfg.ppo.kl_estimator),
                             g.response_mask.float(), dim=1)
    sums = all_reduce_sum(torch.stack([kl.double() @ kept, scored["score"].double() @ kept, kept.sum(),
                                       (1 - kept).sum()]))
    out["kl"] = (sums[0] / sums[2].clamp(min=1)).item()
    out["reward"] = (sums[1] / sums[2]).item() if sums[2] > 0 else float("nan")
    if (std := rewards.disagreement(models.reward_source)) is not None:  # a reward ensemble's, on the kept rows
        d = all_reduce_sum(torch.stack([std.double().nan_to_num() @ kept, kept.sum()]))
        out["reward_disagreement"] = (d[0] / d[1]).item() if d[1] > 0 else float("nan")
    if sums[3] > 0:
        out["nonfinite_rows"] = int(sums[3])
    out["samples"] = eval_samples(out.get("samples", []), prompts, g, tok, scored, kl, models.reward_source)
    if tools is not None and gold:
        runner, settings, glue, rows = tools
        judge = Judge(cfg.eval)
        tool = multiturn.tool_eval(models.actor, prompts, rows, tok, runner, settings, glue,
                                   lambda p, text: judge(p, text), cfg.eval.batch_size)
        by_prompt = {t.pop("prompt"): t for t in tool.pop("tool_samples")}  # this rank's episodes
        out["samples"] = [{**s, **{f"tool_{k}": v for k, v in by_prompt.get(s["prompt"], {}).items()}}
                          for s in out["samples"]]
        out.update(tool)
    return out


def eval_samples(greedy: list[dict], prompts: list, g: Any, tok: Any, scored: dict, kl: torch.Tensor,
                 source: Any) -> list[dict]:
    """Per held-out prompt (in order, all ranks'): the greedy response and its gold score (`greedy`, from
    gold_eval; none without a judge), and the sampled response with its reward, each reward source's
    score (a weighted sum's parts), its KL to the reference and length in tokens."""
    parts = source.last_scores if isinstance(source, rewards.WeightedSum) else {}
    texts = tok.batch_decode(g.responses.masked_fill(g.response_mask == 0, tok.pad_token_id), skip_special_tokens=True)
    mine = [{"sampled_response": t, "reward": float(scored["score"][i]),
             **{f"reward/{name}": float(v[i]) for name, v in parts.items()},
             "kl": float(kl[i]), "sampled_length": int(g.response_mask[i].sum())} for i, t in enumerate(texts)]
    sampled = [row for part in all_gather_object(mine) for row in part]  # rank order = prompt order
    by_prompt = {s["prompt"]: s for s in greedy}
    return [{"task": p.task, "prompt": p.text, **{k: v for k, v in by_prompt.get(p.text, {}).items()
                                                  if k not in ("task", "prompt")}, **row}
            for p, row in zip(prompts, sampled)]


# ----------------------------------------------------------------------------- the run


def split_placement(cfg: PPOConfig) -> Placement | None:
    """engine.placement=split: the job split into training and generation ranks (engine/distributed.py)."""
    if cfg.engine.placement != "split":
        return None
    init_distributed(timeout_s=cfg.engine.timeout_s)
    try:
        return split_world(cfg.engine.generation_ranks)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def generation_rank(cfg: PPOConfig, placement: Placement) -> dict[str, Any]:
    """A generation rank of a split placement: the training prompts and a copy of the actor, then the
    generator loop (rlhf/rl/split.py) until the trainers close the weight stream. Writes nothing."""
    set_deterministic(cfg.engine.deterministic)
    info = init_distributed()
    setup_logging(False)
    trainers = len(placement.trainer_ranks)
    validate_ppo(cfg, DistInfo(rank=0, world_size=trainers, local_rank=info.local_rank, device=info.device,
                               is_main=False))  # the trainers' batch arithmetic, the same errors
    seed_everything(cfg.seed)
    r, d = cfg.rollout, cfg.data
    tok = load_tokenizer(model_cfg(cfg, cfg.actor.model), key="actor")
    rows, _ = stage_rows(d, stage=2, hold_out=not d.eval_prompts_path)
    feats, _ = tokenize_prompts(parse_prompts(rows, tok), tok, d.max_prompt_len, d.overlong, d.add_bos)
    order = StepOrder(len(feats), r.prompts_per_step, cfg.seed, key="rollout.prompts_per_step")
    total = cfg.train.max_steps or cfg.train.epochs * order.steps_per_epoch
    model = disable_dropout(load_causal_lm(model_cfg(cfg, cfg.actor.model), tok, seed=cfg.seed, key="actor", lora=False))
    replica = GenerationReplica(model, engine_config(cfg.engine, info), info,
                                WeightReceiver(placement.stream_group, src=0, device=info.device))
    width = max(len(f["input_ids"]) for f in feats) if cfg.engine.deterministic else None
    eos, pad = tok.eos_token_id, tok.pad_token_id

    def make_rollout(step: int, trainer: int) -> Rollout:  # trainer `trainer`'s rows, as it would sample them
        idx = [i for i in order.rank_rows(step, trainer, trainers, 1)[0] for _ in range(r.n_samples_per_prompt)]
        seeds = rollout_seeds(cfg.seed, step, idx, r.n_samples_per_prompt) if row_streams(cfg) else None
        return generate(replica, collate_prompts([feats[i] for i in idx], pad, width), torch.tensor(idx), sampling(cfg),
                        eos, pad, seeds)

    return split.generator_loop(replica, placement, cfg, total, make_rollout)


def run(cfg: PPOConfig) -> dict[str, Any]:
    placement = split_placement(cfg)  # engine.placement=split: this rank trains or only generates
    if placement is not None and placement.role == "generate":
        return generation_rank(cfg, placement)
    run, _ = Run.open("ppo", "PPO", cfg, cfg.train, validate_ppo)
    info, r, p = run.info, cfg.rollout, cfg.ppo
    if cfg.model.name_or_path is not None:
        raise ConfigError("model.name_or_path is not used by PPO: set actor.model and critic.model "
                          "(reference.model / reward_model.model default to them)")
    est = rl_math.advantage_estimator(p.advantage_estimator)
    distilling = distill.is_distill(cfg)  # the teacher in the reference's place, no reward source (rl/distill.py)
    needs_rm = "model" in cfg.reward.sources and not distilling
    # the critic's path is read only for a critic, or as the reward model's default source
    for key, path in (("actor.model", cfg.actor.model), ("critic.model", cfg.critic.model)):
        if key == "actor.model" or est.needs_critic or (needs_rm and cfg.reward_model.model is None):
            check_local(path, key)  # names the stage to run first
    if needs_rm:
        for i, path in enumerate(cfg.reward.ensemble_models):
            check_local(path, f"reward.ensemble_models[{i}]")
    for key, path in (("actor", cfg.actor.model), ("reference", cfg.reference.model)):
        check_causal_lm(path, key)  # a reward model as the policy: refused before the data and any weights
    if needs_rm:  # and a policy as a reward model (the critic may start from one: it learns its head)
        check_reward_model(cfg.reward_model.model or cfg.critic.model,
                           "reward_model.model" if cfg.reward_model.model else "critic.model (the reward model's "
                                                                               "default, reward_model.model=null)")
        for i, path in enumerate(cfg.reward.ensemble_models):
            check_reward_model(path, f"reward.ensemble_models[{i}]")

    # ---- data
    tok = load_tokenizer(model_cfg(cfg, cfg.actor.model), key="actor")
    check_generation_backend(cfg.engine.generation, model_cfg(cfg, cfg.actor.model), tok, "actor", info.device.type)
    if distilling:  # a local causal LM with the student's tokenizer, before the data and any weights
        distill.check_teacher(cfg, tok, model_cfg)
    d = cfg.data
    # the held-out prompts: data.eval_prompts_path's, else data.eval_path's or data.eval_size of data.path's
    rows, held = stage_rows(d, stage=2, hold_out=not d.eval_prompts_path)
    feats, stats = tokenize_prompts(parse_prompts(rows, tok), tok, d.max_prompt_len, d.overlong, d.add_bos)
    if d.eval_prompts_path:
        held = load_rows(d.eval_prompts_path, d.eval_split, d.cache_dir, key="data.eval_prompts_path")
        eval_source = f"data.eval_prompts_path={d.eval_prompts_path}"
    else:
        eval_source = held_out_source(d, stage=2)
    held = held[: d.num_eval_prompts] if d.num_eval_prompts else held
    eval_prompts = eval_prompts_of(held, d, tok)
    held_out = run.held_out(held, len(eval_prompts), "prompts", eval_source)
    gold = gold_applies(eval_prompts, eval_source, cfg.eval)
    order = StepOrder(len(feats), r.prompts_per_step, cfg.seed, key="rollout.prompts_per_step")
    total = cfg.train.max_steps or cfg.train.epochs * order.steps_per_epoch
    minis = rollout_rows(r) // r.mini_batch_size  # the batch sizes count rows: prompts x n_samples_per_prompt
    if p.objective == "online_dpo":  # one optimizer step per ppo epoch, over all of the step's pairs
        minis = 1
    n_updates = total * p.ppo_epochs * minis
    ptx_feats, ptx_order = None, None
    if p.ptx_coef > 0:
        if not cfg.ptx_path:
            raise ConfigError("ppo.ptx_coef > 0 needs ptx_path (SFT data for the pretraining loss)")
        ptx_feats, _ = tokenize_sft(parse_sft(load_rows(cfg.ptx_path), tok), tok, d.max_len, d.max_prompt_len,
                                    d.overlong, d.add_bos, d.assistant_only_loss)
        ptx_order = StepOrder(len(ptx_feats), r.micro_batch_size * info.world_size, cfg.seed + 1, key="ptx_path")
    logger.info("%s: %d prompts (%s); %d steps of %d prompts x %d samples, %d actor%s updates",
                p.advantage_estimator if p.objective == "rl" else p.objective, len(feats), stats, total, r.prompts_per_step,
                r.n_samples_per_prompt, n_updates, "/critic" if est.needs_critic else " (no critic)")

    # ---- reward source (rlhf/rl/rewards.py): prompt rows of training, then of evaluation (group offset)
    table = [rewards.prompt_row(f["prompt"], f["answer"], f["meta"]) for f in feats]
    eval_table = [rewards.prompt_row(e.text, e.answer, {"task": e.task} if e.task else {}) for e in eval_prompts]
    if distilling:  # the only reward: -kl_coef x the per-token reverse KL to the teacher
        source = distill.NoReward()
        logger.info("reward: -%g x the per-token reverse KL to teacher.model=%s (no reward model loaded)",
                    p.kl_coef, cfg.teacher.model)
    else:
        rewards.check_rows(cfg.reward.sources, table, f"data.path={d.path!r}")
        rewards.check_rows(cfg.reward.sources, eval_table, f"the held-out prompts ({eval_source})")
        if "function" in cfg.reward.sources:  # called on the first prompt rows: one that scores nothing stops here
            rewards.check_function(cfg.reward, tok, table, f"data.path={d.path!r}")
        if "http" in cfg.reward.sources:  # GET /health: a server that is not there stops the run before any weights
            health = rewards.check_http(cfg.reward)
            logger.info("reward server %s: %s", cfg.reward.url, health.get("source"))
        source = None if needs_rm else rewards.build(cfg.reward, tok, table + eval_table)
        logger.info("reward: %s%s", rewards.describe(cfg.reward), "" if needs_rm else " (no reward model loaded)")

    # ---- the environment (rollout.env: multi-turn episodes, rlhf/rl/multiturn.py), before any weights load
    env = None
    if r.env:
        if p.objective != "rl":
            raise ConfigError(f"rollout.env works with the RL objective, not ppo.objective={p.objective}")
        if cfg.engine.placement == "split":  # the generation ranks sample single-turn responses only
            raise ConfigError("rollout.env (multi-turn episodes) runs with engine.placement=colocated, not split")
        settings = multiturn.Settings.of(r)
        runner = make_runner(load_environment(r.env), r.env_workers, r.env_timeout_s)
        glue = multiturn.template_glue(tok, tuple(r.turn_stop))
        env = (runner, settings, glue, eval_table)
        logger.info("multi-turn: rollout.env=%s, up to %d turns of %d tokens, %d tokens per episode; glue: %s; "
                    "%s", r.env, r.max_turns, r.max_new_tokens, settings.budget, glue.source,
                    f"{r.env_workers} env workers" if r.env_workers else "environments in this process")

    # ---- models
    models = Models(cfg, tok, info, n_updates, reward_source=source)
    if needs_rm:  # the reward model's source, alone or inside a weighted sum
        models.reward_source = rewards.build(cfg.reward, tok, table + eval_table, reward_model=models.reward_source)
    # ppo.adaptive_kl moves the coefficient of the KL's placement: the reward penalty (ppo.kl_coef), or the loss
    # term (ppo.kl_loss_coef) when the reward has none (GRPO's placement)
    in_loss = p.adaptive_kl and not p.kl_coef and p.kl_loss_coef > 0
    init = p.kl_loss_coef if in_loss else p.kl_coef
    floor = init if p.kl_coef_min is None else p.kl_coef_min  # ppo.kl_coef_min=null: a KL budget
    kl_ctl = rl_math.make_kl_controller(init, p.adaptive_kl, p.kl_target, p.kl_horizon, floor if p.adaptive_kl else 0.0)
    reward_kl_coef = (lambda: 0.0) if in_loss else (lambda: kl_ctl.value)
    monitor = alarms.Monitor(cfg.alarms)
    old_logprobs = OldLogprobs(p, r)  # ppo.old_logprobs: the actor's scoring forward or the sampler's (rl/old_logprobs.py)

    best = BestEval(cfg.train, "gold_score" if gold["eval_prompts_source"] else "reward")

    def evaluate_and_watch() -> dict[str, Any]:  # the gold alarm is checked at each evaluation
        step = len(monitor.history)
        ev = monitor.after_eval(step, evaluate(models, eval_prompts, tok, cfg, len(table),
                                               gold=bool(gold["eval_prompts_source"]), tools=env))
        alarms.stop_run(run, monitor, cfg.train.stop_on_alarm)
        if best.after_eval(step, ev) and best.keeps_actor:
            models.snapshot_actor()  # collective
        if best.over is not None and step < total:  # (the final evaluation ends the run anyway)
            run.stop(f"train.kl_budget: held-out KL {best.over['kl']:.4g} at step {step} is over the budget "
                     f"{cfg.train.kl_budget:g}; the actor of step {best.step} (KL {best.eval.get('kl', 0.0):.4g}) is exported")
        elif best.exhausted() and step < total:
            run.stop(f"train.early_stop_patience: {best.since} evaluations without a better held-out {best.metric} "
                     f"than step {best.step}'s {best.score:.4g}")
        return ev

    run.begin(models, total, evaluate_and_watch, _eval_line, memory=models,
              state_fn=lambda: {"kl_ctl": kl_ctl.state_dict(), "alarms": monitor.state_dict(),
                                "old_logprobs": old_logprobs.state_dict(), "best": best.state_dict()})
    if "best" in run.extra_state:
        best.load_state_dict(run.extra_state["best"])
    if "kl_ctl" in run.extra_state:
        kl_ctl.load_state_dict(run.extra_state["kl_ctl"])
    if "alarms" in run.extra_state:
        monitor.load_state_dict(run.extra_state["alarms"])
    if "old_logprobs" in run.extra_state:
        old_logprobs.load_state_dict(run.extra_state["old_logprobs"])
    side = None  # engine.placement=split: the rollouts come from the generation ranks (rlhf/rl/split.py)
    if placement is not None:
        side = split.TrainerSide(models.actor, placement, cfg, start=run.start, total=total)
        side.send_weights(run.start)

    # ---- the loop: generate -> score -> rewards + advantages -> update -> metrics
    dpo = p.objective == "online_dpo"  # the pair loss on each step's best-vs-worst responses (rl/online_dpo.py)
    losses = ((online_dpo.make_loss(cfg) if dpo else actor_loss(cfg, (lambda: kl_ctl.value) if in_loss else None)),
              make_critic_loss(p.cliprange_value))
    eos, pad = tok.eos_token_id, tok.pad_token_id
    micro_per_step = p.ppo_epochs * minis * (r.mini_batch_size // info.world_size // r.micro_batch_size)
    times: dict[str, list[float]] = {"generation_s": [], "scoring_s": [], "training_s": []}
    # engine.deterministic: every rollout batch padded to the longest prompt, each row its own sampling stream
    width = max(len(f["input_ids"]) for f in feats) if cfg.engine.deterministic else None
    for step in run.steps():
        t0 = time.time()
        rng = rng_state()  # a step that gets no reward is checkpointed as it began
        # this rank's prompts, each n_samples_per_prompt times in a row (a group stays on its rank)
        idx = [i for i in order.rank_rows(step, info.rank, info.world_size, 1)[0] for _ in range(r.n_samples_per_prompt)]
        seeds = rollout_seeds(cfg.seed, step, idx, r.n_samples_per_prompt) if row_streams(cfg) else None
        episodes = None
        if side is None and env is not None:  # one episode per row, over turns with the environment
            rollout, episodes = multiturn.generate_episodes(
                models.actor, collate_prompts([feats[i] for i in idx], pad, width), torch.tensor(idx),
                [table[i] for i in idx], sampling(cfg), tok, env[0], env[1], env[2], seeds)
            meta = {}
        elif side is None:
            rollout, meta = generate(models.actor, collate_prompts([feats[i] for i in idx], pad, width),
                                     torch.tensor(idx), sampling(cfg), eos, pad, seeds), {}
        else:  # sampled on a generation rank with these very rows and seeds, with a version <= max_staleness old
            rollout, meta = side.receive(step)
        t1 = time.time()
        from_sampler = not old_logprobs.recompute(step)
        try:
            scored = models.score(rollout, old_from_sampler=from_sampler)
            rewards.check_step(models.reward_source, scored["score"], f"step {step + 1}")
            if episodes is not None:  # faulted episodes over the fraction (or all): stopped before the step trains
                env_rec = multiturn.step_env_metrics(episodes, info.device)
                multiturn.check_failures(env_rec, episodes, env[1])
        except (*rewards.STOPS, multiturn.EpisodesFailed):  # the state after `step` steps kept, this step redone
            set_rng_state(rng)  # as it was when the step began, so that the resumed step samples the same
            if step > run.start or run.resume_path is None:  # (unless resumed from that very checkpoint)
                logger.error("step %d cannot train (no reward, or its episodes faulted): checkpoint %s written "
                             "before stopping", step + 1, run.save(step))
            raise
        reward_errors = rewards.report_errors(models.reward_source, step + 1)  # those rows' scores are NaN
        if episodes is not None:  # the environment's reward parts, summed per episode, on top of reward.sources
            scored["score"] = scored["score"] + episodes.env_reward.to(scored["score"].device)
        mask_nonfinite(rollout, scored)  # a NaN/inf from any model drops its row, counted and named
        dropped = drop_uniform_groups(rollout, scored["score"]) if p.dynamic_sampling else 0
        exp = build_experience(rollout.sequences, rollout.attention_mask, rollout.response_mask, rollout.prompt_len,
                               scored, kl_coef=reward_kl_coef(), kl_estimator=p.kl_estimator,
                               clip_reward_value=p.clip_reward_value, gamma=p.gamma, lam=p.lam,
                               estimator=p.advantage_estimator, group=rollout.group, whiten=p.whiten_advantages,
                               norm_by_std=p.norm_by_std, max_len=r.max_new_tokens,
                               overlong_buffer=p.overlong_buffer, overlong_penalty=p.overlong_penalty)
        t2 = time.time()
        ptx = None if ptx_feats is None else ptx_batches(ptx_feats, ptx_order, step * micro_per_step, info, pad)
        if dpo:
            pairs = online_dpo.pairs_of(rollout, scored["score"])
            a_stats, c_stats = online_dpo.update(models, rollout, scored, pairs, cfg, losses[0], run), []
        else:
            a_stats, c_stats = update(models, exp, cfg, losses, ptx, run)
        if side is not None:  # the new version on its way to the generators while this step's metrics are made
            side.after_step(step)
        t3 = time.time()
        rec = step_metrics(rollout, exp, a_stats, c_stats, cfg, reward_kl_coef(), (t0, t1, t2, t3), dropped, from_sampler)
        if in_loss:  # the coefficient this step's loss used
            rec["kl_loss_coef"] = kl_ctl.value
        old_logprobs.after_step(step, rec)  # a recomputed step's gap decides the next steps' source
        rec.update(meta)  # split: policy_version, staleness, the weight transfer's bytes / s / GB/s
        rec.update(models.actor.generation_metrics())  # vLLM's sync bytes / s / GB/s, the phases' peak memory
        if dpo:
            rec.update(online_dpo.pair_metrics(pairs, scored["score"], a_stats))
        for key in times:
            times[key].append(rec[key])
        kl_ctl.update(rec["kl"], rollout_rows(r))
        rec["reward_errors"] = int(all_reduce_sum(torch.tensor([float(reward_errors)], device=info.device)).item())
        rec.update(rewards.http_stats(models.reward_source))  # this rank's http requests, p50/p99 latency
        if episodes is not None:  # turns, tool calls, observation tokens, env seconds, faults (summed over ranks)
            rec.update(env_rec)
        if (std := rewards.disagreement(models.reward_source)) is not None:  # a reward ensemble: its members' std
            ok = torch.isfinite(std).double()
            d = all_reduce_sum(torch.stack([std.double().nan_to_num() @ ok, ok.sum()]))
            rec["reward_disagreement"] = (d[0] / d[1]).item() if d[1] > 0 else float("nan")
        rec.update(monitor.after_step(step + 1, rec))  # reward-hacking alarms (rlhf/rl/alarms.py)
        alarms.stop_run(run, monitor, cfg.train.stop_on_alarm)
        if run.logs(step) or monitor.fired:
            run.log_train(step, rec, dict(reward=f"{rec['reward']:.3f}", kl=f"{rec['kl']:.3f}",
                                          len=f"{rec['response_len']:.1f}"))

    # ---- final evaluation, export, summary
    if side is not None:  # the generators stopped; what they sampled past the last step trained is discarded
        side.stop()
    last = run.evaluate_after()
    if env is not None:
        env[0].close()  # every episode's environment
        env[0].shutdown()  # and the process pool's workers (rollout.env_workers > 0)
    exported = best.exported(run.total, last)  # train.export_best: the best evaluation's step, else the last
    after = exported["eval"]
    out_dir = cfg.output_dir
    model_dir = models.export(tok, cfg, models.best_actor if exported["step"] != run.total else None)
    if cfg.train.export_best or best.over is not None:
        logger.info("%s: exported the actor of step %d (held-out %s %.4g, KL %.4g; the last step %d's: %.4g, KL %.4g) "
                    "as %s", best.exported_by(), exported["step"], best.metric, after.get(best.metric, float("nan")),
                    after.get("kl", float("nan")), run.total, last.get(best.metric, float("nan")),
                    last.get("kl", float("nan")), model_dir)
    before, n = run.before, max(len(times["generation_s"]), 1)
    return run.finish({
        **held_out,
        **gold,
        **gold_summary(before, after),
        **({"gold_score_tool_before": before.get("gold_score_tool"), "gold_score_tool_after": after.get("gold_score_tool"),
            "tool_calls_eval_after": after.get("tool_calls_eval"), "turns_eval_after": after.get("turns_eval"),
            **{k: sum(x.get(k, 0) for x in read_metrics(out_dir, "train")) for k in ("env_errors", "env_timeouts",
                                                                                  "template_mismatch")},
            } if env else {}),
        "exported_step": exported["step"],  # the step whose actor is model/ (train.export_best: the best evaluation's)
        **({"exported_by": best.exported_by(), "last_step_eval": without_samples(last)}
           if cfg.train.export_best or cfg.train.kl_budget is not None else {}),
        **({"kl_budget": cfg.train.kl_budget, "kl_budget_exceeded": best.over} if cfg.train.kl_budget is not None else {}),
        **({"reward_disagreement": after.get("reward_disagreement")} if "reward_disagreement" in after else {}),
        "kl": after.get("kl"),
        "reward_before": before.get("reward"),
        "reward_after": after.get("reward"),
        ("kl_loss_coef_final" if in_loss else "kl_coef_final"): kl_ctl.value,
        "advantage_estimator": p.advantage_estimator,
        "objective": p.objective,
        **({"teacher": cfg.teacher.model} if distilling else {}),
        **({"pairs": sum(x.get("pairs", 0) for x in read_metrics(out_dir, "train")),
            "tied_groups": sum(x.get("tied_groups", 0) for x in read_metrics(out_dir, "train"))} if dpo else {}),
        "samples_per_step": rollout_rows(r),
        "empty_responses": sum(x.get("empty_responses", 0) for x in read_metrics(out_dir, "train")),
        **rollout_lengths(read_metrics(out_dir, "train"), rollout_rows(r)),
        "reward_sources": list(cfg.reward.sources),
        "reward_errors": sum(x.get("reward_errors", 0) for x in read_metrics(out_dir, "train")),
        "alarms_fired": monitor.first_fired,  # name -> the first step it fired
        "stopped_early": run.stop_reason,
        "generation_path": models.actor.generation_path,
        "placement": cfg.engine.placement,
        **({"rollout_mode": r.mode, "max_staleness": split.staleness_bound(r), **side.summary()} if side else {}),
        **{f"step_{k}": sum(v) / n for k, v in times.items()},
    }, model_dir, plot(p.kl_estimator), last.get("samples", []))


def rollout_lengths(rows: list[dict[str, Any]], per_step: int) -> dict[str, Any]:
    """The sampled responses' lengths over the run, from metrics.jsonl's train records (one per step when
    train.log_every=1, else every log_every-th step's): truncated_responses (those that hit
    rollout.max_new_tokens without an eos, summed), truncated_rate (that over the responses of those steps)
    and response_len_rollouts (their mean tokens)."""
    steps = [x for x in rows if "truncated_responses" in x]
    if not steps:
        return {"truncated_responses": 0, "truncated_rate": None, "response_len_rollouts": None}
    cut = sum(x["truncated_responses"] for x in steps)
    return {"truncated_responses": cut, "truncated_rate": cut / (per_step * len(steps)),
            "response_len_rollouts": sum(x["response_len"] for x in steps) / len(steps)}


class BestEval:
    """The best held-out evaluation so far (`metric`: gold_score where a judge applies, else the sampled
    reward; higher is better, the earliest of equals kept), for train.export_best and
    train.early_stop_patience: `since` counts the evaluations after it that did not beat it. With
    train.kl_budget only evaluations whose held-out KL is within the budget count, the first one over it
    is `over` ({step, kl}: the run stops there), and without export_best the latest within the budget is
    the one kept. Its state (checkpointed) makes a resumed run choose as the uninterrupted one does."""

    def __init__(self, train: Any, metric: str):
        self.metric, self.patience, self.use_best = metric, train.early_stop_patience, train.export_best
        self.kl_budget: float | None = train.kl_budget
        self.keeps_actor = self.use_best or self.kl_budget is not None  # snapshots the actor it keeps
        self.step: int | None = None
        self.score = float("-inf")
        self.since = 0
        self.eval: dict[str, Any] = {}
        self.over: dict[str, Any] | None = None

    def exported_by(self) -> str:
        if self.kl_budget is None:
            return f"best held-out {self.metric}"
        within = f"within train.kl_budget={self.kl_budget:g} (held-out KL to the reference)"
        return f"best held-out {self.metric} {within}" if self.use_best else f"the last evaluation {within}"

    def after_eval(self, step: int, ev: dict[str, Any]) -> bool:
        """Record the evaluation after `step` steps; True when it is the new best (the one to keep)."""
        if self.kl_budget is not None:
            kl = ev.get("kl")
            if kl is None:
                raise ConfigError("train.kl_budget is checked on the held-out KL, and this run's evaluations have none "
                                  "(no held-out prompts: set data.eval_prompts_path / data.num_eval_prompts)")
            if self.over is not None or not kl <= self.kl_budget:  # NaN is over
                self.over = self.over or {"step": step, "kl": float(kl)}
                return False
            if not self.use_best:  # the latest evaluation within the budget
                value = ev.get(self.metric)
                self.step, self.since, self.eval = step, 0, without_samples(ev)
                self.score = float(value) if value is not None else float("nan")
                return True
        value = ev.get(self.metric)
        if value is None or not math.isfinite(value):
            return False
        if self.step is not None and value <= self.score:
            self.since += 1
            return False
        self.step, self.score, self.since, self.eval = step, float(value), 0, without_samples(ev)
        return True

    def exhausted(self) -> bool:
        return self.patience > 0 and self.since >= self.patience

    def exported(self, last_step: int, last: dict[str, Any]) -> dict[str, Any]:
        """{step, eval} of the actor to export: the best evaluation's with train.export_best (when it is not
        the last step's), else the last step's."""
        if self.step is None or self.step == last_step or not self.keeps_actor:
            return {"step": last_step, "eval": last}
        return {"step": self.step, "eval": self.eval}

    def state_dict(self) -> dict:
        return {"step": self.step, "score": self.score, "since": self.since, "eval": self.eval, "over": self.over}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.score, self.since = state["step"], float(state["score"]), int(state["since"])
        self.eval, self.over = dict(state["eval"]), state.get("over")


def _eval_line(ev: dict) -> str:
    return eval_line(f"KL {ev['kl']:.3f}, reward {ev['reward']:.3f}" if "kl" in ev else None, ev, "no eval prompts")


def plot(kl_estimator: str) -> list:
    return [
        ("reward", [("rollouts", "train", "reward"), ("held-out (sampled)", "eval", "reward")]),
        (f"KL to reference\n(nats, {kl_estimator} est.)", [("rollouts", "train", "kl"), ("held-out", "eval", "kl")]),
        ("gold score (% exact)", [("held-out (greedy)", "eval", "gold_score")]),
        ("response length", [("rollouts (tokens)", "train", "response_len")]),
    ]


def main() -> None:
    stage_main("ppo", PPOConfig, run)


if __name__ == "__main__":
    main()
