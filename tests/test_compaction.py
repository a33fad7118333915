"""Finished rows stop costing compute: the injected decoder's batch compaction (engine/inference/generate.py).

Against the same calls with `compact_finished=False` (every row decoded to the end): the same tokens, masks
and EOS positions, and log-probs to a tolerance. The tolerance is the GEMM's: on CPU a row's logits computed in
a batch of another size differ in the last bits (fp32 `F.linear` at 1 row vs 13 rows differs by ~5e-6 on this
machine's AMD EPYC); measured here, a compacted run's sampler log-probs stay within 1.5e-6 of the full batch's,
asserted at 1e-5. Where no compaction happens (no row finishes, or all at once) the runs are bit-equal.
That compaction happens is checked on the forwards' batch sizes (a hook on the model's forward).
"""
from __future__ import annotations

import importlib

import pytest
import torch
from test_inference import fake_cuda_graphs, hf_model, injected, llama_untied_gqa, opt_pre_ln

from engine.config import EngineConfig
from engine.inference import Resume, SamplingParams, generate
from engine.inference.generate import COMPACT_FRACTION, MIN_BUCKET, batch_bucket, compact_size

gen = importlib.import_module("engine.inference.generate")  # the module (the package's `generate` is the function)

V, PAD, P, NEW = 97, 0, 7, 40
GREEDY = SamplingParams(greedy=True)
SAMPLED = SamplingParams(temperature=1.0)
FILTERED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
TOL = 1e-5  # sampler log-probs, compacted vs full batch (measured <= 1.5e-6: GEMM rounding by batch size)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: the tiny models on one intra-op thread


def prompts(B: int, seed: int = 1):
    """B left-padded prompts of P columns (0-3 pads each)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V - 1, (B, P), generator=g)
    mask = torch.ones_like(ids)
    for r in range(B):
        ids[r, : r % 4], mask[r, : r % 4] = PAD, 0
    return ids, mask


class Batches:
    """Records the batch size of every forward of `model` (prefill and decode)."""

    def __init__(self, model, monkeypatch):
        self.seen: list[int] = []
        forward = model.forward
        monkeypatch.setattr(model, "forward", lambda t, *a, **k: self.seen.append(t.shape[0]) or forward(t, *a, **k))


def planted_eos(model, ids, mask, params, seeds, steps):
    """EOS ids that end row r near response step steps[r]: the token a free run (no EOS) draws there (a row
    ends at the first EOS id it draws, which may come earlier)."""
    free = generate(model, ids, mask, NEW, pad_token_id=PAD, sampling=params, row_seeds=seeds).sequences[:, P:]
    return sorted({int(free[r, t]) for r, t in enumerate(steps) if t is not None})


def both(model, ids, mask, params, seeds, eos, monkeypatch, **kw):
    """{compact: (output, forward batch sizes)} for the same call with and without compaction."""
    runs = {}
    for compact in (True, False):
        hook = Batches(model, monkeypatch)
        out = generate(model, ids, mask, NEW, eos_token_id=eos, pad_token_id=PAD, sampling=params, row_seeds=seeds,
                       return_logprobs=True, compact_finished=compact, **kw)
        runs[compact] = (out, hook.seen)
        monkeypatch.undo()  # (only the hook: fake CUDA graphs are set up again by the caller if needed)
    return runs


def assert_same(a, b, exact: bool = False):
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.response_mask, b.response_mask) and torch.equal(a.attention_mask, b.attention_mask)
    gap = (a.logprobs - b.logprobs).abs().max().item()
    assert (gap == 0.0) if exact else gap < TOL, gap


# ---------------------------------------------------------------- the sizes


def test_buckets_and_when_to_compact():
    assert [batch_bucket(n) for n in (1, 8, 9, 12, 13, 17, 25, 33, 49, 65, 100)] == \
        [8, 8, 12, 12, 16, 24, 32, 48, 64, 96, 128]
    # every bucket is 2^k or 3 x 2^(k-1): at most ~2 log2(B) sizes, so as many CUDA graphs, up to 1024 rows
    sizes = {batch_bucket(n) for n in range(1, 1025)}
    assert sorted(sizes) == [8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert MIN_BUCKET == 8 and COMPACT_FRACTION == 0.25
    # exact sizes (CPU): compact once the running rows fit a batch a quarter smaller
    assert compact_size(48, 64, False) == 48 and compact_size(49, 64, False) == 64
    assert compact_size(1, 13, False) == 1 and compact_size(10, 13, False) == 13 and compact_size(9, 13, False) == 9
    # buckets (CUDA graphs): the bucket must be a quarter smaller; never below 8 rows
    assert compact_size(33, 64, True) == 48 and compact_size(40, 64, True) == 48 and compact_size(49, 64, True) == 64
    assert compact_size(12, 20, True) == 12 and compact_size(13, 20, True) == 20
    assert compact_size(1, 8, True) == 8 and compact_size(3, 12, True) == 8
    assert compact_size(0, 64, False) == 64  # nothing running: the loop ends instead


# ---------------------------------------------------------------- equal outputs, fewer rows computed


@pytest.mark.parametrize("factory", [llama_untied_gqa, opt_pre_ln])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED, FILTERED], ids=["greedy", "sampled", "top-k-top-p"])
def test_compaction_gives_the_full_batchs_tokens(factory, params, monkeypatch):
    """13 rows (odd) ending at planted steps from 3 to 35, one never: the compacted call gives the full
    batch's tokens, masks and EOS positions (log-probs within TOL), while its decode forwards shrink
    several times, each time to the rows still running."""
    model = injected(hf_model(factory))
    B = 13
    ids, mask = prompts(B)
    seeds = None if params.greedy else torch.arange(B) * 7 + 5
    eos = planted_eos(model, ids, mask, params, seeds, [3, 5, 8, 9, 12, 15, 18, 20, 22, 25, 28, 31, None])
    runs = both(model, ids, mask, params, seeds, eos, monkeypatch)
    (got, seen), (ref, full) = runs[True], runs[False]
    assert_same(got, ref)
    lengths = ref.response_mask.sum(1)
    assert len(set(lengths.tolist())) >= 6, lengths  # the planted spread (first EOS draws)
    assert set(full) == {B}
    decode = seen[1:]  # after the prefill
    sizes = sorted(set(decode), reverse=True)
    assert len(sizes) >= 4 and min(sizes) < B // 4, sizes  # compacted several times
    assert decode == sorted(decode, reverse=True)  # only ever shrinks
    # each step decodes no more than a quarter-short batch of its running rows: fewer row-steps than the full
    # batch's, and at least the running rows' own (the responses' tokens, less the prefill's first)
    assert sum(decode) < 0.7 * sum(full[1:]) and sum(decode) >= int(lengths.sum()) - B


def test_shared_prompts_n_samples_each(monkeypatch):
    """4 prompts x 3 samples (the rows of a GRPO group share a prefilled prompt), per-row seeds: compacting
    the rows gives the uncompacted call's tokens; the prefill still runs the 4 distinct prompts once."""
    model = injected(hf_model(llama_untied_gqa))
    ids, mask = prompts(4)
    order = torch.tensor([0, 1, 2, 3]).repeat_interleave(3)
    ids, mask = ids[order], mask[order]
    seeds = torch.arange(12) * 13 + 1
    eos = planted_eos(model, ids, mask, SAMPLED, seeds, [2, 4, 6, 9, 11, 14, 17, 20, 24, 27, 30, None])
    runs = both(model, ids, mask, SAMPLED, seeds, eos, monkeypatch)
    (got, seen), (ref, _) = runs[True], runs[False]
    assert_same(got, ref)
    assert seen[0] == 4 and len(set(seen[1:])) >= 3 and min(seen[1:]) < 12, seen


