"""The injected inference model against `transformers` (CPU, fp32, small random models).

Parity: prefill logits on a ragged left-padded batch, KV-cache decode = prefill, greedy tokens =
`model.generate`, per-row EOS stopping, in-place weight refresh; the sampler against the reference
distribution and transformers' warpers; `supports`. GPU lane (`-m gpu`): CUDA graphs, bf16.
"""
from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from engine.inference import InferenceModel, ModelArgs, SamplingParams, filter_logits, generate, sample, supports

V, PAD, P, NEW = 97, 0, 9, 20
PADS = [0, 3, 6, 1]  # left pads per row: a ragged batch of 4
SMALL = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
LLAMA = dict(SMALL, intermediate_size=96)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: the tiny models on one intra-op thread


def llama_untied_gqa():
    return LlamaForCausalLM, LlamaConfig(**LLAMA, num_key_value_heads=2, tie_word_embeddings=False)


def llama_tied_bias_head_dim():  # q width 4 * 24 != hidden 64; attention and MLP biases
    cfg = LlamaConfig(**LLAMA, tie_word_embeddings=True, head_dim=24, attention_bias=True, mlp_bias=True)
    return LlamaForCausalLM, cfg


def llama3_rope():  # small original length so all three llama3 frequency bands occur at head_dim 16
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=16)
    return LlamaForCausalLM, LlamaConfig(**LLAMA, num_key_value_heads=2, rope_parameters=rope)


def qwen2_bias_sliding():  # q/k/v biases; layer 1 uses a sliding window shorter than the sequences
    cfg = Qwen2Config(**LLAMA, num_key_value_heads=2, use_sliding_window=True, sliding_window=5, max_window_layers=1)
    return Qwen2ForCausalLM, cfg


def mistral_window():
    return MistralForCausalLM, MistralConfig(**LLAMA, num_key_value_heads=1, sliding_window=7)


def opt_pre_ln():
    return OPTForCausalLM, OPTConfig(**SMALL, ffn_dim=96, do_layer_norm_before=True)


def opt_post_ln():
    return OPTForCausalLM, OPTConfig(**SMALL, ffn_dim=96, do_layer_norm_before=False)


def opt_projected():  # word_embed_proj_dim != hidden: project_in / project_out
    return OPTForCausalLM, OPTConfig(**SMALL, ffn_dim=96, word_embed_proj_dim=32)


CONFIGS = [llama_untied_gqa, llama_tied_bias_head_dim, llama3_rope, qwen2_bias_sliding, mistral_window,
           opt_pre_ln, opt_post_ln, opt_projected]


def hf_model(factory, seed: int = 0):
    """A random HF model whose every parameter (norm weights and biases included) is non-trivial,
    so a weight copied into the wrong slot changes the outputs."""
    cls, cfg = factory()
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def ragged_batch(seed: int = 0, length: int = P):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V - 1, (len(PADS), length), generator=g)
    mask = torch.ones_like(ids)
    for row, n in enumerate(PADS):
        ids[row, :n], mask[row, :n] = PAD, 0
    return ids, mask


def positions(mask):
    return (mask.cumsum(-1) - 1).clamp_min(0)


def hf_logits(hf, ids, mask):
    # transformers' plain Llama forward numbers positions 0..S-1 regardless of padding; its generate
    # derives them from the mask, which is what the injected model does: pass those. OPT derives
    # them from the mask inside its own forward, so it is checked without help.
    kw = {} if hf.config.model_type == "opt" else {"position_ids": positions(mask)}
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask, **kw).logits


def injected(hf, **kw):
    return InferenceModel(hf.config, hf.state_dict().items(), **kw)


def rel_err(a, b, keep):
    return ((a - b)[keep].norm() / b[keep].norm()).item()


def hf_greedy(hf, ids, mask, eos, new=NEW):
    with torch.no_grad():
        return hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                           eos_token_id=eos, pad_token_id=PAD)


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("factory", CONFIGS)
def test_prefill_logits_match_transformers(factory):
    hf = hf_model(factory)
    ids, mask = ragged_batch()
    model = injected(hf)
    model.setup_cache(len(PADS), P)
    logits = model.forward(ids, torch.arange(P), positions(mask), mask.bool(), kv_len=P)
    assert rel_err(logits, hf_logits(hf, ids, mask), mask.bool()) < 1e-4


