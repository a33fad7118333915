"""Scoring a rollout with the four models: log-probs of given tokens, per-token values, reward scores
(the "score" step of rlhf/experience.py). Everything is per rank, over this rank's rows.

Layout of one rank's experience (P = prompt width, T = response width):
    sequences, attention_mask, position_ids   [B, P+T]  prompts LEFT-padded, responses right-padded
    response_mask, logp_old, logp_ref, values,
    rewards, kl, advantages, returns          [B, T]    column t = response token t
    score                                     [B]       reward model's value at the last real token
Position ids come from the attention mask (cumsum - 1), exactly as `generate` numbers positions,
for every model's forward: otherwise the left padding shifts every position and the PPO ratio is
computed against log-probs of a different model input than the one that was sampled.
"""
from __future__ import annotations

import torch

from rlhf.reward_math import sequence_scores


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] -> [B, L]: 0, 1, 2, ... over real tokens (as `generate` numbers them; pad positions get
    whatever is left over: they are never attended and never scored)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(policy: torch.nn.Module, batch: dict, temperature: float, with_entropy: bool = False):
    """log p(response token) under a `Policy` role (logits / temperature): [B, T] (and entropy [B, T])."""
    seqs, P = batch["sequences"], batch["prompt_len"]
    logp, entropy = policy(seqs, batch["attention_mask"], batch["position_ids"], targets=seqs[:, P:], start=P - 1,
                           temperature=temperature, with_entropy=with_entropy)
    return (logp, entropy) if with_entropy else logp


def token_values(critic: torch.nn.Module, batch: dict) -> torch.Tensor:
    """A `ValueModel` critic's values of the states before each response token: [B, T]."""
    seqs, P = batch["sequences"], batch["prompt_len"]
    values = critic(seqs, batch["attention_mask"], batch["position_ids"])
    return values[:, P - 1 : seqs.shape[1] - 1].float()


@torch.no_grad()
def score_rollout(
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    prompt_len: int,
    *,
    actor: torch.nn.Module,
    reference: torch.nn.Module,
    critic: torch.nn.Module | None,
    reward: torch.nn.Module | None,
    micro_batch_size: int,
    temperature: float,
) -> dict[str, torch.Tensor]:
    """Old log-probs, reference log-probs, values (without a critic: none) and reward scores, in micro-batches.

    Every rank runs the same number of forwards (FSDP all-gathers inside them are collective).
    """
    base = {"sequences": sequences, "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask), "prompt_len": prompt_len}
    parts: dict[str, list[torch.Tensor]] = {"logp_old": [], "logp_ref": [], "values": [], "score": []}
    B = sequences.shape[0]
    for s in range(0, B, micro_batch_size):
        mb = {k: (v[s : s + micro_batch_size] if torch.is_tensor(v) else v) for k, v in base.items()}
        parts["logp_old"].append(token_logprobs(actor, mb, temperature))
        parts["logp_ref"].append(token_logprobs(reference, mb, temperature))
        if critic is not None:
            parts["values"].append(token_values(critic, mb))
        if reward is None:  # scored elsewhere (rlhf/experience.py reward sources)
            continue
        rm_values = reward(mb["sequences"], mb["attention_mask"], mb["position_ids"])
        parts["score"].append(sequence_scores(rm_values.float(), mb["attention_mask"]))
    out = {k: torch.cat(v) for k, v in parts.items() if v}
    out["position_ids"] = base["position_ids"]
    return out
