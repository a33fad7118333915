"""Online DPO in the RL stage: `python -m rlhf.ppo algorithm=online_dpo`.

Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"; TRL's
OnlineDPOTrainer): each step the policy samples `rollout.n_samples_per_prompt` >= 2 responses per
prompt (a prompt's group on one rank), the run's reward source (`reward.sources`: the reward model,
the judge, an answer match, a function, or a weighted sum; scored by `Models.score`) ranks them, and
the DPO-family loss trains the actor on each group's best vs worst response (`best_worst_pairs`,
rlhf/algos/online_dpo.py; tied and unpaired groups are skipped, counted) with the reference frozen:
its summed response log-probs come from the same scoring pass as the RL algorithms' `logp_ref`. No
critic is loaded or trained.

The step (in rlhf/ppo.py's loop): generate -> score -> `pairs_of` -> `update` -> metrics, with the
generation path, engine, alarms, evaluation and export of the other algorithms. The update is
`ppo.ppo_epochs` optimizer steps, each over all of this rank's pair slots (one per prompt; a slot that
is no pair weighs 0, so every rank runs the same forwards), in micro-batches of
`rollout.micro_batch_size` rows (micro_batch_size / 2 pairs, at least one). Log-probs are taken at
`rollout.temperature` (1 by default), by the policy and the reference alike.
"""
from __future__ import annotations

from typing import Any

import torch

from engine.distributed import all_reduce_sum
from rlhf.algos.online_dpo import Pairs, best_worst_pairs, pair_loss
from rlhf.algos.preference import sequence_logps
from rlhf.algos.rl import masked_mean
from rlhf.config import PPOConfig
from rlhf.modeling.forward import token_logprobs
from rlhf.rl.rollout import Rollout


def pairs_of(rollout: Rollout, score: torch.Tensor) -> Pairs:
    """This rank's pairs: rows with a response in the update (not empty, finite, not dropped) compete."""
    return best_worst_pairs(score, rollout.group, rollout.response_mask.bool().any(1))


def make_loss(cfg: PPOConfig):
    """The actor's loss on a micro-batch of k pair slots laid out as 2k rows (chosen, then rejected):
    `pair_loss` (sum over the pairs, weight = pairs), plus the entropy of the paired rows' tokens."""
    o, temperature = cfg.online_dpo, cfg.rollout.temperature

    def loss(model: torch.nn.Module, mb: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
        logp, entropy = token_logprobs(model, mb, temperature, with_entropy=True)
        mask, weight = mb["response_mask"], mb["pair_weight"]
        total, n, stats = pair_loss(logp, mask, mb["ref_logps"], weight, loss_type=o.loss_type, beta=o.beta,
                                    sft_coef=o.sft_coef)
        rows = torch.cat([weight, weight]) > 0
        stats["entropy"] = masked_mean(entropy.detach(), mask * rows[:, None]) if bool(rows.any()) else \
            torch.zeros((), device=logp.device)
        return total, n, stats

    return loss


def update(models, rollout: Rollout, scored: dict[str, torch.Tensor], pairs: Pairs, cfg: PPOConfig, loss_fn,
           run) -> list[dict]:
    """`ppo.ppo_epochs` actor steps on the pairs (module docstring); returns their train_step stats."""
    mask = rollout.response_mask.float()
    ref_sum, _ = sequence_logps(scored["logp_ref"], mask)
    per_micro = max(cfg.rollout.micro_batch_size // 2, 1)
    slots = pairs.valid.shape[0]
    micro = []
    for s in range(0, slots, per_micro):
        rows = torch.cat([pairs.chosen[s : s + per_micro], pairs.rejected[s : s + per_micro]])
        micro.append({"sequences": rollout.sequences[rows], "attention_mask": rollout.attention_mask[rows],
                      "position_ids": scored["position_ids"][rows], "response_mask": mask[rows],
                      "ref_logps": ref_sum[rows], "pair_weight": pairs.valid[s : s + per_micro].float(),
                      "prompt_len": rollout.prompt_len, "pack_length": models.pack_length,
                      "shared_prompts": models.shared_prompts_update})  # a pair's two rows share its prompt
    stats = []
    for _ in range(cfg.ppo.ppo_epochs):
        stats.append(models.actor.train_step(micro, loss_fn))
        run.check(stats[-1])
        if models.ema is not None:
            models.ema.update()
    return stats


def pair_metrics(pairs: Pairs, score: torch.Tensor, a_stats: list[dict]) -> dict[str, Any]:
    """The step's pair figures over every rank (a collective): pairs, tied_groups, unpaired_groups,
    pair_score_margin (the reward source's chosen - rejected score, mean over pairs), and the first
    update's dpo_accuracy / dpo_margin (the implicit rewards beta (logp - logp_ref), before it stepped)."""
    s = score.double()
    margin = (s[pairs.chosen] - s[pairs.rejected])[pairs.valid].sum() if pairs.n else s.new_zeros(())
    sums = all_reduce_sum(torch.stack([torch.tensor(float(pairs.n), dtype=torch.float64, device=s.device),
                                       torch.tensor(float(pairs.tied), dtype=torch.float64, device=s.device),
                                       torch.tensor(float(pairs.unpaired), dtype=torch.float64, device=s.device),
                                       margin])).tolist()
    first = a_stats[0]
    return {"pairs": int(sums[0]), "tied_groups": int(sums[1]), "unpaired_groups": int(sums[2]),
            "pair_score_margin": sums[3] / sums[0] if sums[0] else float("nan"),
            "dpo_accuracy": first.get("dpo_accuracy", float("nan")) if sums[0] else float("nan"),
            "dpo_margin": first.get("dpo_margin", float("nan")) if sums[0] else float("nan")}
