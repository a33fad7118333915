"""The vLLM lane: `engine.generation=vllm` on real vLLM code (the CPU build, `vllm-cpu`), not a mock.

Runs in a venv of its own (scripts/vllm_cpu_venv.sh: vllm-cpu pins an older transformers and fastapi than the
project's), started by tests/test_vllm_lane.py from the main suite; in the main venv, where vLLM is not
installed, this module is skipped with that pointer. The model is a user's own: a Qwen2 (qkv biases, tied
embeddings, head size 32, which vLLM's CPU attention has a kernel for) with a byte-pair tokenizer whose ids
and special tokens differ from the shipped one's.

    . .venv-vllm/bin/activate && python -m pytest -q tests/vllm_lane
"""
from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM lane runs in its own venv: tests/test_vllm_lane.py starts it "
                                   "(scripts/vllm_cpu_venv.sh builds it)")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: conftest helpers

from conftest import ROOT, comparable, killed_at, leftovers, metrics, run_stage, summary  # noqa: E402
from test_user_model import make_user_tokenizer  # noqa: E402

from engine.config import EngineConfig, OptimConfig, VLLMConfig, validate_engine_config  # noqa: E402
from engine.distributed import init_distributed  # noqa: E402
from engine.generation import hf_generate  # noqa: E402
from engine.inference.sampling import SamplingParams, filter_logits  # noqa: E402
from engine.vllm_backend import (ExpectedWeights, VLLMGenerator, VLLMRollout, check_expected,  # noqa: E402
                                 check_model, repack_tied_head, supports)

CPU = torch.device("cpu")


def user_qwen(path, seed: int = 0):
    """A local Qwen2 directory with its own tokenizer (random weights), as a user brings one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    make_user_tokenizer().save_pretrained(path)
    Qwen2Config().save_pretrained(path)  # the directory's model type decides the tokenizer class AutoTokenizer loads
    tok = AutoTokenizer.from_pretrained(path)  # as the stages load it (it may count one more token than built)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # larger weights than the init's: peaked distributions, so greedy ties are rare
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    return user_qwen(tmp_path_factory.mktemp("vllm") / "qwen-user")


@pytest.fixture(scope="module")
def hf_model(user_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(user_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def rollout(hf_model):
    r = VLLMRollout(hf_model.config, dtype=torch.float32, settings=VLLMConfig(kv_cache_gib=0.25), seed=0, device=CPU)
    stats = r.load(hf_model.named_parameters(), ExpectedWeights(torch.float32))
    assert stats.mismatched == [] and stats.compared > 0
    return r


def prompts(tok, texts=("Human: add 12 and 30\n\nAssistant:", "Human: sort 3 1 2\n\nAssistant:", "Hi",
                        "Human: reverse abc\n\nAssistant: cba, and", "x")):
    """Left-padded prompt ids and mask (rows of different lengths)."""
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def trainer_logprobs(model, g, params: SamplingParams) -> torch.Tensor:
    """[B, T] log p(token) under the sampler's distribution, computed by a teacher-forced transformers forward."""
    mask = g.attention_mask
    with torch.no_grad():
        logits = model(input_ids=g.sequences, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    logits = logits[:, g.prompt_len - 1 : -1].float()
    if not params.greedy:
        logits = logits / params.temperature
        kept = filter_logits(logits.reshape(-1, logits.shape[-1]), params.top_k, params.top_p).reshape(logits.shape)
        drawn = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, g.responses[..., None], True)
        logits = torch.where(drawn, logits, kept)  # the drawn token always in the support (as Policy's forward)
    return logits.log_softmax(-1).gather(-1, g.responses[..., None]).squeeze(-1) * g.response_mask


# ----------------------------------------------------------------------------- sampling