@pytest.mark.parametrize("factory", CONFIGS)
def test_decode_with_cache_matches_prefill(factory):
    """Prefill the prompt, then feed 8 more tokens one at a time (eager length-sliced attention and
    the whole-cache shape a CUDA graph uses): each step's logits = one prefill over everything."""
    hf = hf_model(factory)
    extra = 8
    ids, mask = ragged_batch(length=P + extra)
    mask_p = mask[:, :P]
    full = injected(hf)
    full.setup_cache(len(PADS), P + extra)
    ref = full.forward(ids, torch.arange(P + extra), positions(mask), mask.bool(), kv_len=P + extra)
    for kv_len_of in (lambda slot: slot + 1, lambda slot: None):
        model = injected(hf)
        model.setup_cache(len(PADS), P + extra + 3)  # spare slots: masked, never attended
        model.forward(ids[:, :P], torch.arange(P), positions(mask_p), mask_p.bool(), kv_len=P)
        steps = []
        for slot in range(P, P + extra):
            pos = positions(mask)[:, slot : slot + 1]
            steps.append(model.forward(ids[:, slot : slot + 1], torch.tensor([slot]), pos, kv_len=kv_len_of(slot)))
        assert rel_err(torch.cat(steps, 1), ref[:, P:], slice(None)) < 1e-5


def never_emitted(hf, ids, mask) -> int:
    """A token id transformers' greedy run never emits (an EOS that never fires): the last id when
    it is absent from a run that stops on nothing else, else the smallest absent id."""
    ref = hf_greedy(hf, ids, mask, eos=V - 1)
    if ref.shape[1] == P + NEW and not (ref[:, P:] == V - 1).any():
        return V - 1
    return min(set(range(1, V)) - set(ref[:, P:].flatten().tolist()))


@pytest.mark.parametrize("factory", CONFIGS)
def test_greedy_tokens_match_transformers_generate(factory):
    hf = hf_model(factory)
    ids, mask = ragged_batch()
    eos = never_emitted(hf, ids, mask)
    ref = hf_greedy(hf, ids, mask, eos=eos)
    assert ref.shape[1] == P + NEW
    out = generate(injected(hf), ids, mask, NEW, eos_token_id=eos, pad_token_id=PAD,
                                sampling=SamplingParams(greedy=True), return_logprobs=True)
    assert torch.equal(out.sequences, ref)
    assert out.response_mask.shape == (len(PADS), NEW) and bool(out.response_mask.all())
    assert torch.equal(out.attention_mask, torch.cat([mask, out.response_mask], 1))
    # greedy log-probs: log_softmax of the logits at the chosen tokens (teacher-forced recompute)
    lp = torch.log_softmax(hf_logits(hf, ref, out.attention_mask)[:, P - 1 : -1], -1)
    assert torch.allclose(out.logprobs, lp.gather(-1, ref[:, P:, None]).squeeze(-1), atol=1e-4)


@pytest.mark.parametrize("factory", [llama_untied_gqa, qwen2_bias_sliding, opt_pre_ln])
def test_rows_that_repeat_a_prompt_prefill_it_once(factory, monkeypatch):
    """n samples of each prompt: each distinct prompt is prefilled once and its cache rows copied to
    the rows that repeat it; greedy tokens equal, seeded samples and their log-probs equal the rows
    prefilled one by one, and so does transformers' greedy generate."""
    import sys

    gen = sys.modules["engine.inference.generate"]  # (the package's `generate` is the function)
    hf = hf_model(factory)
    ids, mask = ragged_batch()
    order = torch.tensor([2, 0, 2, 1, 3, 0, 2, 1])  # 4 prompts, repeated and shuffled
    ids, mask = ids[order], mask[order]
    eos = never_emitted(hf, ids, mask)
    model = injected(hf)
    seen = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda tokens, *a, **k: seen.append(tuple(tokens.shape)) or forward(tokens, *a, **k))
    runs = {}
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(gen, "prompt_groups", lambda *a, **k: None)
        seen.clear()
        runs[shared] = [generate(model, ids, mask, NEW, eos_token_id=eos, pad_token_id=PAD, sampling=params,
                                       return_logprobs=True, row_seeds=seeds)
                        for params, seeds in ((SamplingParams(greedy=True), None),
                                              (SamplingParams(temperature=1.0), torch.arange(8) * 11 + 3))]
        assert seen[0] == ((4, P) if shared else (8, P)), seen[:2]
    for a, b in zip(runs[True], runs[False]):
        assert torch.equal(a.sequences, b.sequences) and torch.equal(a.response_mask, b.response_mask)
        assert (a.logprobs - b.logprobs).abs().max() < 1e-5
    assert torch.equal(runs[True][0].sequences, hf_greedy(hf, ids, mask, eos=eos))


