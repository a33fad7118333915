"""Each critic-free estimator's advantages and one actor update on 2 ranks vs 1 process, for
tests/test_rl_algorithms.py.

    torchrun --nproc_per_node 2 rl_estimators.py <out>   2 ranks (gloo), each takes half of the rows
    python rl_estimators.py <out>                        1 process, every row

GLOBAL rows = PROMPTS prompts x N samples, in prompt order, so each rank holds whole prompt groups
(as rlhf/ppo.py lays them out). Per run of RUNS (each estimator: grpo, rloo, reinforce_pp;
each policy loss: clip, gspo, cispo; the sampler/trainer corrections tis and sequence-level mis;
on-policy distillation's per-token reverse KL reward with reinforce at gamma 0):
`build_experience` on this rank's rows (REINFORCE++ whitens over every rank), then one ZeRO-3
`TrainEngine.train_step` with rlhf/ppo.py's actor loss (KL loss term on unless the run sets it off, a
different loss aggregation per estimator, asymmetric clip). Then online DPO: this rank's best-vs-worst
pairs of its prompt groups and one ZeRO-3 update with rlhf/rl/online_dpo.py's `update` and pair loss
(its "advantages": +1 chosen, -1 rejected, 0 neither, per row). Rank 0 saves every row's advantages,
the step's loss and metrics and the full gradients to <out>/rl_w<world>.pt.
Then `ppo.old_logprobs` (sampler and auto) over OLD_STEPS steps of these rows, the sampler's log-probs
forced off the trainer's by OLD_OFFSET on the second rank's rows only at step OLD_FORCED: each rank's
choice per step (OldLogprobs fed rlhf/rl/metrics.py's all-reduced sampler_gap, as rlhf/ppo.py does),
the measured gaps and each rank's own gap at OLD_FORCED, to <out>/old_logprobs_w<world>.pt.
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from engine import EngineConfig, OptimConfig, TrainEngine, init_distributed  # noqa: E402
from rlhf.config import PPOAlgoConfig, RolloutConfig  # noqa: E402
from rlhf.modeling.forward import position_ids_from_mask, token_logprobs
from rlhf.modeling.roles import Policy
from rlhf.rl import online_dpo
from rlhf.rl.experience import build_experience
from rlhf.rl.metrics import sampler_gap  # noqa: E402
from rlhf.rl.old_logprobs import OldLogprobs  # noqa: E402
from rlhf.rl.update import make_actor_loss

VOCAB, P, T, PROMPTS, N, MICRO, TEMPERATURE = 64, 4, 6, 4, 3, 2, 0.7
GLOBAL = PROMPTS * N
# ppo.old_logprobs on 2 ranks: checks every 2 steps; at OLD_FORCED the last GLOBAL/2 rows' sampler log-probs
# are OLD_OFFSET off (every other step: the trainer's exactly)
OLD_STEPS, OLD_EVERY, OLD_FORCED, OLD_OFFSET = 6, 2, 2, 0.01
RUNS = {  # name: (estimator, kl_coef in the reward, loss aggregation, actor-loss options [+ gamma, kl_loss_coef])
    "grpo": ("grpo", 0.0, "seq_mean_token_mean", {}), "rloo": ("rloo", 0.0, "seq_mean_token_sum", {}),
    "reinforce_pp": ("reinforce_pp", 0.1, "token_mean", {}),
    # the policy losses of the registry beyond clip, and the sampler/trainer correction (#30, #33)
    "gspo": ("grpo", 0.0, "token_mean", {"policy_loss": "gspo", "cliprange_low": 3e-4, "cliprange_high": 4e-4}),
    "cispo": ("grpo", 0.0, "token_mean", {"policy_loss": "cispo", "cliprange_low": 1.0, "cliprange_high": 0.3}),
    "grpo_tis": ("grpo", 0.0, "token_mean", {"is_correction": "tis", "is_cap": 1.05}),
    "rloo_mis_seq": ("rloo", 0.1, "token_mean", {"is_correction": "mis", "is_low": 0.9, "is_high": 1.1,
                                                 "is_level": "sequence"}),
    # algorithm=distill: logp_ref is the teacher's, score 0, the reward -k1 per token, each token's own (gamma 0)
    "distill": ("reinforce", 1.0, "token_mean", {"gamma": 0.0, "kl_loss_coef": 0.0, "score": 0.0}),
}


def actor():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return Policy(LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)))


def rollout() -> dict:
    """GLOBAL rows (left-padded prompts, ragged responses, one empty), their old/reference log-probs
    near the actor's own, 0/1 scores (one all-equal group) and the prompt group of each row."""
    g = torch.Generator().manual_seed(99)
    prompt_len = torch.randint(2, P + 1, (GLOBAL,), generator=g)
    response_len = torch.randint(1, T + 1, (GLOBAL,), generator=g)
    response_len[4] = 0
    cols = torch.arange(P + T)
    attention_mask = ((cols >= P - prompt_len[:, None]) & (cols < P + response_len[:, None])).long()
    sequences = torch.randint(1, VOCAB, (GLOBAL, P + T), generator=g) * attention_mask
    batch = {"sequences": sequences, "attention_mask": attention_mask, "prompt_len": P,
             "position_ids": position_ids_from_mask(attention_mask)}
    with torch.no_grad():
        logp = token_logprobs(actor(), batch, TEMPERATURE)
    score = torch.randint(0, 2, (GLOBAL,), generator=g).float()
    score[:N] = 1.0  # the first prompt's group: all right
    return {**batch, "response_mask": attention_mask[:, P:], "logp_old": logp + 0.1 * torch.randn(GLOBAL, T, generator=g),
            "logp_ref": logp + 0.3 * torch.randn(GLOBAL, T, generator=g), "score": score,
            "logp_gen": logp + 0.1 * torch.randn(GLOBAL, T, generator=g),  # the sampler's, a little off
            "group": torch.arange(PROMPTS).repeat_interleave(N) + 10}


