"""Online DPO's pairs and loss, as pure functions (the RL stage's loop is in rlhf/rl/online_dpo.py).

Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"; TRL's
OnlineDPOTrainer): every step the policy answers each prompt n >= 2 times, a reward source ranks the
answers, and the DPO-family loss (rlhf/algos/preference.py `dpo_loss`) trains on the pair it gives,
with the reference frozen. Here a prompt group gives one pair, its best vs its worst response:

    chosen   = argmax_i s_i,  rejected = argmin_i s_i      over the group's valid rows (the first on a tie)
    a group with fewer than 2 valid rows is `unpaired`; one whose best score equals its worst is `tied`;
    neither gives a pair (both are counted).

With n = 2 this is the paper's setting (two samples, the annotator picks one); with n > 2 the widest
margin of the group, as TRL's reward-model judge does with its best/worst choice. The per-pair loss is
`dpo_loss` on the summed response log-probs of the policy and the reference.
No imports of transformers/peft/hydra: tests call these directly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.algos.preference import LOSS_TYPES, dpo_loss, sequence_logps

# the pair losses of rlhf/algos/preference.py (an unpaired loss such as KTO takes no pairs)
PAIR_LOSSES = LOSS_TYPES  # the pair losses of the offline stage (not kto: it takes labelled rows)


@dataclass
class Pairs:
    """One pair slot per prompt group (in the order of the groups' first rows). chosen/rejected: [G]
    row indices; valid: [G] bool, the slots that are real pairs (an invalid slot holds two rows of its
    group, to be weighted 0, so every rank runs the same forwards); tied, unpaired: group counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    valid: torch.Tensor
    tied: int
    unpaired: int

    @property
    def n(self) -> int:
        return int(self.valid.sum())


def best_worst_pairs(score: torch.Tensor, group: torch.Tensor, valid: torch.Tensor) -> Pairs:
    """Each group's best vs worst valid row by `score` (see the module docstring).

    score [B] (any float), group [B] (the prompt each row answers), valid [B] bool (rows that may be
    paired: not empty, finite, not dropped). Every group must have at least 2 rows.
    """
    if not (score.shape == group.shape == valid.shape and score.dim() == 1):
        raise ValueError(f"score, group and valid must be [B] each, got {tuple(score.shape)}, "
                         f"{tuple(group.shape)}, {tuple(valid.shape)}")
    order: list[int] = []
    rows: dict[int, list[int]] = {}
    for i, g in enumerate(group.tolist()):
        if g not in rows:
            order.append(g)
            rows[g] = []
        rows[g].append(i)
    s, ok = score.double().tolist(), valid.bool().tolist()
    chosen, rejected, real = [], [], []
    tied = unpaired = 0
    for g in order:
        members = rows[g]
        if len(members) < 2:
            raise ValueError(f"group {g} has {len(members)} row: online DPO needs >= 2 responses per prompt")
        usable = [i for i in members if ok[i]]
        if len(usable) < 2:
            unpaired += 1
            c, r, pair = members[0], members[1], False
        else:
            c = max(usable, key=lambda i: s[i])  # the first of the best
            r = min(usable, key=lambda i: s[i])  # the first of the worst
            pair = s[c] != s[r]
            if not pair:
                tied += 1
                c, r = usable[0], usable[1]
        chosen.append(c)
        rejected.append(r)
        real.append(pair)
    dev = score.device
    return Pairs(torch.tensor(chosen, dtype=torch.long, device=dev), torch.tensor(rejected, dtype=torch.long, device=dev),
                 torch.tensor(real, dtype=torch.bool, device=dev), tied, unpaired)


def pair_loss(logp: torch.Tensor, mask: torch.Tensor, ref_logps: torch.Tensor, weight: torch.Tensor, *,
              loss_type: str = "sigmoid", beta: float = 0.1, sft_coef: float = 0.0
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The DPO-family loss of k pairs laid out as 2k rows, the k chosen then the k rejected.

    logp [2k, T] the policy's per-token log-probs, mask [2k, T] response tokens, ref_logps [2k] the
    reference's summed log-probs of each row, weight [k] (0 = not a pair: left out of the loss and the
    stats). Returns (sum over the pairs of weight x `dpo_loss`, sum of weights, stats: the weighted
    means `dpo_accuracy` (chosen implicit reward above the rejected), `dpo_margin` (chosen - rejected
    implicit reward), `reward_chosen`, `reward_rejected`; 0 when no weight).
    """
    k = weight.shape[0]
    if logp.shape[0] != 2 * k or ref_logps.shape[0] != 2 * k:
        raise ValueError(f"{k} pairs need 2k = {2 * k} rows, got logp {tuple(logp.shape)}, ref {tuple(ref_logps.shape)}")
    total, lengths = sequence_logps(logp, mask)
    lengths = lengths.clamp(min=1)  # a zero-weight slot may be an empty row: keep simpo's division finite
    ref = ref_logps.float()
    losses, rc, rr = dpo_loss(total[:k], total[k:], ref[:k], ref[k:], lengths[:k], lengths[k:], loss_type=loss_type,
                              beta=beta, sft_coef=sft_coef)
    w = weight.float()
    keep = w > 0
    loss_sum = (torch.where(keep, losses, torch.zeros_like(losses)) * w).sum()
    n = w.sum()
    denom = n.clamp(min=1e-12)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (torch.where(keep, x.float(), torch.zeros_like(x, dtype=torch.float32)) * w).sum() / denom

    stats = {"dpo_accuracy": mean((rc > rr).float()), "dpo_margin": mean(rc - rr), "reward_chosen": mean(rc),
             "reward_rejected": mean(rr)}
    return loss_sum, n, stats
