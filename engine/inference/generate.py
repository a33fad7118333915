"""Batched generation on an `InferenceModel`: one prefill, then a static-shape decode step per token.

    prefill   forward(prompt [B, P], slots 0..P-1, per-row positions, valid = prompt mask); rows that
              repeat a prompt (n samples of it) prefill it once, its cache rows then copied to theirs
              -> sample token 0 from the last column (every row ends in a real token: left padding)
    decode    `decode_step`: forward(token [B, 1], slot [1], position [B, 1]) -> sample -> pad for rows
              already finished -> done |= EOS -> advance slot and positions. All state lives in
              device tensors, so the step has fixed shapes and no host sync; on CUDA it is captured
              once per (batch size, sampling settings) in a CUDA graph and replayed per token
              (reference figures for a 1.2B Llama on an H100: a plain static-cache decoder takes
              15-19 ms/step eager and 2.3-2.9 ms graphed; launch overhead dominates eager decode).
    stop      a row stops at its own EOS (kept, and counted in response_mask); later columns are pad.
              The host reads how many rows are still running every `check_every` steps: on CUDA that
              read is the only sync in the loop, so it is taken every 8 steps (at most 7 wasted, all-pad
              steps, trimmed from the output); on CPU a read costs nothing and is taken every step.
    compact   at that read, when the running rows fit a batch at least COMPACT_FRACTION smaller
              (`compact_size`), they are moved to the cache's front rows (finished rows swapped behind
              them, never overwritten) with their step state (fed token, positions, done, row seeds),
              and the next steps decode only that many rows; each step's outputs are scattered to
              their rows' places. Off CUDA the new batch is the running rows exactly; with CUDA graphs
              it is a bucket (8, 12, 16, 24, 32, 48, ...: 2^k and 3 x 2^(k-1), padded with finished rows)
              so a call captures at most ~2 log2(B) graphs, each once per model. The cache's row order
              is then a permutation of the call's: `KVCache.rows` records it for the next `Resume`.

Randomness: eager sampling draws from `generator` (or the global RNG). A graph samples with its
own registered generator, reseeded per call from `generator` (or the global RNG), so graphed runs
are reproducible per seed but are a different stream from eager runs. With `row_seeds` [B] (per-row
streams, `engine.deterministic`) no generator is read: row b's token t is drawn with
`row_noise(row_seeds, t, V)[b]`, computed inside the step (and inside the graph, from the state's
`row_seeds` and `step` tensors), so eager, graphed and `transformers` runs draw the same tokens.
Compaction keeps that: a row's seed and step move with it. What it changes is the batch size a row's
later logits are computed at (GEMM rounding may depend on it: tests/test_compaction.py measures the gap),
and, without row seeds, how the one generator's stream is split between rows (same distribution, other
draws).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .sampling import SamplingParams, row_noise, sample

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .model import InferenceModel

CACHE_SLOTS = 32  # generate() rounds the KV cache's length up to a multiple of this
# Compact the batch when the running rows fit one at least this much smaller: a call of 64 rows compacts at
# most ~14 times (64 -> <=48 -> <=36 -> ... -> 1; CUDA buckets: 64 -> 48 -> 32 -> ... -> 8, 6 times), each
# a copy of the moved rows' cache so far (at most the batch's), about what one decode step reads anyway.
COMPACT_FRACTION = 0.25
MIN_BUCKET = 8  # with CUDA graphs: no batch below 8 rows (a graph per size; below 8 a step costs about the same)


def cache_slots(tokens: int) -> int:
    """The KV cache length `generate` allocates for prompt + new tokens: rounded up to CACHE_SLOTS, so
    phases whose prompts are a few tokens wider than before (left padding to the batch's longest)
    reuse the cache, and its CUDA graphs, instead of reallocating (the memory plan uses it too)."""
    return -(-tokens // CACHE_SLOTS) * CACHE_SLOTS


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # [B, P + T'] prompt (left-padded) then response (pad after EOS)
    attention_mask: torch.Tensor  # [B, P + T'] prompt_mask then response_mask
    response_mask: torch.Tensor  # [B, T'] 1 for generated tokens up to and including EOS
    logprobs: torch.Tensor | None  # [B, T'] the sampler's log-prob of the token (SamplingParams); 0 off-mask


@dataclass
class Resume:
    """Continue rows already in the KV cache (a multi-turn episode's next turn) instead of prefilling them again:
    the call's ids [B', W] (left-padded) are the rows' new tokens only, written from cache slot `slot` on.

    rows [B']: the cache rows to continue, in the call's row order (the others are dropped from the cache's
    front rows: episodes that ended). slot: the first slot not yet written (the previous call's prompt width +
    its response columns - 1: a response's last token is sampled, never fed, so it belongs in these ids).
    positions [B']: each row's position of its first real new token (its real tokens so far). stale [B']: the
    first slot of each row that is not part of its sequence any more (response tokens cut after the previous
    call, or fed after its EOS); slots from it to `slot` are never attended again."""

    rows: torch.Tensor
    slot: int
    positions: torch.Tensor
    stale: torch.Tensor


@dataclass
class DecodeState:
    """The device tensors one decode step reads and updates in place (static addresses for graphs)."""

    tokens: torch.Tensor  # [B, 1] the token fed to this step
    input_pos: torch.Tensor  # [1] its cache slot
    position_ids: torch.Tensor  # [B, 1] its per-row position
    done: torch.Tensor  # [B] bool: the row has emitted EOS
    eos: torch.Tensor  # [n_eos] int64
    out_tokens: torch.Tensor  # [B] the step's token (pad where the row was already done)
    out_logprobs: torch.Tensor  # [B]
    out_active: torch.Tensor  # [B] bool: the row was still running at this step
    step: torch.Tensor  # [1] the response token this step draws (0 = the prefill's)
    row_seeds: torch.Tensor | None = None  # [B] int64: per-row sampling streams (None: the generator)

    @classmethod
    def empty(cls, batch_size: int, eos: torch.Tensor, seeded: bool = False) -> DecodeState:
        dev = eos.device
        long = {"dtype": torch.long, "device": dev}
        return cls(
            tokens=torch.zeros(batch_size, 1, **long),
            input_pos=torch.zeros(1, **long),
            position_ids=torch.zeros(batch_size, 1, **long),
            done=torch.zeros(batch_size, dtype=torch.bool, device=dev),
            eos=eos,
            out_tokens=torch.zeros(batch_size, **long),
            out_logprobs=torch.zeros(batch_size, device=dev),
            out_active=torch.zeros(batch_size, dtype=torch.bool, device=dev),
            step=torch.zeros(1, **long),
            row_seeds=torch.zeros(batch_size, **long) if seeded else None,
        )


def batch_bucket(n: int) -> int:
    """The smallest of 8, 12, 16, 24, 32, 48, 64, ... (2^k and 3 x 2^(k-1), from MIN_BUCKET) that holds n rows."""
    size = MIN_BUCKET
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3  # 8 -> 12 -> 16 -> 24 -> 32 ...
    return size


def compact_size(live: int, batch: int, bucketed: bool) -> int:
    """The batch to continue `live` running rows of a `batch`-row batch in: `live` (or its `batch_bucket`
    when `bucketed`, the CUDA-graph case) if that is at least COMPACT_FRACTION smaller, else `batch`."""
    size = batch_bucket(live) if bucketed else live
    return size if 0 < size <= (1 - COMPACT_FRACTION) * batch else batch


def compact(model: InferenceModel, st: DecodeState, new: DecodeState, order: torch.Tensor, slots: int) -> None:
    """Continue the running rows of `st` (a batch of b rows, the cache's rows [0, b)) in `new`, a batch of
    n < b rows: the running rows, then finished ones up to n, become the cache's rows [0, n) and `new`'s
    rows. Rows already in front stay; each kept row behind swaps places with a dropped row in front, so
    only those move and every row's cache (slots [0, `slots`), the ones written) is kept, for a `Resume`.
    `order` [>= b]: the call's row held by each cache row, permuted in place alike."""
    b, n = st.done.shape[0], new.done.shape[0]
    dev = st.done.device
    keep = ~st.done
    fill = n - int(keep.sum())  # finished rows that pad the batch to its bucket (0 off CUDA)
    keep |= st.done & (st.done.cumsum(0) <= fill)
    front = torch.arange(b, device=dev) < n
    behind, holes = (keep & ~front).nonzero()[:, 0], (~keep & front).nonzero()[:, 0]
    perm = torch.arange(b, device=dev)  # new row i takes old row perm[i]
    perm[holes], perm[behind] = behind, holes
    moved = torch.cat([holes, behind])
    if moved.numel():
        c, src = model.cache, perm[moved]
        for layer in range(c.k.shape[0]):  # a layer at a time: the gathered temporary is one layer's moved rows
            c.k[layer, moved, :, :slots] = c.k[layer, src, :, :slots]
            c.v[layer, moved, :, :slots] = c.v[layer, src, :, :slots]
        c.valid[moved, :slots] = c.valid[src, :slots]
        order[:b] = order[:b][perm]
    rows = perm[:n]
    new.tokens.copy_(st.tokens[rows])
    new.position_ids.copy_(st.position_ids[rows])
    new.done.copy_(st.done[rows])
    new.input_pos.copy_(st.input_pos)
    new.step.copy_(st.step)
    if st.row_seeds is not None:
        new.row_seeds.copy_(st.row_seeds[rows])


def is_eos(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """tokens [B] -> bool [B]; a broadcast compare (no data-dependent path, empty eos = never)."""
    return (tokens[:, None] == eos).any(-1)


def decode_step(
    model: InferenceModel,
    st: DecodeState,
    sampling: SamplingParams,
    pad_token_id: int,
    generator: torch.Generator | None = None,
    kv_len: int | None = None,
) -> None:
    """One token for every row, in place on `st`. Fixed shapes, no host sync (graph-capturable with
    kv_len=None; eager callers pass the live length so attention reads only slots [0, kv_len))."""
    logits = model.forward(st.tokens, st.input_pos, st.position_ids, kv_len=kv_len)[:, -1]
    seeded = st.row_seeds is not None and not sampling.greedy
    noise = row_noise(st.row_seeds, st.step, logits.shape[-1]) if seeded else None
    tokens, logprobs = sample(logits, sampling, generator, noise=noise)
    active = ~st.done
    tokens = torch.where(active, tokens, pad_token_id)
    st.done |= active & is_eos(tokens, st.eos)
    st.out_tokens.copy_(tokens)
    st.out_logprobs.copy_(logprobs.masked_fill(~active, 0.0))
    st.out_active.copy_(active)
    st.tokens.copy_(tokens[:, None])
    st.input_pos.add_(1)
    st.position_ids.add_(1)
    st.step.add_(1)


class DecodeGraph:
    """`decode_step` captured in a CUDA graph for one batch size and sampling setting.

    The graph reads the weights, the cache rows [:B] and `state`, so it stays valid across
    `load_weights` (same storage) and is dropped by the model when the cache is reallocated.
    """

    def __init__(self, model: InferenceModel, state: DecodeState, sampling: SamplingParams, pad_token_id: int,
                 warm_slot: int = 0):
        self.state = state
        self.generator = torch.Generator(device=model.device)

        def step():
            decode_step(model, state, sampling, pad_token_id, self.generator)

        self._step = step  # what the graph holds (kept for the CPU test that fakes torch.cuda)

        # NOTE: warm-up runs on a side stream before capture (cuBLAS / SDPA workspaces, allocator).
        # It advances `state` and writes k/v and valid flags at two cache slots from `warm_slot`: generate()
        # captures before its prefill (slot 0), which rewrites the cache, or, for a compacted batch, from the
        # next slot to decode (no row has written it yet; each is rewritten before it is read), and sets every
        # step input afterwards.
        state.input_pos.fill_(warm_slot)
        # One stream per model for every graph's warm-up and capture: cuBLAS allocates a workspace per (handle,
        # stream) at its first call there and keeps it (32 MiB on Hopper). A new stream per graph, and capture on
        # torch's own capture stream, cost one workspace per graph captured plus one (traced on an H200: 5 x 32 MiB
        # live at a 25M model's GRPO peak, docs/algorithms.md); the warm-up also makes this stream's workspace
        # before capture, so the capture allocates none.
        if model.graph_stream is None:
            model.graph_stream = torch.cuda.Stream()
        side = model.graph_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        if model.graph_pool is None:
            model.graph_pool = torch.cuda.graph_pool_handle()  # shared by all of the model's graphs
        self.graph = torch.cuda.CUDAGraph()
        self.graph.register_generator_state(self.generator)
        with torch.cuda.graph(self.graph, pool=model.graph_pool, stream=side):
            step()

    def seed(self, generator: torch.Generator | None) -> None:
        seed = torch.randint(0, 2**62, (1,), generator=generator, device=generator.device if generator else "cpu")
        self.generator.manual_seed(int(seed))

    def replay(self) -> None:
        self.graph.replay()


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, prompt_len: int | None = None):
    """Rows with equal prompts (the first `prompt_len` columns, default all, ids and mask): (first [U], the
    row that stands for each distinct prompt; inverse [B], each row's), or None when no two rows share one."""
    P = prompt_ids.shape[1] if prompt_len is None else prompt_len
    key = torch.cat([prompt_ids[:, :P], prompt_mask[:, :P].to(prompt_ids.dtype)], 1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    U, B = int(inverse.max()) + 1, prompt_ids.shape[0]
    if U == B:
        return None
    rows = torch.arange(B, device=prompt_ids.device)
    first = torch.full((U,), B, dtype=rows.dtype, device=rows.device).scatter_reduce(0, inverse, rows, "amin")
    return first, inverse


@torch.no_grad()
def generate(
    model: InferenceModel,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int = 0,
    sampling: SamplingParams | None = None,
    generator: torch.Generator | None = None,
    return_logprobs: bool = False,
    check_every: int | None = None,
    row_seeds: torch.Tensor | None = None,
    resume: Resume | None = None,
    compact_finished: bool = True,
) -> GenerationOutput:
    """Sample up to `max_new_tokens` for left-padded prompts [B, P] (mask 1 = real token).

    Stops early once every row has emitted an EOS; T' = steps actually taken (the longest response).
    sampling: SamplingParams (default: temperature 1, no top-k/top-p; its max_new_tokens is not read
    here). check_every: steps between "all done" host reads (default 8 on CUDA, 1 elsewhere).
    row_seeds: [B] int64 >= 0, per-row sampling streams (see the module doc); None = `generator`.
    resume: the prompts are new tokens of rows already in the cache (`Resume`); the cache must hold them
    and the sampled tokens without growing (size it before the first call: `model.setup_cache`). The
    returned sequences hold the new tokens (as the prompt) and the response.
    compact_finished: decode only the running rows once enough have finished (see the module doc).
    """
    sampling = sampling or SamplingParams()
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
    device = model.device
    prompt_ids, mask = prompt_ids.to(device), prompt_mask.to(device).bool()
    B, P = prompt_ids.shape
    if not bool(mask[:, -1].all()):  # one sync per call
        raise ValueError("prompts must be left-padded: the last column of prompt_mask must be all ones")
    a = model.args
    first_pos = 0 if resume is None else int(resume.positions.max())
    if a.arch == "opt" and first_pos + P + max_new_tokens > a.max_positions:
        raise ValueError(f"OPT has {a.max_positions} positions; prompt {first_pos + P} + {max_new_tokens} new tokens "
                         "exceed it")
    if check_every is None:
        check_every = 8 if device.type == "cuda" else 1
    eos_ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
    start = 0 if resume is None else resume.slot
    if resume is not None:  # the cache already holds the rows: it must not be reallocated (that would lose them)
        c = model.cache
        if c is None or c.batch_size < int(resume.rows.numel()) or c.max_seq_len < start + P + max_new_tokens:
            raise ValueError(f"resume: the KV cache cannot continue {B} rows from slot {start} with {P} new and "
                             f"{max_new_tokens} sampled tokens (cache: "
                             f"{'none' if c is None else f'{c.batch_size} rows x {c.max_seq_len} slots'})")
        keep_rows(model, resume.rows.to(device), resume.stale.to(device), start)
    else:
        model.setup_cache(B, cache_slots(P + max_new_tokens))  # (setup_cache keeps the largest batch and length seen)
        model.cache.rows = None  # a fresh call: the cache's rows are its rows, in order
    # Capture (first use) before the prefill: the capture's warm-up steps write cache slots.
    if row_seeds is not None and row_seeds.shape != (B,):
        raise ValueError(f"row_seeds must have one seed per prompt row: shape ({B},), got {tuple(row_seeds.shape)}")
    seeded = row_seeds is not None
    # (resuming: a graph captured now would write its warm-up steps into the kept rows' slots: only one
    # captured before serves, else this call decodes eagerly)
    graph = (_graph_for(model, B, sampling, pad_token_id, eos_ids, eos, seeded, capture=resume is None)
             if max_new_tokens > 1 else None)

    # Prefill. Position = number of real tokens before the token (transformers' cumsum - 1), after the row's
    # earlier tokens when resuming.
    position_ids = (mask.long().cumsum(-1) - 1).clamp_min(0)
    if resume is not None:
        position_ids = position_ids + resume.positions.to(device)[:, None]
    groups = prompt_groups(prompt_ids, mask) if resume is None and B > 1 else None
    if groups is None:
        logits = model.forward(prompt_ids, torch.arange(start, start + P, device=device), position_ids, mask,
                               kv_len=start + P, last_only=True)
    else:  # rows that repeat a prompt (n samples each): each distinct prompt prefilled once, into the
        # cache's first rows, then gathered to every row that has it (the same values: `prompt_groups`)
        rows, inverse = groups
        logits = model.forward(prompt_ids[rows], torch.arange(P, device=device), position_ids[rows], mask[rows],
                               kv_len=P, last_only=True)[inverse]
        c = model.cache
        c.k[:, :B, :, :P] = c.k[:, inverse, :, :P]
        c.v[:, :B, :, :P] = c.v[:, inverse, :, :P]
        c.valid[:B, :P] = c.valid[inverse, :P]
    noise = row_noise(row_seeds.to(device), 0, logits.shape[-1]) if seeded and not sampling.greedy else None
    first, first_lp = sample(logits[:, -1], sampling, generator, noise=noise)

    out_tokens = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    out_logprobs = torch.zeros(B, max_new_tokens, device=device)
    out_active = torch.zeros(B, max_new_tokens, dtype=torch.bool, device=device)
    out_tokens[:, 0], out_logprobs[:, 0], out_active[:, 0] = first, first_lp, True

    st = graph.state if graph is not None else DecodeState.empty(B, eos, seeded)
    st.tokens.copy_(first[:, None])
    st.input_pos.fill_(start + P)
    st.position_ids.copy_(position_ids[:, -1:] + 1)  # every row's last prompt column is real
    st.done.copy_(is_eos(first, eos))
    st.step.fill_(1)
    if seeded:
        st.row_seeds.copy_(row_seeds)
    if graph is not None and not seeded and not sampling.greedy:  # seeded: the graph computes its noise, its
        # generator is unused; greedy draws nothing (and must not take a number from the caller's RNG)
        graph.seed(generator)

    b = B  # the rows decoded: the cache's rows [0, b), holding the call's rows order[:b]
    order = torch.arange(B, device=device)
    bucketed = graphs_enabled(model)
    for t in range(1, max_new_tokens):
        if t % check_every == 0:
            live = b - int(st.done.sum())  # the loop's one host read
            if live == 0:
                break
            size = compact_size(live, b, bucketed) if compact_finished else b
            if size < b:  # the fed token goes to slot start + P + t - 1: slots before it are written
                cur = start + P + t - 1
                graph = _graph_for(model, size, sampling, pad_token_id, eos_ids, eos, seeded,
                                   capture=cur + 3 <= model.cache.max_seq_len, warm_slot=cur)
                new = graph.state if graph is not None else DecodeState.empty(size, eos, seeded)
                compact(model, st, new, order, cur)
                if graph is not None and not seeded and not sampling.greedy:
                    graph.seed(generator)
                st, b = new, size
        if graph is not None:
            graph.replay()
        else:  # the fed token sits in slot start + P + t - 1: attend slots [0, start + P + t)
            decode_step(model, st, sampling, pad_token_id, generator, kv_len=start + P + t)
        if b == B:
            out_tokens[:, t], out_logprobs[:, t], out_active[:, t] = st.out_tokens, st.out_logprobs, st.out_active
        else:  # each decoded row's outputs to its place; the others keep pad / 0 / False (finished rows' own)
            rows = order[:b]
            out_tokens[:, t].index_copy_(0, rows, st.out_tokens)
            out_logprobs[:, t].index_copy_(0, rows, st.out_logprobs)
            out_active[:, t].index_copy_(0, rows, st.out_active)
    if b < B:  # where each of the call's rows now is in the cache, for a `Resume` (keep_rows reads it)
        model.cache.rows = torch.empty_like(order).scatter_(0, order, torch.arange(B, device=device))

    # A row's active columns are a prefix, so the columns with any active row are one too.
    n = int(out_active.any(0).sum())
    response_mask = out_active[:, :n].to(prompt_mask.dtype)
    return GenerationOutput(
        sequences=torch.cat([prompt_ids, out_tokens[:, :n]], dim=1),
        attention_mask=torch.cat([prompt_mask.to(device), response_mask], dim=1),
        response_mask=response_mask,
        logprobs=out_logprobs[:, :n] if return_logprobs else None,
    )


def keep_rows(model: InferenceModel, rows: torch.Tensor, stale: torch.Tensor, slot: int) -> None:
    """The previous call's rows `rows` [n] become the cache's rows [0, n) (in that order), and each kept row's
    slots from stale[i] to `slot` are marked invalid (never attended). Copies within the cache's storage: captured
    graphs stay valid."""
    c, n = model.cache, int(rows.numel())
    if c.rows is not None:  # the previous call compacted its batch: its row i sits in cache row c.rows[i]
        rows, c.rows = c.rows[rows], None
    c.k[:, :n] = c.k[:, rows]
    c.v[:, :n] = c.v[:, rows]
    c.valid[:n] = c.valid[rows]
    c.valid[:n, :slot] &= c.slots[:slot] < stale[:, None]


def graphs_enabled(model: InferenceModel) -> bool:
    return model.use_cuda_graphs and model.device.type == "cuda"


def _graph_for(model, B, sampling, pad_token_id, eos_ids, eos, seeded=False, capture=True,
               warm_slot=0) -> DecodeGraph | None:
    """The captured decode step for this batch size and setting (capturing it on first use when `capture`, its
    warm-up writing cache slots from `warm_slot`), or None off CUDA / when disabled / not captured / when its
    capture failed (logged once; decoded eagerly)."""
    if not graphs_enabled(model):
        return None
    draw = sampling.draw_settings()
    key = (B, draw, pad_token_id, tuple(eos_ids), seeded)
    if key not in model.graphs and not capture:
        return None
    if key not in model.graphs:
        try:
            model.graphs[key] = DecodeGraph(model, DecodeState.empty(B, eos, seeded), draw, pad_token_id, warm_slot)
        except RuntimeError as e:  # torch.AcceleratorError is one: a capture the driver invalidated, say
            # Decoding eagerly gives the same tokens, only slower: this setting is not captured again
            # (None), and the reason is logged once per setting.
            model.graphs[key] = None
            logger.warning("generation: capturing the decode step in a CUDA graph failed (batch %d, %s): %s; this "
                           "setting decodes eagerly", B, "seeded rows" if seeded else "one generator",
                           str(e).splitlines()[0] if str(e) else type(e).__name__)
    return model.graphs[key]