def main(out_dir: str) -> None:
    torch.use_deterministic_algorithms(True)
    info = init_distributed()
    full = rollout()
    per_rank = GLOBAL // info.world_size
    sl = slice(info.rank * per_rank, (info.rank + 1) * per_rank)
    mine = {k: v[sl] if torch.is_tensor(v) else v for k, v in full.items()}
    result = {}
    def engine_and_grads():
        engine = TrainEngine(actor(), EngineConfig(stage=3), OptimConfig(grad_clip=0.0), total_steps=1, info=info)
        grads = {}

        def capture(optimizer, args, kwargs):
            for pname, p in engine.unwrapped.named_parameters():
                g = p.grad
                grads[pname] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()

        engine.optimizer.register_step_pre_hook(capture)
        return engine, grads

    def gathered(x):
        every = [None] * info.world_size
        dist.all_gather_object(every, x)
        return torch.cat(every)

    for name, (estimator, kl_coef, loss_agg, options) in RUNS.items():
        options = dict(options)
        gamma, kl_loss_coef = options.pop("gamma", 0.9), options.pop("kl_loss_coef", 0.5)
        scored = {k: mine[k] for k in ("logp_old", "logp_ref", "score", "position_ids", "logp_gen")}
        if "score" in options:  # a constant score (distillation's NoReward)
            scored["score"] = torch.full_like(mine["score"], options.pop("score"))
        exp = build_experience(mine["sequences"], mine["attention_mask"], mine["response_mask"], P, scored,
                               kl_coef=kl_coef, kl_estimator="k1", clip_reward_value=5.0, gamma=gamma, lam=0.95,
                               estimator=estimator, group=mine["group"])
        engine, grads = engine_and_grads()
        loss = make_actor_loss(0.2, TEMPERATURE, 0.0, **{"cliprange_low": 0.1, "cliprange_high": 0.3, **options},
                               loss_agg=loss_agg, horizon=T, kl_loss_coef=kl_loss_coef)
        out = engine.train_step([exp.rows(list(range(i, i + MICRO))) for i in range(0, per_rank, MICRO)], loss)
        result[name] = {"advantages": gathered(exp.advantages), "grads": grads,
                        "stats": {"loss": out["loss"], **({"kl_loss": out["kl_loss"]} if kl_loss_coef else {})}}
    result["distill"]["k1"] = (full["logp_old"] - full["logp_ref"]) * full["response_mask"]  # every row's
    # online DPO: the pairs of this rank's groups, then rlhf/rl/online_dpo.py's update (one ppo epoch)
    cfg = SimpleNamespace(online_dpo=SimpleNamespace(loss_type="sigmoid", beta=0.1, sft_coef=0.5),
                          rollout=SimpleNamespace(temperature=TEMPERATURE, micro_batch_size=MICRO),
                          ppo=SimpleNamespace(ppo_epochs=1))
    ro = SimpleNamespace(sequences=mine["sequences"], attention_mask=mine["attention_mask"], prompt_len=P,
                         response_mask=mine["response_mask"], group=mine["group"])
    pairs = online_dpo.pairs_of(ro, mine["score"])
    engine, grads = engine_and_grads()
    models = SimpleNamespace(actor=engine, ema=None, pack_length=None, shared_prompts_update=True)
    (out,) = online_dpo.update(models, ro, {k: mine[k] for k in ("logp_ref", "position_ids")}, pairs, cfg,
                               online_dpo.make_loss(cfg), SimpleNamespace(check=lambda stats: None))
    role = torch.zeros(per_rank)
    role[pairs.chosen[pairs.valid]], role[pairs.rejected[pairs.valid]] = 1.0, -1.0
    result["online_dpo"] = {"advantages": gathered(role), "grads": grads,
                            "stats": {k: out[k] for k in ("loss", "weight", "dpo_margin", "dpo_accuracy")}}
    if info.is_main:
        torch.save(result, os.path.join(out_dir, f"rl_w{info.world_size}.pt"))
    old = old_logprobs_choices(full, sl, info.world_size)
    if info.is_main:
        torch.save(old, os.path.join(out_dir, f"old_logprobs_w{info.world_size}.pt"))
    dist.barrier()