@pytest.mark.parametrize("factory", [llama_untied_gqa, qwen2_bias_sliding, opt_pre_ln])
def test_eos_stops_rows_independently(factory):
    hf = hf_model(factory)
    ids, mask = ragged_batch()
    free = hf_greedy(hf, ids, mask, eos=V - 1)[:, P:]

    def first_step(row, tok):
        hits = (free[row] == tok).nonzero()
        return int(hits[0]) if len(hits) else None

    # an EOS that some row emits early (step 1..8) and some row never emits
    candidates = [int(t) for t in free[:, 1:9].flatten().unique() if int(t) != V - 1]
    eos = next(t for t in candidates if any(first_step(r, t) is None for r in range(len(PADS))))
    ref = hf_greedy(hf, ids, mask, eos=eos)
    out = generate(injected(hf), ids, mask, NEW, eos_token_id=eos, pad_token_id=PAD,
                                sampling=SamplingParams(greedy=True))
    assert torch.equal(out.sequences, ref)
    for row in range(len(PADS)):
        stop = first_step(row, eos)
        n = NEW if stop is None else stop + 1  # EOS kept and counted as a response token
        assert out.response_mask[row].tolist() == [1] * n + [0] * (NEW - n)
        assert (out.sequences[row, P + n :] == PAD).all()
    assert any(first_step(r, eos) is not None and first_step(r, eos) < 9 for r in range(len(PADS)))

    # every row stops early (several EOS ids): the loop ends at the last row's EOS, T' < max_new_tokens
    eos_ids = sorted({int(free[r, 2]) for r in range(len(PADS))})
    ref = hf_greedy(hf, ids, mask, eos=eos_ids)
    out = generate(injected(hf), ids, mask, NEW, eos_token_id=eos_ids, pad_token_id=PAD,
                                sampling=SamplingParams(greedy=True))
    assert torch.equal(out.sequences, ref)
    assert out.response_mask.shape[1] <= 3 and bool(out.response_mask[:, 0].all())