def test_greedy_tokens_and_logprobs_equal_transformers(rollout, hf_model, user_dir):
    tok = make_user_tokenizer()
    ids, mask = prompts(tok)
    p = SamplingParams(max_new_tokens=12, greedy=True)
    got = VLLMGenerator(rollout).generate(ids, mask, p, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                          return_logprobs=True)
    want = hf_generate(hf_model, ids, mask, p, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       return_logprobs=True)
    assert got.prompt_len == want.prompt_len and torch.equal(got.sequences[:, : got.prompt_len], ids)
    T = want.responses.shape[1]
    assert torch.equal(got.responses[:, :T], want.responses) and torch.equal(got.response_mask[:, :T], want.response_mask)
    rel = (got.logprobs[:, :T] - want.logprobs).norm() / want.logprobs.norm()
    assert rel < 1e-5, rel


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=10, temperature=1.3),
                                    SamplingParams(max_new_tokens=10, temperature=0.8, top_k=12),
                                    SamplingParams(max_new_tokens=10, temperature=0.8, top_k=12, top_p=0.9)],
                         ids=["temperature", "top_k", "top_k_top_p"])
def test_sampled_logprobs_are_the_trainers_under_the_sampling_distribution(rollout, hf_model, params):
    """vLLM's processed log-probs (temperature, then top-k / top-p, renormalised) = the trainer's log-softmax of the
    same logits under the same settings, at fp32 rounding: the importance ratio compares like with like. With top-p
    a token at the nucleus's edge can fall on either side in the two engines' rounding: every log-prob is finite (the
    drawn token is always in the trainer's support) and at most 1 token in 50 differs by more than rounding."""
    tok = make_user_tokenizer()
    ids, mask = prompts(tok)
    ids, mask = ids.repeat(4, 1), mask.repeat(4, 1)  # 20 rows
    g = VLLMGenerator(rollout).generate(ids, mask, params, eos_token_id=tok.eos_token_id,
                                        pad_token_id=tok.pad_token_id, return_logprobs=True,
                                        row_seeds=torch.arange(100, 120))
    m = g.response_mask.bool()
    assert m.sum() > 60
    gaps = (g.logprobs - trainer_logprobs(hf_model, g, params)).abs()[m]
    assert torch.isfinite(gaps).all()
    if params.top_p < 1:
        assert (gaps > 1e-4).float().mean() <= 0.02, gaps.max()
    else:
        assert gaps.max() < 1e-4, gaps.max()


def test_row_seeds_repeat_a_rollout_and_a_new_seed_changes_its_row(rollout):
    tok = make_user_tokenizer()
    ids, mask = prompts(tok)
    p = SamplingParams(max_new_tokens=16, temperature=1.5)
    gen = VLLMGenerator(rollout)
    seeds = torch.tensor([11, 12, 13, 14, 15])
    a = gen.generate(ids, mask, p, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, row_seeds=seeds)
    b = gen.generate(ids, mask, p, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, row_seeds=seeds)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.response_mask, b.response_mask)
    c = gen.generate(ids, mask, p, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                     row_seeds=seeds + 1000)
    T = min(a.responses.shape[1], c.responses.shape[1])
    assert not torch.equal(a.responses[:, :T], c.responses[:, :T])


def test_a_batch_of_many_seeded_rows_samples_whole_prefills(rollout):
    """A rollout whose prompts together exceed one scheduler step (240 seeded rows): vLLM's CPU backend would
    split a prefill and rewind its seeded generator (an offset CPU generators lack); every row comes back."""
    tok = make_user_tokenizer()
    ids, mask = prompts(tok)
    ids, mask = ids.repeat(48, 1), mask.repeat(48, 1)  # 240 rows, ~6k prompt tokens
    g = VLLMGenerator(rollout).generate(ids, mask, SamplingParams(max_new_tokens=4, temperature=1.0),
                                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                        return_logprobs=True, row_seeds=torch.arange(240))
    assert g.sequences.shape[0] == 240 and (g.response_mask.sum(1) >= 1).all()
    assert torch.isfinite(g.logprobs).all()


