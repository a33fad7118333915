"""Model roles: modules whose forward IS the role's computation, so an engine shards and wraps them
like any module (FSDP2 / DDP hooks run around exactly what the stage calls) and nothing is patched
onto model instances.

    policy = Policy(load_causal_lm(...), fused=cfg.engine.kernels)        # actor, SFT model, reference
    logp, entropy = policy(input_ids, attention_mask, position_ids, targets=seqs[:, P:], start=P - 1,
                           temperature=0.7, with_entropy=True)             # [B, T], [B, T]
    nll_sum = policy(input_ids, attention_mask, targets=labels[:, 1:], reduction="sum")   # SFT, ptx
    values = ValueModel(load_value_model(...))(input_ids, attention_mask, position_ids)  # [B, L] fp32
    scores = sequence_scores(values, attention_mask)                      # a reward model's score [B]

A reference model is a `Policy` in a FrozenEngine. The role holds the transformers model (peft-
wrapped or not) as `inner`; state-dict names, exports and generation see that model's own names
(engine.ModuleView), so a checkpointed or exported role is the plain Hugging Face model.
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from engine import ModuleView, hf_base_model
from engine.generation import CACHE_KWARG, prompt_groups
from engine.inference.sampling import filter_logits
from kernels import fused_logprobs_entropy
from rlhf.algos.rl import entropy_from_logits
from rlhf.data.packing import EXPLICIT_MASK_MODEL_TYPES, block_causal_mask
from rlhf.data.tokenize import IGNORE_INDEX


def _mask(module: nn.Module, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None):
    """The attention mask to hand the model. A packed batch (rlhf/data/packing.py: no mask, per-row
    position ids) keeps None where transformers builds the block-diagonal mask from the position ids,
    and gets it explicitly for families that do not (OPT)."""
    if attention_mask is not None or position_ids is None:
        return attention_mask
    config = hf_base_model(module).config
    if config.model_type not in EXPLICIT_MASK_MODEL_TYPES:
        return None
    return block_causal_mask(position_ids, config._attn_implementation)


def shared_prompt_forward(model: nn.Module, field: str, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          position_ids: torch.Tensor | None, prompt_len: int, keep_from: int = 0,
                          max_buckets: int | None = None):
    """`model`'s output `field` (logits or last_hidden_state) at positions keep_from.. of rows whose
    first `prompt_len` columns (a left-padded prompt) repeat across rows, GRPO's n samples of one
    prompt: each distinct prompt runs once, its KV cache is gathered for every row that has it, and
    the responses run on that cache. Every position attends to the same positions with the same
    position ids as in one forward of the whole rows, so the outputs are that forward's up to
    rounding, and gradients flow through the gathered cache into the shared prompt's forward.
    Returns [B, L - keep_from, ...], or None when no two rows share a prompt (the caller runs the rows
    whole). rollout.shared_prompt_forward (docs/engine.md)."""
    groups = prompt_groups(input_ids, attention_mask, prompt_len)
    if groups is None:
        return None
    first, inverse = groups
    P = prompt_len
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    head = model(input_ids=input_ids[first, :P], attention_mask=attention_mask[first, :P],
                 position_ids=position_ids[first, :P], use_cache=True)
    cache = getattr(head, "cache", None) or getattr(head, "past_key_values", None)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        raise ValueError(f"{type(hf_base_model(model)).__name__} returned no KV cache to share a prompt's forward "
                         "between its rows: set rollout.shared_prompt_forward=false (RL) or data.shared_prompts=false "
                         "(reward, dpo)")
    T = input_ids.shape[1] - P
    buckets = _sub_batches(model, attention_mask[:, P:], max_buckets) if hasattr(cache, "layers") else \
        [(torch.arange(input_ids.shape[0], device=input_ids.device), T)]
    if len(buckets) == 1:  # every row at the longest response's width
        w = buckets[0][1]
        cache.batch_select_indices(inverse)
        tail = getattr(model(input_ids=input_ids[:, P : P + w], attention_mask=attention_mask[:, : P + w],
                             position_ids=position_ids[:, P : P + w], use_cache=True, **{CACHE_KWARG: cache}), field)
        tail = F.pad(tail, (0, 0, 0, T - w)) if w < T else tail
    else:  # each sub-batch's output written into its rows of one [B, T, ...] (no padded copies, no gather)
        tail = None
        for rows, w in buckets:
            out = getattr(model(input_ids=input_ids[rows, P : P + w], attention_mask=attention_mask[rows, : P + w],
                                position_ids=position_ids[rows, P : P + w], use_cache=True,
                                **{CACHE_KWARG: _select_cache(cache, inverse[rows])}), field)
            if tail is None:
                tail = out.new_zeros((input_ids.shape[0], T, *out.shape[2:]))
            tail[rows, :w] = out
    if keep_from >= P:
        return tail[:, keep_from - P :]
    return torch.cat([getattr(head, field)[:, keep_from:][inverse], tail], 1)


# A forward's fixed cost, in tokens of its rows' work: `length_buckets` makes another sub-batch only where it
# saves more padded positions than this (on this CPU 16 and 64 measured alike on the ~25M shape, 128 and 256 slower:
# docs/engine.md).
BUCKET_FORWARD_TOKENS = 64
# length_buckets=None (auto): sub-batches by length on the CPU with whole parameters; one trimmed forward on CUDA
# (a small model's forward there is launch-bound, padding nearly free: unmeasured) and under FSDP2 (each
# sub-batch's forward all-gathers the parameters again)
AUTO_BUCKETS = 8


def length_buckets(tail_mask: torch.Tensor, max_buckets: int,
                   forward_tokens: int = BUCKET_FORWARD_TOKENS) -> list[tuple[torch.Tensor, int]]:
    """Rows of right-padded responses (`tail_mask` [B, T]) as (rows, width) sub-batches by length, each run at its
    own width (the longest extent in it: its last real column + 1): the rows sorted by extent and cut into at
    most `max_buckets` runs, the cuts that minimise the computed positions plus `forward_tokens` per sub-batch
    (dynamic programming over the sorted extents: exact). One sub-batch is the rows trimmed to their longest."""
    B, T = tail_mask.shape
    if T == 0:
        return [(torch.arange(B, device=tail_mask.device), 0)]
    cols = torch.arange(1, T + 1, device=tail_mask.device)
    extent = (tail_mask.bool() * cols).amax(1).clamp(min=1)
    order = torch.argsort(extent, stable=True)
    e = extent[order].tolist()
    # costs[k][j]: the first j sorted rows in exactly k + 1 sub-batches, the last of them starting at cuts[k][j]
    # (float64 holds these integer costs exactly; ties go to the first cut, torch.min's first index)
    ext = torch.tensor(e, dtype=torch.float64)
    j = torch.arange(B + 1, dtype=torch.float64)
    first = torch.cat([torch.tensor([float("inf")], dtype=torch.float64), j[1:] * ext + forward_tokens])
    costs, cuts = [first.tolist()], [[0] * (B + 1)]
    # cand[i, j] = the first i rows' cost + rows i..j-1 at row j-1's extent + a forward, for 1 <= i < j
    width = torch.cat([torch.zeros(1, dtype=torch.float64), ext])  # width[j] = e[j - 1]
    span = (j[None, :] - j[:, None]) * width[None, :] + forward_tokens
    valid = (j[:, None] >= 1) & (j[:, None] < j[None, :])
    prev = first
    for _ in range(1, max(1, min(max_buckets, B))):
        cand = torch.where(valid, prev[:, None] + span, torch.tensor(float("inf"), dtype=torch.float64))
        prev, cut = cand.min(0)
        costs.append(prev.tolist())
        cuts.append(cut.tolist())
    k = min(range(len(costs)), key=lambda k: costs[k][B])  # the fewest sub-batches among equal costs
    bounds, j = [], B
    for k in range(k, -1, -1):
        i = cuts[k][j]
        bounds.append((i, j))
        j = i
    return [(order[i:j], e[j - 1]) for i, j in reversed(bounds)]


def _sub_batches(model: nn.Module, tail_mask: torch.Tensor, max_buckets: int | None) -> list[tuple[torch.Tensor, int]]:
    if max_buckets is None:
        # NOTE: FSDP2's module class, not DTensor parameters: between a ZeRO-2 forward and its backward the
        # parameters are the unsharded plain tensors, and ranks that split differently would hang
        local = tail_mask.device.type == "cpu" and not any(isinstance(m, FSDPModule) for m in model.modules())
        max_buckets = AUTO_BUCKETS if local else 1
    return length_buckets(tail_mask, max_buckets, BUCKET_FORWARD_TOKENS)


def _select_cache(cache, rows: torch.Tensor):
    """A dynamic KV cache's copy holding `rows` (the original stays whole for the next sub-batch; the layers'
    tensors are indexed, not written, so gradients flow back to the shared prompt's forward)."""
    new = copy.copy(cache)
    new.layers = [copy.copy(layer) for layer in cache.layers]
    new.batch_select_indices(rows)
    return new