def test_load_weights_refreshes_in_place():
    hf1, hf2 = hf_model(llama_tied_bias_head_dim, seed=0), hf_model(llama_tied_bias_head_dim, seed=1)
    ids, mask = ragged_batch()
    model = injected(hf1)
    model.setup_cache(len(PADS), P + NEW)
    ptrs = [t.data_ptr() for t in model.weight_tensors()] + [model.cache.k.data_ptr()]
    run = lambda: model.forward(ids, torch.arange(P), positions(mask), mask.bool(), kv_len=P)  # noqa: E731
    before = run()
    assert rel_err(before, hf_logits(hf1, ids, mask), mask.bool()) < 1e-4

    # peft-wrapped names, no tied lm_head in named_parameters: both accepted
    n = model.load_weights((f"base_model.model.{k}", p) for k, p in hf2.named_parameters())
    assert n == len(list(hf2.named_parameters()))
    assert [t.data_ptr() for t in model.weight_tensors()] + [model.cache.k.data_ptr()] == ptrs
    after = run()
    assert rel_err(after, hf_logits(hf2, ids, mask), mask.bool()) < 1e-4
    assert rel_err(after, before, mask.bool()) > 1e-2

    with pytest.raises(KeyError, match="not a weight"):
        model.load_weights([("model.layers.0.mlp.gate.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="not given"):
        model.load_weights(list(hf2.state_dict().items())[:-3])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])

    model.release()
    assert model.memory_bytes() == {"weights": 0, "kv_cache": 0}
    with pytest.raises(RuntimeError):
        model.setup_cache(1, 4)
    model.load_weights(hf1.state_dict().items())  # comes back (fresh storage)
    model.setup_cache(len(PADS), P)
    assert rel_err(run(), hf_logits(hf1, ids, mask), mask.bool()) < 1e-4


def test_cache_reuse_and_smaller_batch():
    """A cache big enough is reused (no reallocation); a smaller batch runs on its leading rows."""
    hf = hf_model(llama_untied_gqa)
    ids, mask = ragged_batch()
    model = injected(hf)
    assert model.setup_cache(8, 64) and not model.setup_cache(4, 40)
    ptr = model.cache.k.data_ptr()
    greedy = SamplingParams(greedy=True)
    both = generate(model, ids, mask, 6, pad_token_id=PAD, sampling=greedy).sequences
    one = generate(model, ids[2:3], mask[2:3], 6, pad_token_id=PAD, sampling=greedy).sequences
    assert torch.equal(one, both[2:3]) and model.cache.k.data_ptr() == ptr
    assert model.setup_cache(8, 65) and model.cache.k.shape[3] == 65


class _FakeCudaGraph:
    def __init__(self):
        self.generators = []

    def register_generator_state(self, generator):
        self.generators.append(generator)


def fake_cuda_graphs(monkeypatch, gen) -> list:
    """Fake torch.cuda's graph API on CPU for engine.inference.generate (`gen`, the module): graphs are
    enabled, 'capture' runs the step once and 'replay' re-runs it on the same state tensors. Returns the list
    of the streams the captures were on (one entry per capture)."""
    import contextlib

    fake_stream = type("FakeStream", (), {"wait_stream": lambda self, other: None})
    captured_on = []  # the stream each capture was on
    monkeypatch.setattr(gen, "graphs_enabled", lambda model: True)
    monkeypatch.setattr(gen.DecodeGraph, "replay", lambda self: self._step())
    monkeypatch.setattr(torch.cuda, "Stream", fake_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", fake_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeCudaGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None, stream=None: (captured_on.append(stream),
                                                                               contextlib.nullcontext())[1])
    return captured_on


def test_cuda_graph_host_logic_with_faked_cuda(monkeypatch):
    """The graph path's host side on CPU, with torch.cuda faked: 'capture' runs the step once (a real
    capture only records it) and 'replay' re-runs it on the same state tensors. Checks capture before
    the prefill, one graph per (batch, sampling), the whole-cache decode shape, the
    sparse "all done" check with trimming, and per-call seeding."""
    import importlib

    gen = importlib.import_module("engine.inference.generate")  # the module, not the function

    captured_on = fake_cuda_graphs(monkeypatch, gen)

    hf = hf_model(llama_untied_gqa)
    ids, mask = ragged_batch()
    free = hf_greedy(hf, ids, mask, eos=V - 1)[:, P:]
    eos = int(free[1, 3])  # stops row 1 (at least) early
    model = injected(hf)
    greedy = SamplingParams(greedy=True)
    for _ in range(2):
        out = generate(model, ids, mask, NEW, eos_token_id=eos, pad_token_id=PAD, sampling=greedy, check_every=8)
        assert torch.equal(out.sequences, hf_greedy(hf, ids, mask, eos=eos))
    assert len(model.graphs) == 1
    graph = next(iter(model.graphs.values()))
    assert graph.graph.generators == [graph.generator]

    params = SamplingParams(temperature=0.8, top_k=30)
    run = lambda seed: generate(model, ids, mask, 12, pad_token_id=PAD, sampling=params,  # noqa: E731
                                      generator=torch.Generator().manual_seed(seed)).sequences
    assert torch.equal(run(0), run(0)) and not torch.equal(run(0), run(1))
    assert len(model.graphs) == 2
    # both graphs warmed up and captured on the model's one stream (cuBLAS keeps a workspace per stream)
    assert len(captured_on) == 2 and model.graph_stream is not None
    assert all(s is model.graph_stream for s in captured_on)
    model.setup_cache(len(PADS), 200)  # reallocated: the graphs pointed into the old cache
    assert not model.graphs