def test_too_long_a_request_is_refused_naming_the_key(rollout):
    tok = make_user_tokenizer()
    ids, mask = prompts(tok)
    with pytest.raises(ValueError, match=r"engine.vllm.max_model_len=256 is shorter than a prompt plus max_new_tokens"):
        VLLMGenerator(rollout).generate(ids, mask, SamplingParams(max_new_tokens=250, greedy=True),
                                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


# ----------------------------------------------------------------------------- the weight sync and its check


def test_an_engine_in_its_own_process_samples_what_the_in_process_one_samples(rollout, hf_model):
    """own_process=True (a split placement's generation rank): vLLM's engine core spawned in a child process, the
    weights sent whole through its RPC and checked there (the check still finds a planted fault); the same seeded
    rows give the same tokens and log-probs as the in-process engine's."""
    child = VLLMRollout(hf_model.config, dtype=torch.float32, settings=VLLMConfig(kv_cache_gib=0.25), seed=0,
                        device=CPU, own_process=True)
    stats = child.load(hf_model.named_parameters(), ExpectedWeights(torch.float32))
    assert stats.mismatched == [] and stats.compared > 0 and stats.bytes > 0
    # the engine core runs in a client's child process (the in-process engine's core is in this one)
    assert type(child.llm.llm_engine.engine_core).__name__ == "SyncMPClient"
    assert type(rollout.llm.llm_engine.engine_core).__name__ == "InprocClient"
    ids = [[5, 17, 33, 2, 9], [40, 41], [7]]
    params = SamplingParams(max_new_tokens=8, temperature=1.1)
    a = rollout.generate(ids, params, eos_ids=[hf_model.config.eos_token_id], seeds=[11, 12, 13], logprobs=True)
    b = child.generate(ids, params, eos_ids=[hf_model.config.eos_token_id], seeds=[11, 12, 13], logprobs=True)
    assert [t for t, _ in a] == [t for t, _ in b]
    assert max(abs(x - y) for (_, la), (_, lb) in zip(a, b) for x, y in zip(la, lb)) < 1e-5
    planted = dict(hf_model.named_parameters())
    bad = {n: (t + 0.5 if n.endswith("layers.1.mlp.down_proj.weight") else t) for n, t in planted.items()}
    stats = child.load(bad.items(), ExpectedWeights(torch.float32))  # the engine holds what it was sent ...
    assert stats.mismatched == []
    expected = ExpectedWeights(torch.float32)
    list(expected.tap(planted.items()))  # ... and the check names the tensor that differs from the training one
    results = child.llm.apply_model(functools.partial(check_expected, expected))
    assert any("down_proj" in line for bad_lines, _ in results for line in bad_lines)
    child.close()  # the child process ends and the sync directory goes
    assert not os.path.exists(child._shm.name)


def test_a_sync_writes_new_weights_in_place_and_the_check_names_planted_faults(tmp_path):
    """Weights of another model synced in: vLLM then generates what that model does; a stream that stops short,
    a packed GEMM copy left stale, and a tied head left unpacked are each caught and named."""
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(user_qwen(tmp_path / "a", seed=1), dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(user_qwen(tmp_path / "b", seed=2), dtype=torch.float32).eval()
    r = VLLMRollout(a.config, dtype=torch.float32, settings=VLLMConfig(kv_cache_gib=0.25), seed=0, device=CPU)
    tok = make_user_tokenizer()
    ids, mask = prompts(tok)
    p = SamplingParams(max_new_tokens=8, greedy=True)

    def greedy(src):
        return hf_generate(src, ids, mask, p, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).responses

    gen = VLLMGenerator(r)
    for model in (a, b, a):
        stats = r.load(model.named_parameters(), ExpectedWeights(torch.float32))
        assert stats.mismatched == [] and stats.bytes == sum(t.numel() * 4 for t in model.parameters())
        assert stats.gb_per_s > 0 and stats.tensors == len(list(model.parameters()))
        out = gen.generate(ids, mask, p, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).responses
        want = greedy(model)
        assert torch.equal(out[:, : want.shape[1]], want)

    # a partial sync: the stream ends before the last layer's v_proj and MLP
    named = [(n, t) for n, t in b.named_parameters() if not n.startswith("model.layers.1.")]
    named += [(n, t) for n, t in b.named_parameters() if n.startswith("model.layers.1.self_attn.") and "v_proj" not in n]
    stats = r.load(named, ExpectedWeights(torch.float32))
    text = "\n".join(stats.mismatched)
    assert "model.layers.1.self_attn.qkv_proj.weight: no training tensor reached it" in text
    assert "fused shards [2] of [0, 1, 2] missing" in text
    assert "model.layers.1.mlp.down_proj.weight: no training tensor reached it" in text

    # a stale packed copy: the computation of one fused slice changed after the sync
    exp = ExpectedWeights(torch.float32)
    assert r.load(b.named_parameters(), exp).mismatched == []

    def plant(model):
        layer = model.get_submodule("model.layers.0.mlp.gate_up_proj")
        inner = layer.quant_method.apply
        layer.quant_method.apply = lambda m, x, bias=None: inner(m, x, bias) * 1.0002  # a 2e-4 drift
    r.llm.apply_model(plant)
    bad = r.llm.apply_model(lambda model: check_model(model, exp))[0][0]
    assert any(line.startswith("model.layers.0.mlp.gate_proj.weight: vLLM's model.layers.0.mlp.gate_up_proj.weight[0:128]")
               for line in bad), bad
    r.llm.apply_model(lambda model: model.get_submodule("model.layers.0.mlp.gate_up_proj").quant_method.__dict__.pop("apply"))

    # the tied head left with the previous weights' packing (what vLLM's reload alone does on CPU)
    import engine.vllm_backend as vb

    saved, vb.repack_tied_head = vb.repack_tied_head, lambda model: None
    try:
        stats = r.load(a.named_parameters(), ExpectedWeights(torch.float32))
    finally:
        vb.repack_tied_head = saved
    assert any(line.startswith("model.embed_tokens.weight: vLLM's lm_head (tied to the embedding) computes")
               for line in stats.mismatched), stats.mismatched
    r.llm.apply_model(repack_tied_head)
    assert r.llm.apply_model(lambda model: check_model(model, stats_exp(a)))[0][0] == []


def stats_exp(model) -> ExpectedWeights:
    exp = ExpectedWeights(torch.float32)
    for _ in exp.tap(model.named_parameters()):
        pass
    return exp


def test_train_engine_syncs_after_optimizer_steps_and_lora_merged(user_dir):
    """TrainEngine with engine.generation=vllm: after each optimizer step the next generation phase holds the
    new weights (the check passes, vLLM's greedy tokens are the trained module's); with LoRA the merged ones."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from engine import TrainEngine

    info = init_distributed()
    tok = make_user_tokenizer()
    ids, mask = prompts(tok)
    p = SamplingParams(max_new_tokens=8, greedy=True)
    for lora in (False, True):
        model = AutoModelForCausalLM.from_pretrained(user_dir, dtype=torch.float32)
        if lora:
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     init_lora_weights=False))
        eng = TrainEngine(model, EngineConfig(generation="vllm", precision="fp32", check_weights="every",
                                              vllm=VLLMConfig(kv_cache_gib=0.25)),
                          OptimConfig(lr=1e-2), total_steps=3, info=info)
        for step in range(3):
            with eng.generation() as gen:
                out = gen.generate(ids, mask, p, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            assert gen.name == "vllm" and eng.weight_checks == step + 1
            assert eng.sync_stats.mismatched == [] and eng.sync_stats.compared >= 16
            ref = model.merge_and_unload() if lora and step == 2 else None
            with torch.no_grad():
                src = model if ref is None else ref
                want = hf_generate(src.eval(), ids, mask, p, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id).responses
            assert torch.equal(out.responses[:, : want.shape[1]], want), (lora, step)
            if ref is not None:
                break
            model.train()
            stats = eng.train_step([{"ids": out.sequences}], lambda m, mb: (m(input_ids=mb["ids"], labels=mb["ids"]).loss,
                                                                           1.0, {}))
            assert not stats["skipped"]
        metrics_ = eng.generation_metrics()
        assert metrics_["vllm_sync_bytes"] > 0 and metrics_["mem_generation_peak_gib"] > 0


# ----------------------------------------------------------------------------- refusals


def test_refusals_name_the_key_or_the_model(hf_model):
    from transformers import LlamaConfig

    cfg = hf_model.config
    assert supports(cfg, "cpu") is None
    fake = type(cfg).from_dict({**cfg.to_dict(), "architectures": ["NoSuchModelForCausalLM"]})
    assert "vLLM cannot run architecture NoSuchModelForCausalLM" in supports(fake, "cpu")
    narrow = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
                         num_hidden_layers=1, vocab_size=50)
    assert "no kernel for head size 16" in supports(narrow, "cpu")
    info = init_distributed()
    for kw, match in ((dict(deterministic=True), "engine.deterministic=true with engine.generation=vllm"),
                      (dict(vllm=VLLMConfig(tensor_parallel_size=2)), "engine.vllm.tensor_parallel_size=2"),
                      (dict(vllm=VLLMConfig(kv_cache_gib=0)), "engine.vllm.kv_cache_gib must be > 0")):
        with pytest.raises(ValueError, match=match):
            validate_engine_config(EngineConfig(generation="vllm", **kw), info)


# ----------------------------------------------------------------------------- the RL stage


GRPO = ["algorithm=grpo", "reward.sources=[judge]", "engine.generation=vllm", "engine.precision=fp32",
        "engine.vllm.kv_cache_gib=0.25", "train.eval_every=0", "train.kl_budget=null", "data.num_eval_prompts=8",
        "rollout.prompts_per_step=4", "ppo.old_logprobs=recompute",
        "rollout.temperature=1.2", "rollout.max_new_tokens=12"]


def test_grpo_on_vllm_samples_under_the_trainers_distribution(user_dir, tmp_path):
    """The RL stage through its command line on the user's model: every step's sampler log-probs are the scoring
    pass's at fp32 rounding (gen_logprob_gap_max <= 1e-4), each sync is measured and checked, nothing is
    alarmed, and the summary names the path."""
    out = tmp_path / "grpo"
    run_stage("ppo", f"output_dir={out}", f"actor.model={user_dir}", *GRPO, "train.max_steps=3", fresh=True)
    train = metrics(out, "train")
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["gen_logprob_gap_max"] <= 1e-4 for r in train), [r["gen_logprob_gap_max"] for r in train]
    assert all(r["vllm_sync_bytes"] > 0 and r["vllm_sync_gb_per_s"] > 0 for r in train)
    assert all(r["response_len"] > 0 for r in train)
    s = summary(out)
    assert s["generation_path"] == "vllm" and s["alarms_fired"] == {}


def test_grpo_on_vllm_two_gloo_ranks_zero3(user_dir, tmp_path):
    out = tmp_path / "grpo2"
    run_stage("ppo", f"output_dir={out}", f"actor.model={user_dir}", *GRPO, "engine=zero3", "engine.precision=fp32",
              "train.max_steps=2", torchrun=2)
    train = metrics(out, "train")
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["gen_logprob_gap_max"] <= 1e-4 for r in train), [r["gen_logprob_gap_max"] for r in train]
    assert summary(out)["generation_path"] == "vllm"


def test_split_placement_with_vllm_equals_the_colocated_run(user_dir, tmp_path):
    """engine.placement=split on torchrun 2 ranks: 1 training rank, 1 generation rank whose vLLM engine runs in
    a process of its own (in this one it would create process groups over the whole job, which the trainer never
    joins). Synchronous mode samples the same rows with the same seeds and weights as one colocated process on
    vLLM: the same metrics at every step, to rounding; the generation rank's syncs are measured and checked."""
    args = [f"actor.model={user_dir}", *GRPO, "train.max_steps=2"]
    colocated, split = tmp_path / "colocated", tmp_path / "split"
    run_stage("ppo", f"output_dir={colocated}", *args, fresh=True)
    proc = run_stage("ppo", f"output_dir={split}", *args, "engine.placement=split", "engine.generation_ranks=1",
                     torchrun=2, timeout=600)
    assert "Logging error" not in proc.stderr  # the engine's process is stopped before this one exits
    a, b = metrics(colocated, "train"), metrics(split, "train")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for x, y in zip(a, b):
        assert y["gen_logprob_gap_max"] <= 1e-4 and y["vllm_sync_bytes"] > 0 and y["vllm_sync_gb_per_s"] > 0
        for key in ("reward", "response_len", "actor_loss", "kl", "entropy", "gen_logprob_gap"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key, x[key], y[key])
    s = summary(split)
    assert (s["generation_path"], s["placement"], s["weight_transfers"]) == ("vllm", "split", 2)
    assert s["alarms_fired"] == {}


def test_killed_vllm_run_resumes_exactly(user_dir, tmp_path):
    """SIGKILL inside step 2's checkpoint write, then train.resume=true: the same metrics and weights as the
    uninterrupted run (per-row seeded requests: the resumed steps sample what the first run sampled)."""
    args = [f"actor.model={user_dir}", *GRPO, "train.max_steps=4", "train.save_every=2"]
    whole = tmp_path / "whole"
    run_stage("ppo", f"output_dir={whole}", *args, fresh=True)
    out = tmp_path / "k"
    killed_at("ppo", out, "between_models:2", *args)
    run_stage("ppo", f"output_dir={out}", *args, "train.resume=true", fresh=True)
    assert not leftovers(out)
    keys = ("reward", "kl", "actor_loss", "entropy", "response_len", "gen_logprob_gap")
    assert [[r[k] for k in keys] for r in metrics(out, "train")] == [[r[k] for k in keys] for r in metrics(whole, "train")]
    from safetensors.torch import load_file

    a, b = load_file(whole / "model" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def default_sft(tmp_path_factory):
    """A few SFT steps of the embedded default (its shipped tokenizer and chat template; head size 32)."""
    out = tmp_path_factory.mktemp("default") / "sft"
    run_stage("sft", f"output_dir={out}", "train.max_steps=2", "train.eval_every=0", "train.save_every=0",
              "data.num_eval_prompts=4", fresh=True)
    return out


def test_multi_turn_tool_episodes_on_vllm(default_sft, tmp_path):
    """rollout.env with the calculator: episodes over turns generated by vLLM (each turn's transcript sent whole,
    token ids in and out), observations masked; the step's env metrics count the tool calls."""
    out = tmp_path / "tools"
    run_stage("ppo", f"output_dir={out}", f"actor.model={default_sft}", "algorithm=grpo", "engine.generation=vllm",
              "engine.precision=fp32",
              "engine.vllm.kv_cache_gib=0.25", "rollout.env=rlhf.rl.environments.calculator:Calculator",
              f"data.path={ROOT / 'data/tools/prompts_tools.jsonl'}", "reward.sources=[judge]",
              "train.max_steps=2", "train.eval_every=0", "train.kl_budget=null", "data.num_eval_prompts=4",
              "rollout.prompts_per_step=4", fresh=True)
    train = metrics(out, "train")
    assert [r["step"] for r in train] == [1, 2]
    assert all("turns" in r and r["turns"] >= 1 for r in train), train
    assert summary(out)["generation_path"] == "vllm"
