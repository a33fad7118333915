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

`row_seeds` [B] (both paths): per-row sampling streams, the draw of row b's token t made with
`row_noise(row_seeds, t, V)[b]` (engine/inference/sampling.py), so a row's tokens do not depend on the
rest of its batch. Here a `RowStreamSampler` logits processor draws the token (kernels.sample, as the
injected path) and leaves only it finite, and `generate` runs in its greedy mode to pick it.
`BatchInvariantGenerator` (engine.deterministic) adds what makes the logits batch-invariant too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

# The one settings class of both paths (its docstring states the sampling convention), also
# imported from here: this module is the generation interface.
from .inference.generate import prompt_groups
from .inference.sampling import SamplingParams, row_noise, sample
from .parallelize import hf_base_model


# engine.generation=auto: a written rule (docs/engine.md, "Why auto ..."). On CUDA the injected model
# (decode steps as CUDA graphs, refreshed in place) wherever it can run the model. Off CUDA transformers
# generate: scripts/bench_generation.py times the bare injected decode, refresh included, at 1.43x (the
# embedded default's shape) and 1.66x (24.6M parameters) transformers', but inside the default RL step
# (scripts/bench_rl.py, the runs' generation_s) the generate phase measured level with transformers'
# (0.89x and 1.17x; 0.395 vs 0.420 s and 0.457 vs 0.444 s per step), so there was no gain to take.
AUTO_RULE = "the injected model on CUDA; off CUDA its decode gained nothing in the default RL step (docs/engine.md)"


def choose_generation_path(want: str, device_type: str, config, *, adapters: bool = False) -> tuple[str, str]:
    """("injected" | "hf", why) for `engine.generation=want` on a `device_type` device, for a model of
    HF `config` (`adapters`: unmerged LoRA adapters, which the injected model does not apply). The
    engine's decision (TrainEngine.generation), also what `python -m rlhf.env` / `rlhf.plan` report.
    `auto` follows AUTO_RULE (`device_type` is named in the reason)."""
    from .inference import supports

    if want == "vllm":  # refused before any weights load (vllm_backend.refusal), never a silent fallback
        return "vllm", "engine.generation=vllm"
    if want == "hf":
        return "hf", "engine.generation=hf"
    if want == "auto" and device_type != "cuda":
        return "hf", f"engine.generation=auto runs transformers generate off CUDA (device {device_type}): {AUTO_RULE}"
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


class RowStreamSampler:
    """A `transformers` logits processor that samples each row from its own stream: the token drawn
    by `sample(scores, params, noise=row_noise(row_seeds, t, V))` (t = tokens generated so far) keeps
    its score (0) and every other token gets -inf, so `generate`'s greedy mode picks it. The sampler's
    log-prob of each drawn token (under the filtered, renormalised distribution) is kept in `logprobs`
    (one [B] tensor per step): `generate`'s processed scores hold only the pick."""

    def __init__(self, row_seeds: torch.Tensor, params: SamplingParams, prompt_len: int):
        self.row_seeds, self.params, self.prompt_len = row_seeds, params, prompt_len
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1] - self.prompt_len
        tokens, logprobs = sample(scores, self.params,
                                  noise=row_noise(self.row_seeds.to(scores.device), t, scores.shape[-1]))
        self.logprobs.append(logprobs.float())
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens[:, None], 0.0)


# transformers >= 5.23 names a model's KV cache argument `cache` (`past_key_values` deprecated, a warning per call)
CACHE_KWARG = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


