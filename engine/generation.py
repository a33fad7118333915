"""Generation on an unsharded module: the generic path through `transformers` `generate`.

    out = hf_generate(model, prompt_ids, prompt_mask, SamplingParams(max_new_tokens=16),
                      eos_token_id=2, pad_token_id=0)
    out.sequences       [B, P + T]  the left-padded prompts, then the responses (right-padded)
    out.attention_mask  [B, P + T]  1 on prompt tokens and response tokens (EOS included)
    out.response_mask   [B, T]      1 on response tokens up to and including each row's first EOS
    out.logprobs        [B, T]      optional: the sampler's log p(token), under the distribution it
                                    was drawn from (softmax(logits / temperature), top-k/top-p
                                    applied and renormalised; greedy: softmax(logits)), 0 off-mask

Every row stops at its own EOS (later columns are pad, outside the masks); T is the number of
steps actually taken (the loop ends when every row has finished or at max_new_tokens). Sampling
settings are passed explicitly in a fresh `GenerationConfig`, so a model's own
generation_config (e.g. do_sample=False, top_k=50, repetition penalties) never changes what was
asked: greedy only when `greedy=True`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# The one settings class of both paths (its docstring states the sampling convention), also
# imported from here: this module is the generation interface.
from .inference.sampling import SamplingParams


def choose_generation_path(want: str, device_type: str, config, *, adapters: bool = False) -> tuple[str, str]:
    """("injected" | "hf", why) for `engine.generation=want` on a `device_type` device, for a model of
    HF `config` (`adapters`: unmerged LoRA adapters, which the injected model does not apply). The
    engine's decision (TrainEngine.generation), also what `python -m rlhf.env` / `rlhf.plan` report."""
    from .inference import supports

    if want == "hf":
        return "hf", "engine.generation=hf"
    if want == "auto" and device_type != "cuda":
        return "hf", f"engine.generation=auto runs transformers generate off CUDA (device {device_type})"
    if adapters:
        return "hf", "falling back: the injected model does not apply unmerged LoRA adapters"
    ok, reason = supports(config)
    if not ok:
        return "hf", f"falling back: {reason}"
    return "injected", f"engine.generation={want}, {config.model_type} is supported"


def _max_new_tokens(params: SamplingParams) -> int:
    if params.max_new_tokens is None:
        raise ValueError("generation needs SamplingParams(max_new_tokens=...)")
    return params.max_new_tokens


@dataclass(slots=True)
class Generated:
    sequences: torch.Tensor  # [B, P + T] long
    attention_mask: torch.Tensor  # [B, P + T] long
    response_mask: torch.Tensor  # [B, T] long
    prompt_len: int  # P
    logprobs: torch.Tensor | None = None  # [B, T] float32

    @property
    def responses(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_len :]


def response_mask_from_eos(responses: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """[B, T] ids -> [B, T] long mask: 1 up to and including the first EOS of each row, 0 after.

    Correct when pad == eos (padding after the first EOS is excluded like any pad).
    """
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device)).long()
    before = torch.cumsum(is_eos, dim=1) - is_eos  # EOS tokens strictly before this column
    return (before == 0).long()


@torch.no_grad()
def hf_generate(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: SamplingParams,
    *,
    eos_token_id: int | list[int],
    pad_token_id: int,
    return_logprobs: bool = False,
) -> Generated:
    """Generate from LEFT-padded prompts with `model.generate` (KV cache). Randomness: torch's RNG."""
    from transformers import GenerationConfig

    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    sampling = {} if params.greedy else dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    gen_cfg = GenerationConfig(
        max_new_tokens=_max_new_tokens(params),
        do_sample=not params.greedy,
        eos_token_id=eos_ids,
        pad_token_id=pad_token_id,
        output_scores=return_logprobs,  # the processed scores: / temperature, top-k/top-p at -inf
        return_dict_in_generate=True,
        **sampling,
    )
    if params.greedy:
        gen_cfg.top_k, gen_cfg.top_p, gen_cfg.temperature = None, None, None
    was_training = model.training
    model.eval()
    try:
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen_cfg)
    finally:
        model.train(was_training)
    P = prompt_ids.shape[1]
    seqs = out.sequences
    resp_mask = response_mask_from_eos(seqs[:, P:], eos_ids)
    logprobs = None
    if return_logprobs:
        # [B, T, V] the scores the token was drawn from: logits / temperature with the tokens top-k /
        # top-p drop at -inf (no warper when off; greedy: the raw logits), so log_softmax renormalises
        scores = torch.stack(out.scores, dim=1).float()
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, seqs[:, P:, None]).squeeze(-1)
        logprobs = torch.where(resp_mask.bool(), logprobs, 0.0)
    attn = torch.cat([prompt_mask.to(seqs.device).long(), resp_mask], dim=1)
    return Generated(sequences=seqs, attention_mask=attn, response_mask=resp_mask, prompt_len=P, logprobs=logprobs)


