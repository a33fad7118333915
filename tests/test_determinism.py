"""engine.deterministic=true: batch-invariant generation on both paths, and stage runs that repeat bit for bit.

Generation (in process, a tiny Llama): the same prompts generated at batch sizes 1, 7 and 64 and in a
shuffled order give each row the same tokens and log-probs, with temperature, top-k and top-p on, through
`transformers` generate and the injected decoder (eager, and its CUDA-graph host logic with torch.cuda
faked); without deterministic mode a row's draws depend on its batch. Stages (slow): SFT, reward, DPO,
PPO and GRPO run twice (tests/engine_scripts/determinism.py), in one process and on 2 gloo ranks; the
two runs' metrics.jsonl (wall-clock keys aside) and exported safetensors bytes are equal.
"""
from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, cli_env, comparable, metrics
from engine import EngineConfig, OptimConfig, TrainEngine, init_distributed, set_deterministic
from engine.config import validate_engine_config
from engine.generation import BatchInvariantGenerator, Generated, SamplingParams
from engine.inference import InferenceModel, row_noise, stream_seed
from rlhf.config import SFTConfig, compose, to_config
from rlhf.config.validate import validate_sft
from rlhf.core.errors import ConfigError
from rlhf.data import collate_prompts
from rlhf.rl.rollout import rollout_seeds

EOS, PAD, V, N, WIDTH = 2, 0, 64, 64, 12
SAMPLING = SamplingParams(max_new_tokens=6, temperature=0.8, top_k=20, top_p=0.9)


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def prompt_batch():
    """N prompts of 3..WIDTH tokens, left-padded to WIDTH (a fixed width, as the stages pad them), and a seed
    per prompt."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(3, WIDTH + 1, (N,), generator=g)
    mask = (torch.arange(WIDTH)[None] >= WIDTH - lens[:, None]).long()
    ids = torch.randint(3, V, (N, WIDTH), generator=g) * mask
    return ids, mask, torch.tensor([stream_seed(1234, 0, i, 0) for i in range(N)])


def engine_for(path: str, deterministic: bool = True, rows: int = 16) -> TrainEngine:
    return TrainEngine(tiny_llama(), EngineConfig(generation=path, deterministic=deterministic,
                                                  deterministic_rows=rows),
                       OptimConfig(lr=1e-3, scheduler="constant"), total_steps=1, info=init_distributed())


def rows_of(out: Generated) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each row's response tokens and log-probs, up to its EOS."""
    n = out.response_mask.sum(1).tolist()
    return [(out.responses[b, : n[b]], out.logprobs[b, : n[b]]) for b in range(len(n))]


def generate(engine, rows: list[int], seeds: bool = True) -> Generated:
    ids, mask, row_seeds = prompt_batch()
    with engine.generation() as gen:
        return gen.generate(ids[rows], mask[rows], SAMPLING, eos_token_id=EOS, pad_token_id=PAD, return_logprobs=True,
                            **({"row_seeds": row_seeds[rows]} if seeds else {}))


@pytest.fixture(scope="module", params=["hf", "injected"])
def path_and_reference(request):
    engine = engine_for(request.param)
    return request.param, engine, rows_of(generate(engine, list(range(N))))


def test_a_rows_tokens_and_logprobs_do_not_depend_on_its_batch(path_and_reference):
    path, engine, ref = path_and_reference
    assert sum(len(t) for t, _ in ref) > 2 * N, "the responses are too short to show anything"
    assert len({tuple(t.tolist()) for t, _ in ref}) > N // 2, "most rows should sample different responses"
    shuffled = torch.randperm(N, generator=torch.Generator().manual_seed(1)).tolist()
    seven = shuffled[:7]
    for rows in ([0], [N - 1], [37], seven, shuffled):
        got = rows_of(generate(engine, rows))
        for (tokens, logprobs), r in zip(got, rows):
            want_tokens, want_logprobs = ref[r]
            assert torch.equal(tokens, want_tokens), f"{path}: row {r} in a batch of {len(rows)}: tokens {tokens.tolist()} " \
                                                     f"!= {want_tokens.tolist()} at batch {N}"
            assert torch.equal(logprobs, want_logprobs), f"{path}: row {r} in a batch of {len(rows)}: log-probs differ " \
                f"by {(logprobs - want_logprobs).abs().max().item():.3g} from batch {N}'s"