def test_a_failed_capture_decodes_eagerly_with_one_warning(monkeypatch, caplog):
    """A capture the driver refuses (torch raises at the capture's end, as with an invalidated stream
    capture) must not stop the run: that setting decodes eagerly, with the same tokens, is not captured
    again, and the reason is logged once."""
    import contextlib
    import importlib

    gen = importlib.import_module("engine.inference.generate")
    fake_cuda_graphs(monkeypatch, gen)
    tries = []

    @contextlib.contextmanager
    def refused(g, pool=None, stream=None):
        tries.append(1)
        yield
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture\nmore")

    monkeypatch.setattr(torch.cuda, "graph", refused)
    hf = hf_model(llama_untied_gqa)
    ids, mask = ragged_batch()
    model = injected(hf)
    greedy = SamplingParams(greedy=True)
    with caplog.at_level("WARNING", logger="engine.inference.generate"):
        outs = [generate(model, ids, mask, NEW, eos_token_id=V - 1, pad_token_id=PAD, sampling=greedy) for _ in range(2)]
    for out in outs:
        assert torch.equal(out.sequences, hf_greedy(hf, ids, mask, eos=V - 1))
    assert len(tries) == 1 and list(model.graphs.values()) == [None]
    warned = [r.getMessage() for r in caplog.records if "CUDA graph failed" in r.getMessage()]
    assert len(warned) == 1 and "operation failed due to a previous error during capture; " in warned[0], warned


def test_greedy_graph_decoding_leaves_the_callers_rng_alone(monkeypatch):
    """Greedy decoding draws nothing: a graph-decoded greedy call must not take a number from the global
    RNG (it would shift the caller's later sampling, e.g. after the engine's first-use self-check)."""
    import importlib

    gen = importlib.import_module("engine.inference.generate")
    fake_cuda_graphs(monkeypatch, gen)
    hf = hf_model(llama_untied_gqa)
    ids, mask = ragged_batch()
    model = injected(hf)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    generate(model, ids, mask, NEW, pad_token_id=PAD, sampling=SamplingParams(greedy=True))
    assert len(model.graphs) == 1 and torch.equal(torch.get_rng_state(), before)


