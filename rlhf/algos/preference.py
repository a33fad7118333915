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

KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", eq. 7-8;
TRL's KTOTrainer.kto_loss) needs no pairs: each row is (x, y, desirable or not), `kto_loss` below.
No imports of transformers/peft/hydra: tests call these directly.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo")  # on pairs: `dpo_loss`
UNPAIRED_LOSS_TYPES = ("kto",)  # on labelled rows: `kto_loss`
NEEDS_REFERENCE = {"sigmoid": True, "ipo": True, "hinge": True, "robust": True, "simpo": False, "kto": True}


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


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    policy_kl_logps: torch.Tensor,
    ref_kl_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    kl_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    lengths: torch.Tensor | None = None,
    sft_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KTO's per-row losses [B], implicit rewards [B] (detached) and KL estimate (a scalar, nats, detached).

    Inputs: the summed response log-probs of B rows (x_i, y_i) under the policy and the reference [B],
    `desirable` [B] bool (the row's label), and of M mismatched rows (x_i, y_j), j != i: a prompt with
    another row's response [M] each. With r_i = beta (logpi(y_i|x_i) - logpi_ref(y_i|x_i)) and the
    reference point
        z0 = beta max(0, mean_M(logpi(y_j|x_i) - logpi_ref(y_j|x_i)))        (detached; KTO eq. 7-8)
    the losses are
        desirable:    lambda_D (1 - s(r_i - z0))
        undesirable:  lambda_U (1 - s(z0 - r_i))
    (s = sigmoid, lambda_D = `desirable_weight`, lambda_U = `undesirable_weight`), as TRL's
    `KTOTrainer.kto_loss` computes them: `1 - sigmoid(beta * (logratio - kl))`, kl the clamped mean.
    The mean runs over the M rows given, or, with `kl_reduce`, over what `kl_reduce([sum, count])`
    returns (e.g. the sums over every rank: the estimate of the whole global micro-batch, as TRL
    gathers it across processes). Gradients flow through `policy_logps` only. `sft_coef` > 0 adds
    sft_coef x the response's NLL per token, -logpi(y_i|x_i) / n_i, to each desirable row's loss (as
    `dpo_loss` adds it to the chosen response; `lengths` [B] = the n_i).

    Class balance (the paper's eq. 8, TRL's recommendation): with n_D desirable and n_U undesirable
    rows, keep lambda_D n_D / (lambda_U n_U) in [1, 4/3]: upweight the rarer kind (`kto_weight_advice`).
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if desirable_weight <= 0 or undesirable_weight <= 0:
        raise ValueError(f"the desirable/undesirable weights must be > 0, got {desirable_weight}, {undesirable_weight}")
    diff = policy_kl_logps.detach().float() - ref_kl_logps.float()
    total = torch.stack([diff.sum(), torch.tensor(float(diff.numel()), device=diff.device)])
    if kl_reduce is not None:
        total = kl_reduce(total)
    if total[1].item() <= 0:
        raise ValueError("kto_loss needs at least one mismatched row (x_i, y_j) to estimate the KL")
    kl = (total[0] / total[1]).clamp(min=0).detach()
    rewards = beta * (policy_logps.float() - ref_logps.float())
    z0 = beta * kl
    desirable = desirable.bool()
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(rewards - z0)),
                         undesirable_weight * (1 - torch.sigmoid(z0 - rewards)))
    if sft_coef:
        if lengths is None:
            raise ValueError("kto_loss with sft_coef > 0 needs the response lengths")
        losses = losses + torch.where(desirable, sft_coef * (-policy_logps.float() / lengths), 0.0)
    return losses, rewards.detach(), kl


def kto_stats(rewards: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-batch figures that stay exact when averaged over batches weighted by their row counts (the
    engine's metric means): the desirable share, each kind's reward summed and divided by the batch's
    rows, the KL. `kto_means` turns their averages into per-kind means."""
    d, n = desirable.bool(), rewards.numel()
    return {"desirable_share": d.float().mean(), "reward_desirable_sum": torch.where(d, rewards, 0.0).sum() / n,
            "reward_undesirable_sum": torch.where(d, 0.0, rewards).sum() / n, "kl": kl}


def kto_means(stats: dict[str, float]) -> dict[str, float | None]:
    """`kto_stats`' averages -> reward_desirable / reward_undesirable (mean implicit reward of each kind;
    None without rows of that kind), margin (their difference) and kl."""
    share = stats["desirable_share"]
    good = stats["reward_desirable_sum"] / share if share > 0 else None
    bad = stats["reward_undesirable_sum"] / (1 - share) if share < 1 else None
    margin = good - bad if good is not None and bad is not None else None
    return {"reward_desirable": good, "reward_undesirable": bad, "margin": margin, "kl": stats["kl"]}


def kto_weight_advice(n_desirable: int, n_undesirable: int, desirable_weight: float,
                      undesirable_weight: float) -> str | None:
    """None when lambda_D n_D / (lambda_U n_U) lies in [1, 4/3] (KTO eq. 8; TRL's KTOConfig docs), else
    a sentence with the weights that would bring it there (either one, not both)."""
    if n_desirable == 0 or n_undesirable == 0:
        return None  # one kind only: nothing to balance
    ratio = desirable_weight * n_desirable / (undesirable_weight * n_undesirable)
    if 1 <= ratio <= 4 / 3 + 1e-9:
        return None
    d_lo = undesirable_weight * n_undesirable / n_desirable
    u_hi = desirable_weight * n_desirable / n_undesirable
    return (f"{n_desirable} desirable and {n_undesirable} undesirable rows at dpo.desirable_weight={desirable_weight:g}, "
            f"dpo.undesirable_weight={undesirable_weight:g} give lambda_D n_D / (lambda_U n_U) = {ratio:.3g}; KTO "
            f"(Ethayarajh et al. 2024, eq. 8) recommends [1, 4/3]: EITHER dpo.desirable_weight in "
            f"[{d_lo:.3g}, {d_lo * 4 / 3:.3g}] OR dpo.undesirable_weight in [{u_hi * 3 / 4:.3g}, {u_hi:.3g}]")