def test_both_paths_draw_the_same_tokens(path_and_reference):
    path, _, ref = path_and_reference
    other = rows_of(generate(engine_for("hf" if path == "injected" else "injected"), list(range(N))))
    for r, ((t1, l1), (t2, l2)) in enumerate(zip(ref, other)):
        assert torch.equal(t1, t2), f"row {r}: the two paths sampled {t1.tolist()} and {t2.tolist()}"
        torch.testing.assert_close(l1, l2, rtol=0, atol=1e-5)


def test_without_deterministic_mode_a_rows_draws_depend_on_its_position():
    """The case deterministic mode fixes: the global RNG's noise is cut into rows by position, so the same
    prompt alone or at row r of a batch (same seed) samples differently."""
    engine = engine_for("hf", deterministic=False)
    torch.manual_seed(0)
    batch = rows_of(generate(engine, list(range(N)), seeds=False))
    alone = []
    for r in range(1, 9):
        torch.manual_seed(0)
        alone.append(rows_of(generate(engine, [r], seeds=False))[0][0])
    assert any(not torch.equal(a, batch[r][0]) for a, r in zip(alone, range(1, 9)))


class _Spy:
    """An inner generator that records its batches and answers each row with its first prompt token."""

    name = "spy"

    def __init__(self):
        self.calls = []

    def generate(self, ids, mask, params, *, eos_token_id, pad_token_id, return_logprobs=False, row_seeds=None):
        self.calls.append((ids.clone(), mask.clone(), row_seeds.clone()))
        n = 1 + len(self.calls)  # chunks answer with responses of different widths
        resp = ids[:, -1:].repeat(1, n)
        rmask = torch.ones_like(resp)
        return Generated(sequences=torch.cat([ids, resp], 1), attention_mask=torch.cat([mask, rmask], 1),
                         response_mask=rmask, prompt_len=ids.shape[1], logprobs=-resp.float() if return_logprobs else None)


def test_batches_are_cut_into_fixed_chunks_with_a_pad_column():
    ids, mask, seeds = prompt_batch()
    spy = _Spy()
    out = BatchInvariantGenerator(spy, 16).generate(ids[:40], mask[:40], SAMPLING, eos_token_id=EOS, pad_token_id=PAD,
                                                    return_logprobs=True, row_seeds=seeds[:40])
    assert [c[0].shape for c in spy.calls] == [(16, WIDTH + 1)] * 3  # 40 rows: 16 + 16 + (8 + 8 copies of row 39)
    sent = torch.cat([c[0] for c in spy.calls])
    assert torch.equal(sent[:40, 1:], ids[:40]) and torch.equal(sent[40:, 1:], ids[39:40].expand(8, WIDTH))
    assert (sent[:, 0] == PAD).all() and all((c[1][:, 0] == 0).all() for c in spy.calls)
    assert torch.equal(torch.cat([c[2] for c in spy.calls])[:40], seeds[:40])
    # the output: the prompts as given, responses right-padded to the longest chunk's (4 columns)
    assert out.sequences.shape == (40, WIDTH + 4) and torch.equal(out.sequences[:, :WIDTH], ids[:40])
    assert out.response_mask.sum(1).tolist() == [2] * 16 + [3] * 16 + [4] * 8
    assert torch.equal(out.logprobs, -out.responses.float() * out.response_mask)
    assert out.responses[0].tolist() == [ids[0, -1].item()] * 2 + [PAD] * 2


