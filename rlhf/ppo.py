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
from dataclasses import dataclass
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
    check_generation_backend(cfg.engine.generation, model_cfg(cfg, cfg.actor.model), tok, "actor", info.device.type)
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

    try:
        return split.generator_loop(replica, placement, cfg, total, make_rollout)
    finally:
        replica.close()


def run(cfg: PPOConfig) -> dict[str, Any]:
    """The RL stage, top to bottom: open the run, refuse what cannot run before anything loads (`check_inputs`),
    the prompts (`Prompts`), the reward source (`reward_source`) and the environment (`environment`), then
    the models and the loop's state (`RLLoop`), one `RLLoop.step` per training step, and `RLLoop.finish`."""
    placement = split_placement(cfg)  # engine.placement=split: this rank trains or only generates
    if placement is not None and placement.role == "generate":
        return generation_rank(cfg, placement)
    run, _ = Run.open("ppo", "PPO", cfg, cfg.train, validate_ppo)
    check_inputs(cfg)
    tok = load_tokenizer(model_cfg(cfg, cfg.actor.model), key="actor")
    check_generation_backend(cfg.engine.generation, model_cfg(cfg, cfg.actor.model), tok, "actor", run.info.device.type)
    if distill.is_distill(cfg):  # a local causal LM with the student's tokenizer, before the data and any weights
        distill.check_teacher(cfg, tok, model_cfg)
    data = Prompts.load(cfg, run, tok)
    source = reward_source(cfg, tok, data)
    env = environment(cfg, tok, data)
    loop = RLLoop(cfg, run, tok, data, source, env, placement)
    for step in run.steps():
        loop.step(step)
    return loop.finish()


# ----------------------------------------------------------------------------- before any weights load


def needs_reward_model(cfg: PPOConfig) -> bool:
    """The `model` reward source (alone or in a weighted sum) loads a reward model; distillation has none."""
    return "model" in cfg.reward.sources and not distill.is_distill(cfg)


def check_inputs(cfg: PPOConfig) -> None:
    """The model paths that will load exist (naming the stage to run first) and each model is of its role: a
    reward model as the policy or a policy as the reward model is refused before the data and any weights."""
    if cfg.model.name_or_path is not None:
        raise ConfigError("model.name_or_path is not used by PPO: set actor.model and critic.model "
                          "(reference.model / reward_model.model default to them)")
    est = rl_math.advantage_estimator(cfg.ppo.advantage_estimator)
    needs_rm = needs_reward_model(cfg)
    # the critic's path is read only for a critic, or as the reward model's default source
    for key, path in (("actor.model", cfg.actor.model), ("critic.model", cfg.critic.model)):
        if key == "actor.model" or est.needs_critic or (needs_rm and cfg.reward_model.model is None):
            check_local(path, key)  # names the stage to run first
    if needs_rm:
        for i, path in enumerate(cfg.reward.ensemble_models):
            check_local(path, f"reward.ensemble_models[{i}]")
    for key, path in (("actor", cfg.actor.model), ("reference", cfg.reference.model)):
        check_causal_lm(path, key)
    if needs_rm:  # (the critic may start from a policy: it learns its head)
        check_reward_model(cfg.reward_model.model or cfg.critic.model,
                           "reward_model.model" if cfg.reward_model.model else "critic.model (the reward model's "
                                                                               "default, reward_model.model=null)")
        for i, path in enumerate(cfg.reward.ensemble_models):
            check_reward_model(path, f"reward.ensemble_models[{i}]")