def shared_prompt_cache(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """A KV cache of every row's prompt but its last token, each distinct prompt computed once and
    gathered for the rows that repeat it (n samples per prompt), which `generate` continues from: the
    prefill then runs U distinct prompts instead of B rows, the same values up to rounding. None when
    no two rows share a prompt, the prompt is one token, or the model returns no cache."""
    groups = prompt_groups(prompt_ids, prompt_mask) if prompt_ids.shape[1] > 1 and prompt_ids.shape[0] > 1 else None
    if groups is None:
        return None
    first, inverse = groups
    ids, mask = prompt_ids[first, :-1], prompt_mask[first, :-1]
    base = hf_base_model(model)
    backbone = getattr(base, base.base_model_prefix, None)  # no LM head: the prefill's logits are not needed
    out = (backbone or model)(input_ids=ids, attention_mask=mask,
                              position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0), use_cache=True)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return None
    cache.batch_select_indices(inverse)
    return cache


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
    row_seeds: torch.Tensor | None = None,
) -> Generated:
    """Generate from LEFT-padded prompts with `model.generate` (KV cache). Randomness: torch's RNG, or
    with `row_seeds` [B] per-row streams (`RowStreamSampler`)."""
    from transformers import GenerationConfig, LogitsProcessorList

    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    streams = row_seeds is not None and not params.greedy
    if row_seeds is not None and row_seeds.shape != prompt_ids.shape[:1]:
        raise ValueError(f"row_seeds must have one seed per prompt row: shape ({prompt_ids.shape[0]},), "
                         f"got {tuple(row_seeds.shape)}")
    pick = params.greedy or streams  # the processor samples; generate takes its one finite token
    sampling = {} if pick else dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    gen_cfg = GenerationConfig(
        max_new_tokens=_max_new_tokens(params),
        do_sample=not pick,
        eos_token_id=eos_ids,
        pad_token_id=pad_token_id,
        output_scores=return_logprobs,  # the processed scores: / temperature, top-k/top-p at -inf
        return_dict_in_generate=True,
        **sampling,
    )
    if pick:
        gen_cfg.top_k, gen_cfg.top_p, gen_cfg.temperature = None, None, None
    stream = RowStreamSampler(row_seeds, params, prompt_ids.shape[1]) if streams else None
    processors = LogitsProcessorList([stream] if streams else [])
    was_training = model.training
    model.eval()
    try:
        cache = shared_prompt_cache(model, prompt_ids, prompt_mask)
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen_cfg,
                             logits_processor=processors, **({} if cache is None else {CACHE_KWARG: cache}))
    finally:
        model.train(was_training)
    P = prompt_ids.shape[1]
    seqs = out.sequences
    resp_mask = response_mask_from_eos(seqs[:, P:], eos_ids)
    logprobs = None
    if return_logprobs and stream is not None:  # per-row streams: the sampler's own, step by step
        logprobs = torch.stack(stream.logprobs, dim=1)[:, : seqs.shape[1] - P]
        logprobs = torch.where(resp_mask.bool(), logprobs, 0.0)
    elif return_logprobs:
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
    resumes = False  # a multi-turn episode's next turn is prefilled whole (see InjectedGenerator.resumes)

    def __init__(self, module: nn.Module):
        self.module = module

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams, *,
                 eos_token_id: int | list[int], pad_token_id: int, return_logprobs: bool = False,
                 row_seeds: torch.Tensor | None = None) -> Generated:
        return hf_generate(self.module, prompt_ids, prompt_mask, params, eos_token_id=eos_token_id,
                           pad_token_id=pad_token_id, return_logprobs=return_logprobs, row_seeds=row_seeds)


class InjectedGenerator:
    """The injected path: `engine.inference.InferenceModel` (fused weights, static KV cache, CUDA
    graphs on CUDA), same interface and output layout as `HFGenerator`."""

    name = "injected"
    # generate(resume=...) continues rows whose earlier tokens are in the KV cache (engine.inference.Resume):
    # a multi-turn episode's next turn feeds only its new tokens
    resumes = True

    def __init__(self, model, compact_finished: bool = True):
        self.model = model
        self.compact_finished = compact_finished  # engine.compact_finished: decode only the running rows

    def reserve(self, batch_size: int, tokens: int) -> None:
        """Size the KV cache for `batch_size` rows of `tokens` (prompt and every later turn) before a first call
        that later calls resume: a resumed call may not grow it."""
        from .inference import cache_slots

        self.model.setup_cache(batch_size, cache_slots(tokens))

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams, *,
                 eos_token_id: int | list[int], pad_token_id: int, return_logprobs: bool = False,
                 row_seeds: torch.Tensor | None = None, resume=None) -> Generated:
        from .inference import generate

        out = generate(self.model, prompt_ids, prompt_mask, _max_new_tokens(params), eos_token_id=eos_token_id,
                       pad_token_id=pad_token_id, sampling=params, return_logprobs=return_logprobs,
                       row_seeds=row_seeds, resume=resume, compact_finished=self.compact_finished)
        resp_mask = out.response_mask.long()
        logprobs = out.logprobs.float() * resp_mask if return_logprobs else None
        return Generated(sequences=out.sequences, attention_mask=out.attention_mask.long(), response_mask=resp_mask,
                         prompt_len=prompt_ids.shape[1], logprobs=logprobs)