class Policy(ModuleView):
    """A causal LM as a policy: log-probs (and entropy) of given tokens.

    forward(input_ids [B, L], attention_mask [B, L], position_ids [B, L] | None, *, targets [B, T],
            start, temperature, with_entropy, reduction, prompt_len)
      position t of `targets` is predicted at input position start + t;
      prompt_len (not None, start >= prompt_len - 1): the rows' first prompt_len columns are a left-padded
      prompt that several rows share, run once per distinct prompt (`shared_prompt_forward`);
      reduction="none" -> (logp [B, T] float32, entropy [B, T] detached, or None);
      reduction="sum"  -> the summed negative log-likelihood of the targets (IGNORE_INDEX skipped).
    `fused` (engine.kernels): the backbone's hidden states go through `kernels.fused_logprobs_entropy`
    with the output embedding, chunked over the vocabulary, so [B, T, vocab] logits never exist;
    otherwise the model's logits (temperature-scaled in float32) go through log_softmax, unless they
    would exceed `max_logits_mb` (engine.max_logits_mb): then the hidden states go through the fused
    op as well, a [chunk, vocab] slice of at most that size at a time (on CUDA its Triton kernel,
    checked on first use). The model's own logits stay where the head is not a plain linear layer
    (an adapter on it) and for top-k / top-p truncated log-probs (`truncate`).
    """

    # rows sharing a prompt: the most sub-batches by response length of their forward (`length_buckets`;
    # None = auto: AUTO_BUCKETS on the CPU with whole parameters, else 1; rollout.length_buckets)
    length_buckets: int | None = None

    def __init__(self, lm: nn.Module, *, fused: bool = False, max_logits_mb: float | None = None):
        super().__init__(lm)
        self.fused = fused
        self.max_logits_bytes = None if max_logits_mb is None else int(max_logits_mb * 2**20)

    def _chunked(self, rows: int, T: int) -> int | None:
        """Rows per [chunk, vocab] slice when this forward's fp32 logits would exceed max_logits_mb, else None."""
        if self.max_logits_bytes is None:
            return None
        head = hf_base_model(self).get_output_embeddings()
        if not isinstance(head, nn.Linear):  # an adapter on the head: its own forward, the model's logits
            return None
        per_row = head.weight.shape[0] * 4
        if rows * T * per_row <= self.max_logits_bytes:
            return None
        return max(1, self.max_logits_bytes // per_row)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None,
                *, targets: torch.Tensor, start: int = 0, temperature: float = 1.0, with_entropy: bool = False,
                reduction: str = "none", prompt_len: int | None = None, truncate: tuple[int, float] | None = None):
        T = targets.shape[1]
        attention_mask = _mask(self, attention_mask, position_ids)
        if prompt_len is not None and (attention_mask is None or start < prompt_len - 1):
            raise ValueError("a shared prompt forward needs a padded batch (an attention mask) and targets that "
                             f"start at or after the prompt's last position (start={start}, prompt_len={prompt_len})")
        if self.fused:
            if truncate is not None:
                raise ValueError("top-k / top-p truncated log-probs (ppo.trainer_logprobs=sampler) need the unfused "
                                 "forward (engine.kernels=false)")
            return self._fused(input_ids, attention_mask, position_ids, targets, start, temperature, with_entropy,
                               reduction, prompt_len)
        chunk = None if truncate is not None else self._chunked(targets.numel() // max(T, 1), T)
        if chunk is not None:  # engine.max_logits_mb: no [B, T, vocab] logits
            impl = "auto" if input_ids.device.type == "cuda" else "chunked"
            return self._fused(input_ids, attention_mask, position_ids, targets, start, temperature, with_entropy,
                               reduction, prompt_len, impl=impl, chunk_size=chunk)
        logits = None if prompt_len is None else shared_prompt_forward(
            self.inner, "logits", input_ids, attention_mask, position_ids, prompt_len, keep_from=start,
            max_buckets=self.length_buckets)
        if logits is None:
            logits = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=False).logits[:, start:]
        logits = logits[:, :T].float()  # (B, T, V): the logits that predict each target
        if reduction == "sum":  # NOTE: cross_entropy's own sum (SFT's loss, bit for bit as before roles)
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum")
        logits = logits / temperature
        if truncate is not None:  # the sampler's top-k / top-p (engine.inference.sampling's convention), renormalised
            # NOTE: the sampled token always stays in: at a top-p boundary another engine's rounding can keep a
            # token this forward's would drop, whose log-prob would then be -inf (a NaN ratio)
            kept = filter_logits(logits, *truncate)
            target = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, targets.clamp(min=0)[..., None], True)
            logits = torch.where(target, logits, kept)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0)[..., None])
        # NOTE: `.squeeze` would return a view, which FSDP2 warns about (see `_fused`): one [B, T] copy
        return logp[..., 0].clone(), entropy_from_logits(logits.detach()) if with_entropy else None

    def _fused(self, input_ids, attention_mask, position_ids, targets, start, temperature, with_entropy, reduction,
               prompt_len=None, impl="auto", chunk_size=None):
        base = hf_base_model(self)
        backbone = getattr(base, base.base_model_prefix)
        hidden = None if prompt_len is None else shared_prompt_forward(
            backbone, "last_hidden_state", input_ids, attention_mask, position_ids, prompt_len, keep_from=start,
            max_buckets=self.length_buckets)
        if hidden is None:
            hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False).last_hidden_state[:, start:]
        hidden = hidden[:, : targets.shape[1]]
        head = base.get_output_embeddings()
        logp, entropy = fused_logprobs_entropy(hidden, head.weight.to(hidden.dtype), targets, bias=head.bias,
                                               temperature=temperature, compute_entropy=with_entropy, impl=impl,
                                               chunk_size=chunk_size)
        if reduction == "sum":  # ignored targets have log-prob 0
            return -logp.sum()
        # NOTE: the op returns its flat [B*T] results `.view`ed to [B, T]; FSDP2 warns when a module
        # returns a view (an in-place op on it would skip the pre-backward hook), so copies leave.
        return logp.clone(), None if entropy is None else entropy.detach().clone()