@dataclass
class Prompts:
    """The run's prompts: the training prompts (`feats`, tokenized; `table`, the reward source's rows) in the
    step order, the held-out prompts (`eval_prompts`, `eval_table`: the reward source's rows after the training
    ones), what the summary says of them (`held_out`, `gold`), the run's length, and the ptx loss's SFT rows."""
    feats: list
    table: list
    order: StepOrder
    total: int  # training steps
    n_updates: int  # optimizer steps of the actor (the learning-rate schedule's length)
    eval_prompts: list
    eval_table: list
    eval_source: str
    held_out: dict[str, Any]
    gold: dict[str, Any]
    ptx_feats: list | None
    ptx_order: StepOrder | None

    @classmethod
    def load(cls, cfg: PPOConfig, run: Run, tok: Any) -> Prompts:
        d, r, p, info = cfg.data, cfg.rollout, cfg.ppo, run.info
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
        order = StepOrder(len(feats), r.prompts_per_step, cfg.seed, key="rollout.prompts_per_step")
        total = cfg.train.max_steps or cfg.train.epochs * order.steps_per_epoch
        # one optimizer step per mini-batch (the batch sizes count rows: prompts x n_samples_per_prompt); online
        # DPO: one per ppo epoch, over all of the step's pairs
        minis = 1 if p.objective == "online_dpo" else rollout_rows(r) // r.mini_batch_size
        n_updates = total * p.ppo_epochs * minis
        ptx_feats, ptx_order = None, None
        if p.ptx_coef > 0:
            if not cfg.ptx_path:
                raise ConfigError("ppo.ptx_coef > 0 needs ptx_path (SFT data for the pretraining loss)")
            ptx_feats, _ = tokenize_sft(parse_sft(load_rows(cfg.ptx_path), tok), tok, d.max_len, d.max_prompt_len,
                                        d.overlong, d.add_bos, d.assistant_only_loss)
            ptx_order = StepOrder(len(ptx_feats), r.micro_batch_size * info.world_size, cfg.seed + 1, key="ptx_path")
        est = rl_math.advantage_estimator(p.advantage_estimator)
        logger.info("%s: %d prompts (%s); %d steps of %d prompts x %d samples, %d actor%s updates",
                    p.advantage_estimator if p.objective == "rl" else p.objective, len(feats), stats, total,
                    r.prompts_per_step, r.n_samples_per_prompt, n_updates, "/critic" if est.needs_critic else " (no critic)")
        table = [rewards.prompt_row(f["prompt"], f["answer"], f["meta"]) for f in feats]
        eval_table = [rewards.prompt_row(e.text, e.answer, {"task": e.task} if e.task else {}) for e in eval_prompts]
        return cls(feats=feats, table=table, order=order, total=total, n_updates=n_updates, eval_prompts=eval_prompts,
                   eval_table=eval_table, eval_source=eval_source, held_out=held_out,
                   gold=gold_applies(eval_prompts, eval_source, cfg.eval), ptx_feats=ptx_feats, ptx_order=ptx_order)


def reward_source(cfg: PPOConfig, tok: Any, data: Prompts) -> Any:
    """The reward source over the training then held-out prompt rows (rlhf/rl/rewards.py), checked before any
    weights load (the rows carry what it needs, a function scores the first rows, a server answers /health); None
    when it includes the reward model, built once the models are loaded (`RLLoop`)."""
    d = cfg.data
    if distill.is_distill(cfg):  # the only reward: -kl_coef x the per-token reverse KL to the teacher
        logger.info("reward: -%g x the per-token reverse KL to teacher.model=%s (no reward model loaded)",
                    cfg.ppo.kl_coef, cfg.teacher.model)
        return distill.NoReward()
    rewards.check_rows(cfg.reward.sources, data.table, f"data.path={d.path!r}")
    rewards.check_rows(cfg.reward.sources, data.eval_table, f"the held-out prompts ({data.eval_source})")
    if "function" in cfg.reward.sources:  # called on the first prompt rows: one that scores nothing stops here
        rewards.check_function(cfg.reward, tok, data.table, f"data.path={d.path!r}")
    if "http" in cfg.reward.sources:  # GET /health: a server that is not there stops the run before any weights
        health = rewards.check_http(cfg.reward)
        logger.info("reward server %s: %s", cfg.reward.url, health.get("source"))
    needs_rm = needs_reward_model(cfg)
    logger.info("reward: %s%s", rewards.describe(cfg.reward), "" if needs_rm else " (no reward model loaded)")
    return None if needs_rm else rewards.build(cfg.reward, tok, data.table + data.eval_table)


