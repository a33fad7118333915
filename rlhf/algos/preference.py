"""Offline preference optimisation on pairs: DPO and its relatives as one pure function.

Inputs are per pair (B pairs): the summed log-probs of the chosen and rejected responses under the
policy and the reference, [B] each, and the responses' token counts, [B] each. With
    h = (logp_chosen - logp_rejected) - (ref_chosen - ref_rejected)      (the implicit reward margin / beta)
the per-pair losses are (beta > 0, eps = label_smoothing):
    sigmoid  DPO (Rafailov et al. 2023):        -log s(beta h); with eps > 0 conservative DPO (cDPO):
                                                -(1 - eps) log s(beta h) - eps log s(-beta h)
    robust   robust DPO (Chowdhury et al. 2024): (-(1 - eps) log s(beta h) + eps log s(-beta h)) / (1 - 2 eps),
                                                an unbiased loss under a flip rate eps of the labels (eps < 1/2)
    ipo      IPO (Azar et al. 2023):            (h - 1 / (2 beta))^2, on summed log-probs as in the paper
    hinge    SLiC (Zhao et al. 2023):           max(0, 1 - beta h)
    simpo    SimPO (Meng et al. 2024), reference-free and length-normalised:
                                                -log s(beta (logp_c / n_c - logp_r / n_r) - gamma)
(s = sigmoid). `sft_coef` > 0 adds sft_coef x the chosen response's NLL per token, -logp_c / n_c
(RPO, Pang et al. 2024). Implicit rewards: beta (logp - ref) per response (simpo: beta logp / n),
detached; "accuracy" is the share of pairs whose chosen reward exceeds the rejected one.
No imports of transformers/peft/hydra: tests call these directly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo")
NEEDS_REFERENCE = {"sigmoid": True, "ipo": True, "hinge": True, "robust": True, "simpo": False}


def sequence_logps(logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs [N, T] and a mask [N, T] (True = response token) -> (sum over the
    response [N] float32, response length [N] float32)."""
    mask = mask.bool()
    return torch.where(mask, logp.float(), 0.0).sum(-1), mask.sum(-1).float()


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None,
    chosen_len: torch.Tensor,
    rejected_len: torch.Tensor,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
    sft_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses [B], chosen rewards [B], rejected rewards [B]) for B pairs; see the module docstring.

    All inputs [B]; `ref_*` may be None for loss_type="simpo" (reference-free). Lengths are response
    token counts (> 0). Gradients flow through `policy_*` only.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    eps = label_smoothing
    if loss_type == "simpo":
        chosen, rejected = beta * policy_chosen / chosen_len, beta * policy_rejected / rejected_len
        losses = -F.logsigmoid(chosen - rejected - gamma)
    else:
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(f"loss_type={loss_type!r} needs the reference log-probs")
        chosen, rejected = beta * (policy_chosen - ref_chosen), beta * (policy_rejected - ref_rejected)
        h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
        if loss_type == "sigmoid":
            losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
        elif loss_type == "robust":
            losses = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
        elif loss_type == "ipo":
            losses = (h - 1 / (2 * beta)) ** 2
        else:  # hinge
            losses = torch.relu(1 - beta * h)
    if sft_coef:
        losses = losses + sft_coef * (-policy_chosen / chosen_len)
    return losses, chosen.detach(), rejected.detach()


def pair_stats(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """Means over pairs of the implicit rewards [B], their margin, and preference accuracy (ties wrong)."""
    return {"reward_chosen": chosen.mean(), "reward_rejected": rejected.mean(), "margin": (chosen - rejected).mean(),
            "accuracy": (chosen > rejected).float().mean()}