def test_all_rows_ending_together_or_none_ending_change_nothing(monkeypatch):
    """No compaction happens when every row ends at the same step (6 copies of a row: the loop ends) or when
    none ends (the budget stops them): the calls are bit-equal to the uncompacted ones."""
    model = injected(hf_model(llama_untied_gqa))
    ids, mask = prompts(1)
    ids, mask, seeds = ids.repeat(6, 1), mask.repeat(6, 1), torch.full((6,), 11)
    eos = planted_eos(model, ids, mask, SAMPLED, seeds, [9] * 6)
    runs = both(model, ids, mask, SAMPLED, seeds, eos, monkeypatch)
    assert_same(runs[True][0], runs[False][0], exact=True)
    assert set(runs[True][1][1:]) == {6} and runs[True][0].response_mask.shape[1] < NEW
    ids, mask = prompts(9)
    runs = both(model, ids, mask, GREEDY, None, None, monkeypatch)
    assert_same(runs[True][0], runs[False][0], exact=True)
    assert set(runs[True][1]) == {9} and runs[True][0].response_mask.shape[1] == NEW
    assert model.cache.rows is None  # the cache's rows are the call's, in order


def test_compaction_with_cuda_graph_buckets(monkeypatch):
    """With CUDA graphs (torch.cuda faked on CPU, as in test_inference), the compacted batch is a bucket
    (20 rows -> 12 -> 8, the missing rows finished ones) and each bucket's graph is captured once, mid-call,
    without disturbing the running rows' cache: the tokens are the eager, uncompacted call's. The running
    rows are read every 8 steps, as on CUDA."""
    model = injected(hf_model(llama_untied_gqa))
    B = 20
    ids, mask = prompts(B, seed=2)
    seeds = torch.arange(B) * 3 + 2
    eos = planted_eos(model, ids, mask, SAMPLED, seeds, [10, 15, 20] + [None] * 17)  # 3 EOS ids: rows end at 3-40
    ref = generate(model, ids, mask, NEW, eos_token_id=eos, pad_token_id=PAD, sampling=SAMPLED, row_seeds=seeds,
                   return_logprobs=True, compact_finished=False)
    captured_on = fake_cuda_graphs(monkeypatch, gen)
    hook = Batches(model, monkeypatch)
    for _ in range(2):  # the second call replays the graphs the first captured
        hook.seen.clear()
        got = generate(model, ids, mask, NEW, eos_token_id=eos, pad_token_id=PAD, sampling=SAMPLED, row_seeds=seeds,
                       return_logprobs=True, check_every=8)
        assert_same(got, ref)
        assert sorted({k[0] for k in model.graphs}) == [8, 12, 20]
    # three captures, all on the model's one stream (a stream each cost a cuBLAS workspace each: 32 MiB on Hopper)
    assert len(captured_on) == 3 and model.graph_stream is not None
    assert all(s is model.graph_stream for s in captured_on)
    # the second call: the prefill, then replays only; sizes change at the reads (every 8 steps): 20 rows until
    # step 16 (4 of them ended by step 8: 16 running, no bucket a quarter smaller), 12 until 32, then 8
    assert hook.seen == [B] + [20] * 15 + [12] * 16 + [8] * (len(hook.seen) - 32), hook.seen