def environment(cfg: PPOConfig, tok: Any, data: Prompts) -> tuple | None:
    """rollout.env (multi-turn episodes, rlhf/rl/multiturn.py), before any weights load: (runner, settings,
    glue, the held-out rows); None without one."""
    r = cfg.rollout
    if not r.env:
        return None
    if cfg.ppo.objective != "rl":
        raise ConfigError(f"rollout.env works with the RL objective, not ppo.objective={cfg.ppo.objective}")
    if cfg.engine.placement == "split":  # the generation ranks sample single-turn responses only
        raise ConfigError("rollout.env (multi-turn episodes) runs with engine.placement=colocated, not split")
    settings = multiturn.Settings.of(r)
    runner = make_runner(load_environment(r.env), r.env_workers, r.env_timeout_s)
    glue = multiturn.template_glue(tok, tuple(r.turn_stop))
    logger.info("multi-turn: rollout.env=%s, up to %d turns of %d tokens, %d tokens per episode; glue: %s; "
                "%s", r.env, r.max_turns, r.max_new_tokens, settings.budget, glue.source,
                f"{r.env_workers} env workers" if r.env_workers else "environments in this process")
    return runner, settings, glue, data.eval_table


# ----------------------------------------------------------------------------- the loop


class RLLoop:
    """The models and the state the steps carry (the KL controller, the alarms, the old log-probs' source, the best
    evaluation; checkpointed with the models), and the step in its phases:

        generate -> score -> experience -> train -> metrics -> watch

    Built after `Run.open`: it loads the models, then `run.begin` resumes or evaluates before the first step."""

    def __init__(self, cfg: PPOConfig, run: Run, tok: Any, data: Prompts, source: Any, env: tuple | None,
                 placement: Placement | None):
        self.cfg, self.run, self.tok, self.data, self.env = cfg, run, tok, data, env
        p, r, info = cfg.ppo, cfg.rollout, run.info
        self.models = Models(cfg, tok, info, data.n_updates, reward_source=source)
        if source is None:  # the reward model's source, alone or inside a weighted sum
            self.models.reward_source = rewards.build(cfg.reward, tok, data.table + data.eval_table,
                                                      reward_model=self.models.reward_source)
        # ppo.adaptive_kl moves the coefficient of the KL's placement: the reward penalty (ppo.kl_coef), or the loss
        # term (ppo.kl_loss_coef) when the reward has none (GRPO's placement)
        self.in_loss = p.adaptive_kl and not p.kl_coef and p.kl_loss_coef > 0
        init = p.kl_loss_coef if self.in_loss else p.kl_coef
        floor = init if p.kl_coef_min is None else p.kl_coef_min  # ppo.kl_coef_min=null: a KL budget
        self.kl_ctl = rl_math.make_kl_controller(init, p.adaptive_kl, p.kl_target, p.kl_horizon,
                                                 floor if p.adaptive_kl else 0.0)
        self.monitor = alarms.Monitor(cfg.alarms)
        self.old_logprobs = OldLogprobs(p, r)  # the actor's scoring forward or the sampler's (rl/old_logprobs.py)
        self.best = BestEval(cfg.train, "gold_score" if data.gold["eval_prompts_source"] else "reward")
        run.begin(self.models, data.total, self.evaluate_and_watch, _eval_line, memory=self.models,
                  state_fn=lambda: {"kl_ctl": self.kl_ctl.state_dict(), "alarms": self.monitor.state_dict(),
                                    "old_logprobs": self.old_logprobs.state_dict(), "best": self.best.state_dict()})
        for key, part in (("best", self.best), ("kl_ctl", self.kl_ctl), ("alarms", self.monitor),
                          ("old_logprobs", self.old_logprobs)):
            if key in run.extra_state:
                part.load_state_dict(run.extra_state[key])
        self.side = None  # engine.placement=split: the rollouts come from the generation ranks (rlhf/rl/split.py)
        if placement is not None:
            self.side = split.TrainerSide(self.models.actor, placement, cfg, start=run.start, total=data.total)
            self.side.send_weights(run.start)
        self.dpo = p.objective == "online_dpo"  # the pair loss on each step's best-vs-worst responses (rl/online_dpo.py)
        self.losses = ((online_dpo.make_loss(cfg) if self.dpo
                        else actor_loss(cfg, (lambda: self.kl_ctl.value) if self.in_loss else None)),
                       make_critic_loss(p.cliprange_value))
        self.micro_per_step = p.ppo_epochs * (1 if self.dpo else rollout_rows(r) // r.mini_batch_size) * (
            r.mini_batch_size // info.world_size // r.micro_batch_size)
        self.times: dict[str, list[float]] = {"generation_s": [], "scoring_s": [], "training_s": []}
        # engine.deterministic: every rollout batch padded to the longest prompt, each row its own sampling stream
        self.width = max(len(f["input_ids"]) for f in data.feats) if cfg.engine.deterministic else None

    def reward_kl_coef(self) -> float:
        """The KL penalty's coefficient in the reward (0 when the adaptive coefficient is the loss term's)."""
        return 0.0 if self.in_loss else self.kl_ctl.value

    def evaluate_and_watch(self) -> dict[str, Any]:
        """The held-out evaluation, with the gold alarm and what train.export_best / kl_budget / early_stop_patience
        decide from it."""
        run, best, monitor, cfg = self.run, self.best, self.monitor, self.cfg
        step, total = len(monitor.history), self.data.total
        ev = monitor.after_eval(step, evaluate(self.models, self.data.eval_prompts, self.tok, cfg, len(self.data.table),
                                               gold=bool(self.data.gold["eval_prompts_source"]), tools=self.env))
        alarms.stop_run(run, monitor, cfg.train.stop_on_alarm)
        if best.after_eval(step, ev) and best.keeps_actor:
            self.models.snapshot_actor()  # collective
        if best.over is not None and step < total:  # (the final evaluation ends the run anyway)
            run.stop(f"train.kl_budget: held-out KL {best.over['kl']:.4g} at step {step} is over the budget "
                     f"{cfg.train.kl_budget:g}; the actor of step {best.step} (KL {best.eval.get('kl', 0.0):.4g}) is exported")
        elif best.exhausted() and step < total:
            run.stop(f"train.early_stop_patience: {best.since} evaluations without a better held-out {best.metric} "
                     f"than step {best.step}'s {best.score:.4g}")
        return ev

    # ---- one step: generate -> score -> experience -> train -> metrics -> watch

    def step(self, step: int) -> None:
        t0 = time.time()
        rng = rng_state()  # a step that gets no reward is checkpointed as it began
        rollout, meta, episodes = self.generate(step)
        t1 = time.time()
        from_sampler = not self.old_logprobs.recompute(step)
        scored, env_rec = self.score(step, rollout, episodes, from_sampler, rng)
        reward_errors = rewards.report_errors(self.models.reward_source, step + 1)  # those rows' scores are NaN
        exp, dropped = self.experience(rollout, scored, episodes)
        t2 = time.time()
        a_stats, c_stats, pairs = self.train(step, rollout, scored, exp)
        t3 = time.time()
        rec = self.metrics(step, rollout, exp, scored, a_stats, c_stats, pairs, (t0, t1, t2, t3), dropped, from_sampler,
                           meta=meta, reward_errors=reward_errors, env_rec=env_rec)
        self.watch(step, rec)

    def generate(self, step: int) -> tuple[Rollout, dict, Any]:
        """This rank's prompts of `step`, each n_samples_per_prompt times in a row (a group stays on its rank),
        sampled: single-turn, multi-turn episodes with the environment, or received from a generation rank
        (split placement: sampled there with these very rows and seeds, a version <= max_staleness old).
        Returns (rollout, the transfer's metrics, the episodes or None)."""
        cfg, r, info, feats = self.cfg, self.cfg.rollout, self.run.info, self.data.feats
        if self.side is not None:
            rollout, meta = self.side.receive(step)
            return rollout, meta, None
        pad = self.tok.pad_token_id
        idx = [i for i in self.data.order.rank_rows(step, info.rank, info.world_size, 1)[0]
               for _ in range(r.n_samples_per_prompt)]
        seeds = rollout_seeds(cfg.seed, step, idx, r.n_samples_per_prompt) if row_streams(cfg) else None
        prompts = collate_prompts([feats[i] for i in idx], pad, self.width)
        if self.env is not None:  # one episode per row, over turns with the environment
            runner, settings, glue, _ = self.env
            rollout, episodes = multiturn.generate_episodes(
                self.models.actor, prompts, torch.tensor(idx), [self.data.table[i] for i in idx], sampling(cfg),
                self.tok, runner, settings, glue, seeds)
            return rollout, {}, episodes
        return generate(self.models.actor, prompts, torch.tensor(idx), sampling(cfg), self.tok.eos_token_id, pad,
                        seeds), {}, None

    def score(self, step: int, rollout: Rollout, episodes: Any, from_sampler: bool, rng: Any) -> tuple[dict, dict | None]:
        """Old and reference log-probs, values and the reward source's scores (+ the environment's reward parts).
        A step in which no row gets a reward, or whose episodes faulted past the limit, stops the run after writing
        the checkpoint of the step before, with the RNG as this step began (a resume redoes the step exactly)."""
        try:
            scored = self.models.score(rollout, old_from_sampler=from_sampler)
            rewards.check_step(self.models.reward_source, scored["score"], f"step {step + 1}")
            env_rec = None
            if episodes is not None:  # faulted episodes over the fraction (or all): stopped before the step trains
                env_rec = multiturn.step_env_metrics(episodes, self.run.info.device)
                multiturn.check_failures(env_rec, episodes, self.env[1])
        except (*rewards.STOPS, multiturn.EpisodesFailed):
            set_rng_state(rng)  # as it was when the step began, so that the resumed step samples the same
            if step > self.run.start or self.run.resume_path is None:  # (unless resumed from that very checkpoint)
                logger.error("step %d cannot train (no reward, or its episodes faulted): checkpoint %s written "
                             "before stopping", step + 1, self.run.save(step))
            raise
        return scored, env_rec

    def experience(self, rollout: Rollout, scored: dict, episodes: Any) -> tuple[Any, int]:
        """Rows with a non-finite value dropped (counted), uniform groups dropped (ppo.dynamic_sampling), then the
        rewards, advantages and returns (rlhf/rl/experience.py). Returns (experience, groups dropped)."""
        p, r = self.cfg.ppo, self.cfg.rollout
        if episodes is not None:  # the environment's reward parts, summed per episode, on top of reward.sources
            scored["score"] = scored["score"] + episodes.env_reward.to(scored["score"].device)
        mask_nonfinite(rollout, scored)  # a NaN/inf from any model drops its row, counted and named
        dropped = drop_uniform_groups(rollout, scored["score"]) if p.dynamic_sampling else 0
        exp = build_experience(rollout.sequences, rollout.attention_mask, rollout.response_mask, rollout.prompt_len,
                               scored, kl_coef=self.reward_kl_coef(), kl_estimator=p.kl_estimator,
                               clip_reward_value=p.clip_reward_value, gamma=p.gamma, lam=p.lam,
                               estimator=p.advantage_estimator, group=rollout.group, whiten=p.whiten_advantages,
                               norm_by_std=p.norm_by_std, max_len=r.max_new_tokens,
                               overlong_buffer=p.overlong_buffer, overlong_penalty=p.overlong_penalty)
        return exp, dropped

    def train(self, step: int, rollout: Rollout, scored: dict, exp: Any) -> tuple[list, list, Any]:
        """The update (`ppo.ppo_epochs` passes of mini-batches, rlhf/rl/update.py; online DPO: the pair loss on
        each group's best vs worst), then, on split placement, the new weights on their way to the generators.
        Returns (actor stats, critic stats, online DPO's pairs or None)."""
        data, pairs = self.data, None
        ptx = None if data.ptx_feats is None else ptx_batches(data.ptx_feats, data.ptx_order, step * self.micro_per_step,
                                                              self.run.info, self.tok.pad_token_id)
        if self.dpo:
            pairs = online_dpo.pairs_of(rollout, scored["score"])
            a_stats, c_stats = online_dpo.update(self.models, rollout, scored, pairs, self.cfg, self.losses[0], self.run), []
        else:
            a_stats, c_stats = update(self.models, exp, self.cfg, self.losses, ptx, self.run)
        if self.side is not None:  # while this step's metrics are made
            self.side.after_step(step)
        return a_stats, c_stats, pairs

    def metrics(self, step: int, rollout: Rollout, exp: Any, scored: dict, a_stats: list, c_stats: list, pairs: Any,
                times: tuple, dropped: int, from_sampler: bool, *, meta: dict, reward_errors: int,
                env_rec: dict | None) -> dict[str, Any]:
        """The step's record (rlhf/rl/metrics.py): rewards, KL, lengths, losses, phase times, the sampler's gap,
        the split placement's transfer (`meta`), the generation engine's sync and memory, the reward sources'
        errors, latency and disagreement, the environment's figures; the KL controller and the old log-probs'
        source move on it."""
        cfg, r, info = self.cfg, self.cfg.rollout, self.run.info
        rec = step_metrics(rollout, exp, a_stats, c_stats, cfg, self.reward_kl_coef(), times, dropped, from_sampler,
                           self.models.score_batching)
        if self.in_loss:  # the coefficient this step's loss used
            rec["kl_loss_coef"] = self.kl_ctl.value
        self.old_logprobs.after_step(step, rec)  # a recomputed step's gap decides the next steps' source
        rec.update(meta)  # split: policy_version, staleness, the weight transfer's bytes / s / GB/s
        rec.update(self.models.actor.generation_metrics())  # vLLM's sync bytes / s / GB/s, the phases' peak memory
        if self.dpo:
            rec.update(online_dpo.pair_metrics(pairs, scored["score"], a_stats))
        for key in self.times:
            self.times[key].append(rec[key])
        self.kl_ctl.update(rec["kl"], rollout_rows(r))
        rec["reward_errors"] = int(all_reduce_sum(torch.tensor([float(reward_errors)], device=info.device)).item())
        source = self.models.reward_source
        rec.update(rewards.http_stats(source))  # this rank's http requests, p50/p99 latency
        if env_rec is not None:  # turns, tool calls, observation tokens, env seconds, faults (summed over ranks)
            rec.update(env_rec)
        if (std := rewards.disagreement(source)) is not None:  # a reward ensemble: its members' std
            ok = torch.isfinite(std).double()
            d = all_reduce_sum(torch.stack([std.double().nan_to_num() @ ok, ok.sum()]))
            rec["reward_disagreement"] = (d[0] / d[1]).item() if d[1] > 0 else float("nan")
        return rec

    def watch(self, step: int, rec: dict[str, Any]) -> None:
        """The reward-hacking alarms (rlhf/rl/alarms.py; train.stop_on_alarm), then the step's line."""
        run, monitor = self.run, self.monitor
        rec.update(monitor.after_step(step + 1, rec))
        alarms.stop_run(run, monitor, self.cfg.train.stop_on_alarm)
        if run.logs(step) or monitor.fired:
            run.log_train(step, rec, dict(reward=f"{rec['reward']:.3f}", kl=f"{rec['kl']:.3f}",
                                          len=f"{rec['response_len']:.1f}"))

    # ---- after the last step

    def finish(self) -> dict[str, Any]:
        """The final evaluation, the export (train.export_best: the best evaluation's actor) and summary.json."""
        cfg, run, p, r, best, env, models = self.cfg, self.run, self.cfg.ppo, self.cfg.rollout, self.best, self.env, self.models
        if self.side is not None:  # the generators stopped; what they sampled past the last step trained is discarded
            self.side.stop()
        last = run.evaluate_after()
        if env is not None:
            env[0].close()  # every episode's environment
            env[0].shutdown()  # and the process pool's workers (rollout.env_workers > 0)
        exported = best.exported(run.total, last)  # train.export_best: the best evaluation's step, else the last
        after = exported["eval"]
        out_dir = cfg.output_dir
        model_dir = models.export(self.tok, cfg, models.best_actor if exported["step"] != run.total else None)
        if cfg.train.export_best or best.over is not None:
            logger.info("%s: exported the actor of step %d (held-out %s %.4g, KL %.4g; the last step %d's: %.4g, "
                        "KL %.4g) as %s", best.exported_by(), exported["step"], best.metric,
                        after.get(best.metric, float("nan")), after.get("kl", float("nan")), run.total,
                        last.get(best.metric, float("nan")), last.get("kl", float("nan")), model_dir)
        before, n, times = run.before, max(len(self.times["generation_s"]), 1), self.times
        train_rows = read_metrics(out_dir, "train")

        def total(key: str) -> Any:
            return sum(x.get(key, 0) for x in train_rows)

        return run.finish({
            **self.data.held_out,
            **self.data.gold,
            **gold_summary(before, after),
            **({"gold_score_tool_before": before.get("gold_score_tool"), "gold_score_tool_after": after.get("gold_score_tool"),
                "tool_calls_eval_after": after.get("tool_calls_eval"), "turns_eval_after": after.get("turns_eval"),
                **{k: total(k) for k in ("env_errors", "env_timeouts", "template_mismatch")},
                } if env else {}),
            "exported_step": exported["step"],  # the step whose actor is model/ (train.export_best: the best evaluation's)
            **({"exported_by": best.exported_by(), "last_step_eval": without_samples(last)}
               if cfg.train.export_best or cfg.train.kl_budget is not None else {}),
            **({"kl_budget": cfg.train.kl_budget, "kl_budget_exceeded": best.over} if cfg.train.kl_budget is not None else {}),
            **({"reward_disagreement": after.get("reward_disagreement")} if "reward_disagreement" in after else {}),
            "kl": after.get("kl"),
            "reward_before": before.get("reward"),
            "reward_after": after.get("reward"),
            ("kl_loss_coef_final" if self.in_loss else "kl_coef_final"): self.kl_ctl.value,
            "advantage_estimator": p.advantage_estimator,
            "objective": p.objective,
            **({"teacher": cfg.teacher.model} if distill.is_distill(cfg) else {}),
            **({"pairs": total("pairs"), "tied_groups": total("tied_groups")} if self.dpo else {}),
            "samples_per_step": rollout_rows(r),
            "empty_responses": total("empty_responses"),
            **rollout_lengths(train_rows, rollout_rows(r)),
            "reward_sources": list(cfg.reward.sources),
            "reward_errors": total("reward_errors"),
            "alarms_fired": self.monitor.first_fired,  # name -> the first step it fired
            "stopped_early": run.stop_reason,
            "generation_path": models.actor.generation_path,
            "placement": cfg.engine.placement,
            **({"rollout_mode": r.mode, "max_staleness": split.staleness_bound(r), **self.side.summary()}
               if self.side else {}),
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