def probe_prompts(vocab_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two fixed prompts (ids [2, 6], mask [2, 6]; the second left-padded by 2) for `decoder_mismatch`."""
    ids = torch.randint(3, vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


@torch.no_grad()
def decoder_mismatch(fast, reference: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
                     dtype: torch.dtype, max_new_tokens: int = 4, stats: dict | None = None) -> str | None:
    """Why the injected decoder `fast` (an InjectedGenerator) disagrees with `reference` (the
    transformers module with the same, full weights), or None. The first-use self-check of
    `TrainEngine.generation()` and `python -m rlhf.env --check` both call it.

    `fast` decodes `max_new_tokens` greedily with no EOS (every step counts); `reference` scores the
    result in one teacher-forced forward. At every response token the decoded token must be the
    reference's greedy choice, or a near-tie: its reference log-prob within the tolerance of the best
    one's; and the decoder's log-probs must match the reference's (kernels.testing.mismatch: the
    kernels' per-dtype tolerances, `dtype` being the compute dtype). `stats` (a dict) receives the
    measured figures: tokens compared, the largest near-tie gap, the log-probs' relative error.
    """
    from kernels.testing import TOLERANCES, mismatch

    try:
        out = fast.generate(prompt_ids, prompt_mask, SamplingParams(max_new_tokens=max_new_tokens, greedy=True),
                            eos_token_id=-1, pad_token_id=0, return_logprobs=True)
    except Exception as e:  # noqa: BLE001 - any failure of the fast path means: do not use it
        return f"the injected decoder raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    P, mask = prompt_ids.shape[1], out.attention_mask
    was_training = reference.training
    reference.eval()
    try:
        logits = reference(input_ids=out.sequences, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                           use_cache=False).logits
    finally:
        reference.train(was_training)
    logp_all = logits[:, P - 1 : -1].float().log_softmax(-1)  # [B, T, V]: what predicts response token t
    tokens = out.sequences[:, P:]
    want = logp_all.gather(-1, tokens[..., None]).squeeze(-1)  # [B, T]
    gap = logp_all.max(-1).values - want  # 0 where the decoded token is the reference's greedy choice
    tol = TOLERANCES[dtype]
    if stats is not None:
        from kernels.testing import rel_err

        stats.update(tokens=tokens.numel(), max_gap=gap.max().item(),
                     logprob_rel_err=rel_err(out.logprobs, want * out.response_mask))
    if (gap > tol).any():
        r, t = (gap > tol).nonzero()[0].tolist()
        return (f"greedy token {t} of row {r}: decoded {tokens[r, t].item()}, transformers' choice "
                f"{logp_all[r, t].argmax().item()} (log-prob gap {gap[r, t].item():.3g} > tolerance {tol:.0e})")
    return mismatch(out.logprobs, want * out.response_mask, dtype, names=("greedy log-probs",))


class HFGenerator:
    """The generic generation path: `transformers` `generate` on the whole module."""

    name = "hf"

    def __init__(self, module: nn.Module):
        self.module = module

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams, *,
                 eos_token_id: int | list[int], pad_token_id: int, return_logprobs: bool = False) -> Generated:
        return hf_generate(self.module, prompt_ids, prompt_mask, params, eos_token_id=eos_token_id,
                           pad_token_id=pad_token_id, return_logprobs=return_logprobs)


class InjectedGenerator:
    """The injected path: `engine.inference.InferenceModel` (fused weights, static KV cache, CUDA
    graphs on CUDA), same interface and output layout as `HFGenerator`."""

    name = "injected"

    def __init__(self, model):
        self.model = model

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams, *,
                 eos_token_id: int | list[int], pad_token_id: int, return_logprobs: bool = False) -> Generated:
        from .inference import generate

        out = generate(self.model, prompt_ids, prompt_mask, _max_new_tokens(params), eos_token_id=eos_token_id,
                       pad_token_id=pad_token_id, sampling=params, return_logprobs=return_logprobs)
        resp_mask = out.response_mask.long()
        logprobs = out.logprobs.float() * resp_mask if return_logprobs else None
        return Generated(sequences=out.sequences, attention_mask=out.attention_mask.long(), response_mask=resp_mask,
                         prompt_len=prompt_ids.shape[1], logprobs=logprobs)