def test_injected_graph_path_draws_the_rows_streams(monkeypatch):
    """The decode step captured in a (faked) CUDA graph computes each row's noise from its state tensors:
    the same tokens as the eager decoder, replay after replay."""
    from test_inference import fake_cuda_graphs

    gen = importlib.import_module("engine.inference.generate")
    hf = tiny_llama()
    model = InferenceModel(hf.config, hf.state_dict().items(), dtype=torch.float32, device="cpu")
    ids, mask, seeds = prompt_batch()
    eager = gen.generate(model, ids[:8], mask[:8], 6, pad_token_id=PAD, sampling=SAMPLING, row_seeds=seeds[:8])
    fake_cuda_graphs(monkeypatch, gen)
    for _ in range(2):
        graphed = gen.generate(model, ids[:8], mask[:8], 6, pad_token_id=PAD, sampling=SAMPLING, row_seeds=seeds[:8])
        assert torch.equal(graphed.sequences, eager.sequences)
    assert len(model.graphs) == 1 and next(iter(model.graphs))[-1] is True  # keyed as a seeded graph


def _fmix32(x: int) -> int:
    x ^= x >> 16
    x = x * 0x85EBCA6B & 0xFFFFFFFF
    x ^= x >> 13
    x = x * 0xC2B2AE35 & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_row_noise_equals_its_python_integer_reference():
    """The int64 tensor arithmetic (16-bit split multiplies) equals MurmurHash3's finaliser in Python ints."""
    seeds = [0, 1, 2**62 + 12345, stream_seed(1234, 7, 3, 1)]
    for step in (0, 5, 2**31 + 3):
        got = row_noise(torch.tensor(seeds), torch.tensor(step), 50)
        for b, s in enumerate(seeds):
            key = _fmix32(((s >> 32) & 0xFFFFFFFF) ^ 0x243F6A88)
            key = _fmix32(key ^ (s & 0xFFFFFFFF))
            key = _fmix32(key ^ (step * 0x9E3779B9 & 0xFFFFFFFF))
            want = [(_fmix32(key ^ (v * 0x85EBCA77 & 0xFFFFFFFF)) >> 8) * 2.0**-24 for v in range(50)]
            assert got[b].tolist() == want, f"seed {s}, step {step}"


def test_row_streams_sample_the_softmax():
    """Draws through per-row streams follow softmax(logits / T): a chi-square test over 40,000 rows at one
    step (and over 100 steps of 200 rows), 9 degrees of freedom, below its 99.9% point 27.9."""
    from engine.inference import sample

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2, -2.0, 0.8]])
    p = (logits / 0.8).softmax(-1)[0].double()
    params = SamplingParams(temperature=0.8)
    for noise in (row_noise(torch.arange(40_000), 3, 10),
                  torch.cat([row_noise(torch.arange(200), t, 10) for t in range(100)])):
        tokens, _ = sample(logits.expand(len(noise), 10), params, noise=noise)
        freq = torch.bincount(tokens, minlength=10).double() / len(noise)
        chi2 = (((freq - p) ** 2) / p).sum().item() * len(noise)
        assert chi2 < 27.9, f"chi-square {chi2:.1f}: frequencies {freq.tolist()} vs {p.tolist()}"


def test_rollout_seeds_name_the_step_prompt_and_sample():
    seeds = rollout_seeds(1234, 3, [7, 7, 9, 9], 2)
    assert seeds.tolist() == [stream_seed(1234, 3, 7, 0), stream_seed(1234, 3, 7, 1), stream_seed(1234, 3, 9, 0),
                              stream_seed(1234, 3, 9, 1)]
    assert len(set(seeds.tolist())) == 4 and all(0 <= s < 2**63 for s in seeds.tolist())
    assert stream_seed(1234, 3, 7, 0) != stream_seed(1234, 4, 7, 0) != stream_seed(1235, 3, 7, 0)


def test_collate_prompts_pads_to_a_fixed_width():
    batch = collate_prompts([{"input_ids": [5, 6]}, {"input_ids": [7]}], PAD, width=4)
    assert batch["input_ids"].tolist() == [[0, 0, 5, 6], [0, 0, 0, 7]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]
    with pytest.raises(ValueError, match="fixed width 1"):
        collate_prompts([{"input_ids": [5, 6]}], PAD, width=1)


