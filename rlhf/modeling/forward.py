"""The forward passes the stages compute through a role (rlhf/modeling/roles.py): log-probs of given
tokens, per-token values, a padded batch packed without padding and back (`Repacked`), the SFT loss.
The RL stage scores its rollouts with them (rlhf/rl/rollout.py). Everything is per rank, over its rows.

Layout of one rank's experience (P = prompt width, T = response width):
    sequences, attention_mask, position_ids   [B, P+T]  prompts LEFT-padded, responses right-padded
    response_mask, logp_old, logp_ref, values,
    rewards, kl, advantages, returns          [B, T]    column t = response token t
    score                                     [B]       the reward source's (e.g. the reward model's value
                                                        at the last real token: rlhf/rl/rewards.py)
batch["shared_prompts"] (rollout.shared_prompt_forward): rows that share a prompt run it once per
forward (rlhf/modeling/roles.py shared_prompt_forward), the same values up to rounding.
Position ids come from the attention mask (cumsum - 1), exactly as `generate` numbers positions,
for every model's forward: otherwise the left padding shifts every position and the PPO ratio is
computed against log-probs of a different model input than the one that was sampled.
"""
from __future__ import annotations

import torch

from rlhf.algos.reward_model import sequence_scores
from rlhf.data.packing import is_packed, pack_rows, packed_scores
from rlhf.data.tokenize import IGNORE_INDEX


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] -> [B, L]: 0, 1, 2, ... over real tokens (as `generate` numbers them; pad positions get
    whatever is left over: they are never attended and never scored)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class Repacked:
    """A padded rollout batch's real tokens packed without padding (rlhf/data/packing.py layout), and
    the way back: `unpack(x [P', T'])` -> [B, L], each real position's value, 0 on padding.

    Rows are [left pad, prompt, response, right pad]: the real tokens of a row are contiguous, and
    their position ids (0, 1, ...) are `position_ids_from_mask`'s, so a packed forward sees each row
    exactly as the padded one does."""

    def __init__(self, sequences: torch.Tensor, attention_mask: torch.Tensor, pack_length: int):
        B, L = sequences.shape
        mask = attention_mask.bool()
        dev = sequences.device
        # NOTE: the packing is decided on the host: one copy of the micro-batch's ids per forward
        rows = [r[m].tolist() for r, m in zip(sequences.cpu(), mask.cpu())]
        pk = pack_rows(rows, 0, pack_length)
        P, T = pk["input_ids"].shape
        start = (pk["row_pack"] * T + pk["row_end"] + 1 - mask.sum(1).cpu()).to(dev)  # flat start of each row
        first = mask.long().argmax(1)  # column of each row's first real token
        col = torch.arange(L, device=dev)[None, :]
        # flat index into [P, T] of every padded position (real ones; padding points at 0 and is masked)
        self.index = torch.where(mask, start[:, None] + col - first[:, None], 0)
        self.mask, self.shape = mask, (P, T)
        self.input_ids = pk["input_ids"].to(dev)
        self.position_ids = pk["position_ids"].to(dev)
        self.row_id = pk["row_id"].to(dev)

    def next_targets(self) -> torch.Tensor:
        """[P, T-1]: the next token where it belongs to the same row, else IGNORE_INDEX."""
        same = (self.row_id[:, 1:] == self.row_id[:, :-1]) & (self.row_id[:, 1:] >= 0)
        return self.input_ids[:, 1:].masked_fill(~same, IGNORE_INDEX)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[P, T'] (T' <= T: missing trailing columns read as 0) -> [B, L] at each real position, 0 elsewhere."""
        if x.shape[1] < self.shape[1]:
            x = torch.nn.functional.pad(x, (0, self.shape[1] - x.shape[1]))
        return x.reshape(-1)[self.index].masked_fill(~self.mask, 0)


def _shared(batch: dict) -> dict:
    """The role's keyword for batch["shared_prompts"]: {"prompt_len": P}, or none (a role that does not
    share prompts is called as before)."""
    return {"prompt_len": batch["prompt_len"]} if batch.get("shared_prompts") else {}


def token_logprobs(policy: torch.nn.Module, batch: dict, temperature: float, with_entropy: bool = False,
                   truncate: tuple[int, float] | None = None):
    """log p(response token) under a `Policy` role (logits / temperature): [B, T] (and entropy [B, T]).
    With batch["pack_length"] (data.packing) the forward runs on the packed real tokens (`Repacked`).
    `truncate` (top_k, top_p): the sampler's truncation applied to the scaled logits, renormalised."""
    trunc = {} if truncate is None else {"truncate": truncate}
    seqs, P = batch["sequences"], batch["prompt_len"]
    if batch.get("pack_length") is not None:
        rp = Repacked(seqs, batch["attention_mask"], batch["pack_length"])
        logp, entropy = policy(rp.input_ids, None, rp.position_ids, targets=rp.next_targets(),
                               temperature=temperature, with_entropy=with_entropy, **trunc)
        T = seqs.shape[1] - P
        logp = rp.unpack(logp)[:, P - 1 : P - 1 + T]  # position P-1+t predicts response token t
        entropy = None if entropy is None else rp.unpack(entropy)[:, P - 1 : P - 1 + T]
    else:
        logp, entropy = policy(seqs, batch["attention_mask"], batch["position_ids"], targets=seqs[:, P:], start=P - 1,
                               temperature=temperature, with_entropy=with_entropy, **_shared(batch), **trunc)
    return (logp, entropy) if with_entropy else logp


def row_values(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """A `ValueModel`'s [B, L] values of a rollout batch, packed when batch["pack_length"] is set, each
    shared prompt run once when batch["shared_prompts"] is (with batch["prompt_len"])."""
    if batch.get("pack_length") is not None:
        rp = Repacked(batch["sequences"], batch["attention_mask"], batch["pack_length"])
        return rp.unpack(model(rp.input_ids, None, rp.position_ids))
    return model(batch["sequences"], batch["attention_mask"], batch["position_ids"], **_shared(batch))


def token_values(critic: torch.nn.Module, batch: dict) -> torch.Tensor:
    """A `ValueModel` critic's values of the states before each response token: [B, T]."""
    seqs, P = batch["sequences"], batch["prompt_len"]
    return row_values(critic, batch)[:, P - 1 : seqs.shape[1] - 1].float()


def sft_loss(policy: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Summed next-token cross-entropy over response tokens under a `Policy` role, and their count
    (the engine's weight). With engine.kernels the log-probs come from hidden states."""
    labels = batch["labels"][:, 1:]  # (B, L-1): token t+1 is predicted at position t
    # A packed batch (rlhf/data/packing.py) has no attention mask and per-row position ids.
    loss_sum = policy(batch["input_ids"], batch["attention_mask"], batch.get("position_ids"), targets=labels,
                      reduction="sum")
    return loss_sum, (labels != IGNORE_INDEX).sum(), {}


def batch_scores(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """[rows] scores of a `ValueModel` on a padded batch (value at the last real token), a packed one
    (rlhf/data/packing.py: value at each row's last token, in row order) or a shared-prompt one
    (rlhf/data/tokenize.py collate_shared_pairs: the value at the last real token, the prompt run once)."""
    if is_packed(batch):
        return packed_scores(model(batch["input_ids"], None, batch["position_ids"]), batch)
    if batch.get("shared_prompts"):  # collate_shared_pairs: each pair's prompt runs once
        values = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"], prompt_len=batch["prompt_len"])
        return sequence_scores(values, batch["attention_mask"])
    return sequence_scores(model(batch["input_ids"], batch["attention_mask"]), batch["attention_mask"])