class BatchInvariantGenerator:
    """`engine.deterministic`: a generator (`HFGenerator` / `InjectedGenerator`) run so that a row's
    tokens and log-probs are the same whatever else shares its batch, its position there, or how many
    rows there are. Three things make a row's computation independent of the batch:

    - the sampling draws: per-row streams (`row_seeds`, the caller's; without them, drawn from torch's
      RNG: reproducible, but then a row's stream depends on its position);
    - the matmuls: CPU GEMM and cuBLAS pick their kernel (and its reduction order) by the number of
      rows, so every forward runs exactly `rows` rows: the batch is cut into chunks of `rows`, the last
      one filled with copies of its last row (their outputs dropped). Measured on this repository's
      2-core CPU (fp32, the tiny Llama): a decode step's logits at batch 1, 2 or 7 differ in the last
      bits from the same row's at batch 64, while within a fixed batch size a row's result does not
      depend on its position or neighbours;
    - attention: SDPA's fused CPU kernel (and flash-decoding's split heuristics on CUDA) split the work
      by batch x heads over the threads, which changed a row's result in the last bits with the batch
      (2 threads); the math backend (`SDPBackend.MATH`: matmul, softmax, matmul) does not, so it is
      forced here. One pad column is put in front of every prompt, so every chunk has padding and
      `transformers` never switches to its no-mask path for a chunk of full-width prompts.

    The prompt width is the caller's to fix (left padding to a constant width: the rlhf stages pad to
    their data's longest prompt): attention reduces over every slot, masked ones included, so a wider
    padding can change a row's logits in the last bits. Output: as the inner generator's, with the
    prompt columns as given; the response width is the longest chunk's.
    """

    resumes = False  # its chunks of `rows` rows run through the inner generator one after another

    def __init__(self, inner, rows: int):
        if rows < 1:
            raise ValueError(f"engine.deterministic_rows must be >= 1, got {rows}")
        self.inner, self.rows, self.name = inner, rows, inner.name

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams, *,
                 eos_token_id: int | list[int], pad_token_id: int, return_logprobs: bool = False,
                 row_seeds: torch.Tensor | None = None) -> Generated:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import pad

        B, P = prompt_ids.shape
        if row_seeds is None and not params.greedy:
            row_seeds = torch.randint(0, 2**62, (B,))
        ids, mask = pad(prompt_ids, (1, 0), value=pad_token_id), pad(prompt_mask, (1, 0), value=0)
        n = -(-B // self.rows) * self.rows
        take = torch.cat([torch.arange(B), torch.full((n - B,), B - 1)])  # [n]: rows, then copies of the last
        parts: list[Generated] = []
        with sdpa_kernel(SDPBackend.MATH):
            for s in range(0, n, self.rows):
                rows = take[s : s + self.rows]
                parts.append(self.inner.generate(
                    ids[rows.to(ids.device)], mask[rows.to(mask.device)], params, eos_token_id=eos_token_id,
                    pad_token_id=pad_token_id, return_logprobs=return_logprobs,
                    row_seeds=None if row_seeds is None else row_seeds[rows.to(row_seeds.device)]))
        T = max(g.responses.shape[1] for g in parts)

        def cat(tensors: list[torch.Tensor], value) -> torch.Tensor:  # [n, T]: each chunk right-padded to T
            return torch.cat([pad(t, (0, T - t.shape[1]), value=value) for t in tensors])[:B]

        responses = cat([g.responses for g in parts], pad_token_id)
        response_mask = cat([g.response_mask for g in parts], 0)
        logprobs = cat([g.logprobs for g in parts], 0.0) if return_logprobs else None
        dev = responses.device
        return Generated(sequences=torch.cat([prompt_ids.to(dev), responses], 1),
                         attention_mask=torch.cat([prompt_mask.to(dev).long(), response_mask.long()], 1),
                         response_mask=response_mask, prompt_len=P, logprobs=logprobs)
