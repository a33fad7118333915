"""PPO experience: generate responses, score them with the four models, and turn scores into
per-token rewards, advantages and returns. Everything is per rank, over this rank's prompts.

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

from dataclasses import dataclass, fields

import torch

from engine.kernel_injection import has_fused_logprobs
from rlhf import ppo_math
from rlhf.reward_math import sequence_scores


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] -> [B, L]: 0, 1, 2, ... over real tokens (as `generate` numbers them; pad positions get
    whatever is left over: they are never attended and never scored)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass
class Experience:
    sequences: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    logp_old: torch.Tensor
    logp_ref: torch.Tensor
    values: torch.Tensor
    score: torch.Tensor
    rewards: torch.Tensor
    kl: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    prompt_len: int

    def rows(self, idx: list[int]) -> dict:
        """A micro-batch dict of the given rows (every tensor field sliced), with `prompt_len`."""
        out = {f.name: getattr(self, f.name)[idx] for f in fields(self) if f.name != "prompt_len"}
        out["prompt_len"] = self.prompt_len
        return out


def response_logits(logits: torch.Tensor, prompt_len: int, width: int) -> torch.Tensor:
    """[B, P+T, V] -> [B, T, V]: the logits that predict response tokens 0..T-1 (positions P-1..)."""
    return logits[:, prompt_len - 1 : prompt_len - 1 + width]


def token_logprobs(model: torch.nn.Module, batch: dict, temperature: float, with_entropy: bool = False):
    """log p(response token) under `model` (logits / temperature): [B, T] (and entropy [B, T])."""
    seqs, P = batch["sequences"], batch["prompt_len"]
    T = seqs.shape[1] - P
    if has_fused_logprobs(model):  # engine.kernels: from hidden states, no [B, T, vocab] logits
        logp, entropy = model(input_ids=seqs, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
                              logprob_targets=seqs[:, P:], logprob_start=P - 1, temperature=temperature,
                              with_entropy=with_entropy)
        return (logp, entropy.detach()) if with_entropy else logp
    logits = model(input_ids=seqs, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
                   use_cache=False).logits
    logits = response_logits(logits, P, T).float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, seqs[:, P:, None]).squeeze(-1)
    if not with_entropy:
        return logp
    return logp, ppo_math.entropy_from_logits(logits.detach())


def token_values(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Critic values of the states before each response token: [B, T]."""
    seqs, P = batch["sequences"], batch["prompt_len"]
    values = model(input_ids=seqs, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
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
    critic: torch.nn.Module,
    reward: torch.nn.Module,
    micro_batch_size: int,
    temperature: float,
) -> dict[str, torch.Tensor]:
    """Old log-probs, reference log-probs, values and reward scores, in micro-batches.

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
        parts["values"].append(token_values(critic, mb))
        rm_values = reward(input_ids=mb["sequences"], attention_mask=mb["attention_mask"],
                           position_ids=mb["position_ids"])
        parts["score"].append(sequence_scores(rm_values.float(), mb["attention_mask"]))
    out = {k: torch.cat(v) for k, v in parts.items()}
    out["position_ids"] = base["position_ids"]
    return out


def empty_responses(responses: torch.Tensor, response_mask: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """[B] bool: rows whose response has no token before its EOS (nothing was said)."""
    first_is_eos = torch.isin(responses[:, 0], torch.tensor(eos_ids, device=responses.device))
    return (response_mask.sum(1) == 0) | first_is_eos


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
) -> Experience:
    """Rewards (KL penalty per token + clipped score on the last), GAE advantages and returns."""
    mask = response_mask.float()
    rewards, kl = ppo_math.compute_rewards(scored["logp_old"], scored["logp_ref"], scored["score"], mask,
                                           kl_coef, clip_reward_value, kl_estimator)
    advantages, returns = ppo_math.gae_advantages(rewards, scored["values"], mask, gamma, lam)
    return Experience(
        sequences=sequences, attention_mask=attention_mask, position_ids=scored["position_ids"], response_mask=mask,
        logp_old=scored["logp_old"], logp_ref=scored["logp_ref"], values=scored["values"], score=scored["score"],
        rewards=rewards, kl=kl, advantages=advantages, returns=returns, prompt_len=prompt_len,
    )


def whiten_advantages_(exp: Experience, shift_mean: bool = True) -> None:
    """Advantages normalised over this rank's response tokens (in place)."""
    exp.advantages = ppo_math.masked_whiten(exp.advantages, exp.response_mask, shift_mean=shift_mean)