# ---------------------------------------------------------------- sampling


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The sampled distribution written out directly (fp64): softmax(l / T) restricted to the tokens
    top-k keeps (logit >= k-th largest) and top-p keeps (mass of strictly likelier tokens < top_p)."""
    l = logits.double() / p.temperature
    keep = torch.ones_like(l, dtype=torch.bool)
    if p.top_k:
        keep &= l >= l.sort(descending=True).values[p.top_k - 1]
    probs = torch.where(keep, l, -math.inf).softmax(-1)
    if p.top_p < 1:
        order = probs.argsort(descending=True)
        mass_before = torch.cumsum(probs[order], 0) - probs[order]
        keep_p = torch.zeros_like(keep)
        keep_p[order] = mass_before < p.top_p
        probs = torch.where(keep_p, probs, 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=4),
        SamplingParams(top_p=0.8),
        SamplingParams(temperature=0.9, top_k=6, top_p=0.7),
    ],
    ids=str,
)
def test_sampling_frequencies_match_reference(params):
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.5, 0.1, -0.3, -1.0, -2.0])
    n = 200_000
    tokens, logprobs = sample(logits.expand(n, -1), params, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=len(logits)).double() / n
    ref = reference_probs(logits, params)
    assert (freq[ref == 0] == 0).all()  # filtered tokens are never drawn
    assert 0.5 * (freq - ref).abs().sum() < 0.006  # total variation (sampling noise ~0.002 here)
    # the log-prob of the distribution drawn from: filtered and renormalised, written out above
    expected_lp = ref.log()[tokens].float()
    assert torch.allclose(logprobs, expected_lp, atol=1e-6)


def test_greedy_is_argmax():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(1))
    tokens, logprobs = sample(logits, SamplingParams(greedy=True, temperature=0.1))
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).max(-1).values)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.6), (7, 0.9), (200, 0.3)])
def test_filter_matches_transformers_warpers(top_k, top_p):
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(6, 40, generator=g).round(decimals=1)  # rounding makes ties
    ours = filter_logits(scores / 0.8, top_k, top_p)
    hf = TemperatureLogitsWarper(0.8)(None, scores)
    if top_k:
        hf = TopKLogitsWarper(top_k)(None, hf)
    if top_p < 1:
        hf = TopPLogitsWarper(top_p)(None, hf)
    assert torch.equal(ours, hf)


def test_top_p_boundary_follows_transformers():
    """Eight equal logits: probabilities 1/8 exactly, so the cumulative mass hits 1 - top_p exactly;
    transformers removes a token whose cumulative probability is <= 1 - top_p (keeps 4 of 8 here)."""
    scores = torch.zeros(2, 8)
    ours = filter_logits(scores, 0, 0.5)
    assert torch.equal(ours, TopPLogitsWarper(0.5)(None, scores))
    assert (ours.isfinite().sum(-1) == 4).all()


def test_generate_sampling_is_seeded_and_masks_logprobs():
    hf = hf_model(opt_pre_ln)
    ids, mask = ragged_batch()
    model = injected(hf)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    run = lambda seed: generate(model, ids, mask, 12, eos_token_id=[5, 6, 7], pad_token_id=PAD,  # noqa: E731
                                      sampling=params, generator=torch.Generator().manual_seed(seed),
                                      return_logprobs=True)
    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a.sequences, b.sequences) and not torch.equal(a.sequences, c.sequences)
    assert (a.logprobs[a.response_mask == 0] == 0).all() and (a.logprobs[a.response_mask == 1] < 0).all()
    # the returned log-probs are those of the distribution drawn from: temperature-scaled, top-p
    # filtered (kernels' keep mask), renormalised
    from kernels.sampling import keep_mask_reference

    z = hf_logits(hf, a.sequences, a.attention_mask)[:, P - 1 : -1].float() / 0.8
    keep = keep_mask_reference(z.reshape(-1, z.shape[-1]), 0, 0.9).reshape(z.shape)
    lp = torch.log_softmax(z.masked_fill(~keep, -math.inf), -1)
    lp = torch.where(a.response_mask.bool(), lp.gather(-1, a.sequences[:, P:, None]).squeeze(-1), 0.0)
    assert torch.allclose(a.logprobs, lp, atol=1e-4)


@pytest.mark.parametrize("factory,norm", [(llama_untied_gqa, "rms_norm"), (opt_pre_ln, "layer_norm"),
                                          (opt_post_ln, "layer_norm")])
def test_decoder_computes_through_the_kernels_ops(monkeypatch, factory, norm):
    """The injected decoder's norms (residual add fused), rotary, SwiGLU and sampling are the kernels/
    ops (Triton on CUDA), not copies: each is called, and the greedy tokens still equal transformers'."""
    import kernels

    calls = {}
    for name in (norm, "apply_rotary", "silu_mul", "sample"):
        real = getattr(kernels, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.setdefault(_name, []).append(kwargs.get("residual") is not None)
            return _real(*args, **kwargs)

        monkeypatch.setattr(kernels, name, spy)
    hf = hf_model(factory)
    ids, mask = ragged_batch()
    eos = never_emitted(hf, ids, mask)
    out = generate(injected(hf), ids, mask, NEW, eos_token_id=eos, pad_token_id=PAD, sampling=SamplingParams(greedy=True))
    assert torch.equal(out.sequences, hf_greedy(hf, ids, mask, eos))
    layers, steps = hf.config.num_hidden_layers, NEW  # forwards: one prefill + NEW - 1 decode steps
    assert len(calls["sample"]) == steps
    fused = sum(calls[norm])  # norms that took the residual add in (all but the first block's first)
    if factory is llama_untied_gqa:
        assert len(calls["apply_rotary"]) == len(calls["silu_mul"]) == layers * steps
        assert len(calls[norm]) == (2 * layers + 1) * steps and fused == 2 * layers * steps
    else:
        assert "apply_rotary" not in calls and "silu_mul" not in calls
        assert len(calls[norm]) == (2 * layers + (factory is opt_pre_ln)) * steps
        assert fused == 2 * layers * steps  # every norm but the first block's input norm (pre-LN) takes the add


# ---------------------------------------------------------------- supports


def test_supports():
    assert supports(llama_untied_gqa()[1]) == (True, "")
    assert supports(llama3_rope()[1]) == (True, "")
    assert supports(opt_projected()[1]) == (True, "")
    ok, reason = supports(GPT2Config())
    assert not ok and "gpt2" in reason and "\n" not in reason
    yarn = LlamaConfig(**LLAMA, rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0))
    ok, reason = supports(yarn)
    assert not ok and "yarn" in reason
    with pytest.raises(NotImplementedError, match="yarn"):
        ModelArgs.from_hf_config(yarn)
    ok, reason = supports(LlamaConfig(**LLAMA, hidden_act="gelu"))
    assert not ok and "gelu" in reason