@pytest.mark.parametrize("override", ["engine.deterministic_rows=0", "engine.deterministic_rows=-3"])
def test_bad_deterministic_rows_is_rejected_naming_the_key(override):
    cfg = to_config(compose("sft", [override]), SFTConfig)
    with pytest.raises(ConfigError, match=r"engine\.deterministic_rows"):
        validate_sft(cfg, init_distributed())
    with pytest.raises(ValueError, match=r"engine\.deterministic"):
        validate_engine_config(EngineConfig(deterministic="yes"), init_distributed())


def test_set_deterministic_turns_on_torchs_deterministic_algorithms(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    set_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    try:
        set_deterministic(True)
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False


# ---------------------------------------------------------------- stages, run twice

SCRIPT = ROOT / "tests" / "engine_scripts" / "determinism.py"
STAGES = ("sft", "reward", "dpo", "ppo", "grpo")


def _launch(out: Path, nproc: int) -> subprocess.Popen:
    if nproc == 1:
        cmd = [sys.executable, str(SCRIPT), str(out)]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
               "127.0.0.1", "--master_port", str(port), str(SCRIPT), str(out)]
    return subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def twice(tmp_path_factory):
    """{world size: (run a, run b)}: the five stages twice in one process, then twice on 2 ranks."""
    root = tmp_path_factory.mktemp("determinism")
    runs = {}
    for world in (1, 2):
        dirs = (root / f"w{world}_a", root / f"w{world}_b")
        procs = [_launch(d, world) for d in dirs]  # both at once: equal results must not need a quiet machine
        for proc in procs:
            out, _ = proc.communicate(timeout=600)
            if proc.returncode != 0:
                pytest.fail(f"{SCRIPT.name} on {world} rank(s) exited {proc.returncode}:\n{out[-5000:]}")
        runs[world] = dirs
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", STAGES)
def test_two_deterministic_runs_are_equal_bit_for_bit(twice, world, stage):
    a, b = (d / stage for d in twice[world])
    rows_a, rows_b = metrics(a), metrics(b)
    assert any(r["kind"] == "train" for r in rows_a) and any(r["kind"] == "eval" for r in rows_a)
    assert comparable(rows_a) == comparable(rows_b), f"{stage}, {world} rank(s): metrics.jsonl differ"
    weights = sorted(p.relative_to(a) for p in a.rglob("*.safetensors"))
    assert weights and weights == sorted(p.relative_to(b) for p in b.rglob("*.safetensors"))
    for rel in weights:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), f"{stage}, {world} rank(s): {rel} differs"


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["ppo", "grpo"])
def test_the_first_rollouts_are_the_same_at_one_and_two_ranks(twice, stage):
    """Per-row streams and batch-invariant numerics: step 1 samples the same responses from the same weights
    whether 4 rows run in one process or 2 per rank (the figures differ only by how the ranks' sums are
    reduced, ~1e-7 relative; the update's stats, rescaled per micro-batch to the mini-batch's exact mean in float32,
    up to ~3e-6: measured 3.3e-6 for GRPO's entropy). Without engine.deterministic the draws depend on the
    partition: measured here, the step-1 entropy differed by 3e-5 relative and the reward by 2e-4 (vs 4e-11)
    between 1 and 2 ranks."""
    one, two = (metrics(twice[w][0] / stage, "train")[0] for w in (1, 2))
    assert one["response_len"] == two["response_len"]
    assert abs(one["entropy"] - two["entropy"]) <= 1e-5 * abs(one["entropy"]), (one["entropy"], two["entropy"])
    assert abs(one["reward"] - two["reward"]) <= 1e-8, (one["reward"], two["reward"])
    if stage == "ppo":  # the sampled held-out evaluation (KL, reward) before training, with its own row seeds
        e1, e2 = (metrics(twice[w][0] / stage, "eval")[0] for w in (1, 2))
        assert abs(e1["reward"] - e2["reward"]) <= 1e-8, (e1["reward"], e2["reward"])