def old_logprobs_choices(full: dict, sl: slice, world: int) -> dict:
    """Per mode (sampler, auto): every rank's recompute choice per step, the gaps the recomputed steps
    measured (all-reduced), and each rank's own gap at OLD_FORCED (its rows alone)."""
    out = {}
    mask = full["response_mask"][sl]
    for mode in ("sampler", "auto"):
        src = OldLogprobs(PPOAlgoConfig(old_logprobs=mode, old_logprobs_check_every=OLD_EVERY), RolloutConfig())
        choices, gaps = [], {}
        for step in range(OLD_STEPS):
            logp_gen = full["logp_old"].clone()
            if step == OLD_FORCED:
                logp_gen[GLOBAL // 2 :] += OLD_OFFSET  # the second rank's rows (in 1 process: the same rows)
            exp = SimpleNamespace(logp_old=full["logp_old"][sl], logp_gen=logp_gen[sl], response_mask=mask)
            recompute = src.recompute(step)
            choices.append(recompute)
            if step == OLD_FORCED:
                own = ((exp.logp_old - exp.logp_gen).abs() * mask).sum() / mask.sum()
            if recompute:  # rlhf/ppo.py: only a recomputed step measures the gap (a collective)
                gaps[step] = sampler_gap(exp, PPOAlgoConfig())["gen_logprob_gap"]
            src.after_step(step, {"gen_logprob_gap": gaps[step]} if recompute else {})
        every = [None] * world
        dist.all_gather_object(every, {"choices": choices, "gaps": gaps, "own_gap": float(own)})
        out[mode] = every
    return out


if __name__ == "__main__":
    main(sys.argv[1])
    from engine import exit_process

    exit_process(0)  # not a plain exit: see engine.distributed.exit_process