# ---------------------------------------------------------------- GPU lane

@pytest.mark.parametrize("factory", [llama_untied_gqa, qwen2_bias_sliding, opt_post_ln])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_matches_eager(factory):
    hf = hf_model(factory).cuda()
    ids, mask = (t.cuda() for t in ragged_batch())
    greedy = SamplingParams(greedy=True)
    graphed, eager = injected(hf), injected(hf, use_cuda_graphs=False)
    kw = dict(eos_token_id=never_emitted(hf, ids, mask), pad_token_id=PAD)
    out_g = generate(graphed, ids, mask, NEW, sampling=greedy, **kw)
    assert len(graphed.graphs) == 1 and not eager.graphs
    assert torch.equal(out_g.sequences, generate(eager, ids, mask, NEW, sampling=greedy, **kw).sequences)
    assert torch.equal(out_g.sequences, hf_greedy(hf, ids, mask, kw["eos_token_id"]))
    # refresh: the captured graph reads the new weights (same storage)
    hf2 = hf_model(factory, seed=1).cuda()
    graphed.load_weights(hf2.state_dict().items())
    eager.load_weights(hf2.state_dict().items())
    out_g = generate(graphed, ids, mask, NEW, sampling=greedy, **kw)
    assert len(graphed.graphs) == 1
    assert torch.equal(out_g.sequences, generate(eager, ids, mask, NEW, sampling=greedy, **kw).sequences)
    # sampling in the graph: seeded, reproducible, EOS handling intact
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9)
    run = lambda s: generate(graphed, ids, mask, NEW, sampling=params,  # noqa: E731
                                     generator=torch.Generator("cuda").manual_seed(s), **kw)
    assert torch.equal(run(3).sequences, run(3).sequences)


@pytest.mark.parametrize("factory", [llama_untied_gqa, mistral_window, opt_pre_ln])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_logits_and_greedy_agreement(factory):
    hf = hf_model(factory).cuda().to(torch.bfloat16)
    batches = [ragged_batch(seed) for seed in range(4)]  # 16 rows x 20 tokens: 99% allows 3 flips
    ids, mask = (torch.cat(parts).cuda() for parts in zip(*batches))
    model = injected(hf)
    assert model.dtype == torch.bfloat16
    model.setup_cache(ids.shape[0], P + NEW)
    logits = model.forward(ids, torch.arange(P, device="cuda"), positions(mask), mask.bool(), kv_len=P)
    ref = hf_logits(hf, ids, mask)
    assert rel_err(logits.float(), ref.float(), mask.bool()) < 1e-2
    # greedy: our tokens vs transformers' argmax teacher-forced on our sequences (immune to a single
    # near-tie flipping a whole continuation)
    out = generate(model, ids, mask, NEW, eos_token_id=None, pad_token_id=PAD, sampling=SamplingParams(greedy=True))
    hf_next = hf_logits(hf, out.sequences, out.attention_mask)[:, P - 1 : -1].argmax(-1)
    agree = (hf_next == out.sequences[:, P:]).float().mean().item()
    assert agree >= 0.99