def _local_params(module: nn.Module) -> bool:
    """Whether `module`'s gradients stay in this process: one rank, plain tensors. DDP waits for every
    parameter's gradient and FSDP2 reduce-scatters them, so there the graph keeps every parameter."""
    multi = torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1
    return not multi and not any(isinstance(p, DTensor) for p in module.parameters())


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`. Every parameter keeps its
    place in the graph (DDP and FSDP2 see all their gradients, zeros included)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class ValueModel(ModuleView):
    """Backbone + scalar head (an `AutoModelForSequenceClassification` with num_labels=1, peft-wrapped
    or not) as per-token values: forward(input_ids, attention_mask, position_ids=None, prompt_len=None) ->
    [B, L] float32 (prompt_len: rows sharing a left-padded prompt run it once, `shared_prompt_forward`).

    The critic's value of the state before response token t is column P - 1 + t; a reward model's
    score is the value at the last real token (`rlhf.algos.reward_model.sequence_scores`). Transformers'
    own pooling (the last token that is not `pad_token_id`) is not used: it is wrong when pad == eos.
    """

    # The gradient that reaches the backbone is scaled by this: 0 trains the head alone (the
    # backbone's gradients are exact zeros, so AdamW leaves it as it is; reward.head_only_fraction).
    backbone_grad: float = 1.0
    # With backbone_grad 0, run the backbone without an autograd graph where its gradients stay in this
    # process (one rank, plain tensors); False keeps the zero-scaled backward there too (the same update).
    head_only_without_graph: bool = True
    length_buckets: int | None = None  # as Policy's

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None, prompt_len: int | None = None) -> torch.Tensor:
        base = hf_base_model(self)
        backbone = getattr(base, base.base_model_prefix)
        if prompt_len is not None and attention_mask is None:
            raise ValueError("a shared prompt forward needs a padded batch (an attention mask)")
        frozen = (self.backbone_grad == 0.0 and self.head_only_without_graph and torch.is_grad_enabled()
                  and _local_params(backbone) and any(p.requires_grad for p in base.score.parameters()))
        with torch.no_grad() if frozen else contextlib.nullcontext():
            hidden = None if prompt_len is None else shared_prompt_forward(
                backbone, "last_hidden_state", input_ids, attention_mask, position_ids, prompt_len,
                max_buckets=self.length_buckets)
            if hidden is None:
                hidden = backbone(input_ids=input_ids, attention_mask=_mask(self, attention_mask, position_ids),
                                  position_ids=position_ids, use_cache=False).last_hidden_state
        if frozen:
            # The head alone, one process: the backbone runs without a graph (no backward through it:
            # 2.75x per step on the embedded default) and its trainable weights get the exact-zero gradients the
            # scaled backward would have given, so AdamW's state and step count, the gradient norm and
            # every weight are bit for bit what _ScaleGrad(0) gives (tests/test_reward.py).
            for p in backbone.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        elif self.backbone_grad != 1.0 and torch.is_grad_enabled():
            hidden = _ScaleGrad.apply(hidden, self.backbone_grad)
        # The head runs outside autocast, in its parameters' dtype (fp32 masters at stage 0/1): under
        # bf16 autocast a score has ~3 significant digits, chosen/rejected scores of similar rows
        # round to ties: on the embedded default (bf16, 625 steps) the reward model reached 0.66 held-out
        # accuracy with a bf16 head and 0.88 with this one. TRL and OpenRLHF keep the value head in fp32.
        head = base.score
        with torch.autocast(hidden.device.type, enabled=False):
            scores = head(hidden.to(next(head.parameters()).dtype))
        # NOTE: a new tensor, never a view: `.squeeze(-1).float()` is a view of the head's [B, L, 1]
        # output in fp32, and FSDP2 warns when a module returns a view (an in-place op on it would skip
        # the pre-backward hook). One [B, L] copy in every dtype.
        return scores.squeeze(-1).to(torch.float32, copy=True)