def test_a_resumed_call_after_a_compacted_one(monkeypatch):
    """A multi-turn episode's next turn (`Resume`) after a call that compacted its batch: the cache's rows are
    a permutation of the call's, recorded in `cache.rows`, which the resumed call reads. Its tokens are those
    of the same two calls without compaction."""
    B = 10
    ids, mask = prompts(B, seed=3)
    seeds = torch.arange(B) * 5 + 1
    outs = {}
    for compact in (True, False):
        model = injected(hf_model(llama_untied_gqa))
        model.setup_cache(B, 128)
        eos = planted_eos(model, ids, mask, SAMPLED, seeds, [2, 3, 5, 6, 8, 10, 13, 16, 20, None])
        first = generate(model, ids, mask, NEW, eos_token_id=eos, pad_token_id=PAD, sampling=SAMPLED,
                         row_seeds=seeds, return_logprobs=True, compact_finished=compact)
        assert (model.cache.rows is not None) == compact
        if compact:  # a permutation, and not the identity
            assert sorted(model.cache.rows.tolist()) == list(range(B)) and model.cache.rows.tolist() != list(range(B))
        lengths, T = first.response_mask.sum(1), first.response_mask.shape[1]
        keep = torch.tensor([7, 1, 4, 0, 9])  # the episodes still open, in the next call's order
        resp = first.sequences[:, P:]
        g = torch.Generator().manual_seed(4)
        obs = torch.randint(2, V - 1, (len(keep), 4), generator=g)  # each: its last sampled token, then 3 new
        obs[:, 0] = resp[keep, lengths[keep] - 1]
        new_mask = torch.ones_like(obs)
        obs[1, :2], new_mask[1, :2] = PAD, 0  # a shorter observation (left-padded)
        resume = Resume(rows=keep, slot=P + T - 1, positions=mask.sum(1)[keep] + lengths[keep] - 1,
                        stale=P + lengths[keep] - 1)
        second = generate(model, obs, new_mask, 12, eos_token_id=eos, pad_token_id=PAD, sampling=SAMPLED,
                          row_seeds=seeds[keep] + 1, return_logprobs=True, resume=resume, compact_finished=compact)
        outs[compact] = (first, second)
    for a, b in zip(outs[True], outs[False]):
        assert_same(a, b)


def test_the_engine_switch(monkeypatch):
    """engine.compact_finished: a bool (validated, naming the key); InjectedGenerator passes it to generate."""
    from engine.config import validate_engine_config
    from engine.distributed import init_distributed
    from engine.generation import InjectedGenerator

    assert EngineConfig().compact_finished is True
    with pytest.raises(ValueError, match=r"^engine.compact_finished must be true or false, got 'yes'$"):
        validate_engine_config(EngineConfig(compact_finished="yes"), init_distributed())
    model = injected(hf_model(llama_untied_gqa))
    ids, mask = prompts(8)
    eos = planted_eos(model, ids, mask, GREEDY, None, [2, 3, 4, 5, 6, 8, 10, None])
    sizes = {}
    for compact in (True, False):
        hook = Batches(model, monkeypatch)
        InjectedGenerator(model, compact).generate(ids, mask, SamplingParams(max_new_tokens=NEW, greedy=True),
                                                   eos_token_id=eos, pad_token_id=PAD)
        sizes[compact] = set(hook.seen)
        monkeypatch.undo()
    assert sizes[False] == {8} and min(sizes[True]) < 4
