"""`TrainEngine.generation()` with `engine.generation=injected|hf|auto`: the injected model built from
the engine's (possibly sharded) weights gives what `transformers` gives, refreshes in place after a
training step, releases on request, and anything unsupported falls back with one logged reason."""
from __future__ import annotations

import logging

import pytest
import torch

from engine import EngineConfig, OptimConfig, TrainEngine, init_distributed, validate_engine_config
from engine.generation import SamplingParams, hf_generate
from engine.inference.sampling import filter_logits
from engine.vllm_backend import available

EOS, PAD = 2, 0


def tiny(kind: str = "llama", seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    if kind == "opt":
        cfg = OPTConfig(vocab_size=40, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=64, word_embed_proj_dim=32, bos_token_id=1, eos_token_id=EOS,
                        pad_token_id=PAD, dropout=0.0, attention_dropout=0.0)
        return OPTForCausalLM(cfg)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD,
                      tie_word_embeddings=(kind == "llama_tied"))
    return LlamaForCausalLM(cfg)


def prompts():
    ids = torch.tensor([[0, 0, 1, 5, 9], [1, 7, 3, 4, 8], [0, 1, 6, 6, 6]])
    return ids, (ids != 0).long()


def engine_for(model, **cfg) -> TrainEngine:
    return TrainEngine(model, EngineConfig(**cfg), OptimConfig(lr=1e-2, scheduler="constant"), total_steps=4,
                       info=init_distributed())


def lm_loss(model, batch):
    ids = batch["input_ids"]
    logits = model(input_ids=ids).logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
    return loss, ids[:, 1:].numel(), {}


GREEDY = SamplingParams(max_new_tokens=12, greedy=True)


@pytest.mark.parametrize("kind,stage", [("llama", 0), ("llama_tied", 0), ("opt", 0), ("llama", 3)])
def test_injected_greedy_equals_transformers_and_refreshes_after_a_step(kind, stage):
    engine = engine_for(tiny(kind), stage=stage, generation="injected")
    ids, mask = prompts()
    for round_ in range(2):  # before and after a training step: the weights are refreshed in place
        with engine.generation() as gen:
            assert gen.name == "injected"
            out = gen.generate(ids, mask, GREEDY, eos_token_id=EOS, pad_token_id=PAD, return_logprobs=True)
        with engine.gathered_parameters():
            want = hf_generate(engine.unwrapped, ids, mask, GREEDY, eos_token_id=EOS, pad_token_id=PAD, return_logprobs=True)
        assert torch.equal(out.sequences, want.sequences), round_
        assert torch.equal(out.attention_mask, want.attention_mask) and torch.equal(out.response_mask, want.response_mask)
        torch.testing.assert_close(out.logprobs, want.logprobs, rtol=1e-4, atol=1e-5)
        slots = engine._inference.weight_tensors()
        engine.train_step([{"input_ids": torch.randint(3, 40, (4, 10), generator=torch.Generator().manual_seed(round_))}], lm_loss)
    assert all(a is b for a, b in zip(slots, engine._inference.weight_tensors()))  # same storage, refreshed
    assert engine.unwrapped.training


def test_sampling_through_the_injected_path_is_seeded_and_masked():
    engine = engine_for(tiny(), generation="injected")
    ids, mask = prompts()
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9)
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        with engine.generation() as gen:
            outs.append(gen.generate(ids, mask, params, eos_token_id=EOS, pad_token_id=PAD, return_logprobs=True))
    a, b = outs
    assert torch.equal(a.sequences, b.sequences)
    assert (a.logprobs <= 0).all() and (a.logprobs[a.response_mask == 0] == 0).all()
    # the log-prob of each sampled token is the sampler's: log softmax of (logits / T) with top-p's
    # dropped tokens at -inf (renormalised over the kept ones) under the HF model
    with torch.no_grad():
        logits = engine.unwrapped(input_ids=a.sequences, attention_mask=a.attention_mask,
                                  position_ids=(a.attention_mask.cumsum(-1) - 1).clamp_min(0)).logits.float()
    P = ids.shape[1]
    kept = filter_logits((logits[:, P - 1 : -1] / 0.8).flatten(0, 1), 0, 0.9).view(logits[:, P - 1 : -1].shape)
    lp = torch.log_softmax(kept, -1).gather(-1, a.responses[..., None]).squeeze(-1) * a.response_mask
    torch.testing.assert_close(a.logprobs, lp, rtol=1e-4, atol=1e-4)


def test_release_inference_cache_frees_the_injected_model():
    engine = engine_for(tiny(), generation="injected", release_inference_cache=True)
    ids, mask = prompts()
    with engine.generation() as gen:
        gen.generate(ids, mask, GREEDY, eos_token_id=EOS, pad_token_id=PAD)
        assert engine._inference is not None and engine._inference.cache is not None
    assert engine._inference is None


def test_auto_is_hf_off_cuda_and_unmergeable_lora_falls_back_with_a_reason(caplog):
    from peft import LoraConfig, get_peft_model

    caplog.set_level(logging.INFO, logger="engine.train_engine")
    auto = engine_for(tiny(), generation="auto")
    with auto.generation() as gen:
        assert gen.name == ("injected" if torch.cuda.is_available() else "hf")  # engine.generation.AUTO_RULE
    if not torch.cuda.is_available():
        assert any("engine.generation=auto runs transformers generate off CUDA (device cpu): the injected model on "
                   "CUDA" in r.getMessage() for r in caplog.records)
    # plain LoRA reaches the injected model merged (tests/test_weight_check.py); DoRA does not
    lora = get_peft_model(tiny(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True))
    eng = engine_for(lora, generation="injected")
    ids, mask = prompts()
    for _ in range(2):
        with eng.generation() as gen:
            assert gen.name == "hf"
            gen.generate(ids, mask, GREEDY, eos_token_id=EOS, pad_token_id=PAD)
    reasons = [r.getMessage() for r in caplog.records if "generation mode" in r.getMessage()]
    assert sum("LoRA" in m for m in reasons) == 1  # logged once, with the reason


def test_unsupported_architecture_falls_back(caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    caplog.set_level(logging.INFO, logger="engine.train_engine")
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=4, eos_token_id=EOS, pad_token_id=PAD))
    eng = engine_for(model, generation="injected")
    ids, mask = prompts()
    with eng.generation() as gen:
        assert gen.name == "hf"
        out = gen.generate(ids, mask, GREEDY, eos_token_id=EOS, pad_token_id=PAD)
    assert out.sequences.shape[0] == 3
    assert any("falling back" in r.getMessage() and "gpt2" in r.getMessage() for r in caplog.records)


def test_bad_generation_value_names_the_key():
    with pytest.raises(ValueError, match="engine.generation"):
        validate_engine_config(EngineConfig(generation="sglang"), init_distributed())


@pytest.mark.parametrize("lora,precision", [(False, "fp32"), (True, "fp32"), (True, "bf16")])
def test_the_layout_refreshed_in_place_equals_a_fresh_build_and_allocates_nothing(lora, precision):
    """After optimizer steps, the injected model refreshed in place (weights copied into the slots,
    LoRA merged in place for fp32 slots, through one fp32 temporary for bf16 ones) holds bit for bit
    what an InferenceModel built afresh from the same parameters holds, and decodes the same greedy
    tokens; the second and later switches allocate nothing (weights and KV cache kept)."""
    from engine.inference import InferenceModel
    from engine.lora import merge_lora

    model = tiny()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                 init_lora_weights=False))
    # selfcheck off: the first-use check (on by default on CUDA) decodes two probe rows, sizing the cache
    # for them before this test's three; this test counts the refresh's allocations
    engine = engine_for(model, generation="injected", precision=precision, selfcheck="false")
    ids, mask = prompts()
    with engine.generation() as gen:
        gen.generate(ids, mask, GREEDY, eos_token_id=EOS, pad_token_id=PAD)
    inj = engine._inference
    first = (inj.allocations, inj.allocated_bytes, [t.data_ptr() for t in inj.weight_tensors()], inj.cache.k.data_ptr())
    assert inj.allocations == 2 and inj.allocated_bytes == sum(inj.memory_bytes().values())  # weights, then the cache
    for round_ in range(2):
        engine.train_step([{"input_ids": torch.randint(3, 40, (4, 10), generator=torch.Generator().manual_seed(round_))}],
                          lm_loss)
        with engine.generation() as gen:
            out = gen.generate(ids, mask, GREEDY, eos_token_id=EOS, pad_token_id=PAD, return_logprobs=True)
    assert engine._inference is inj and inj.refreshes == 3
    assert (inj.allocations, inj.allocated_bytes, [t.data_ptr() for t in inj.weight_tensors()],
            inj.cache.k.data_ptr()) == first, "a switch after the first re-allocated the weights or the KV cache"
    assert inj.last_refresh["bytes"] == inj.memory_bytes()["weights"]  # every slot written once (tied head: the embedding)
    assert inj.last_refresh["tensors"] == len(inj.named_slots()[1])

    named = merge_lora(engine.named_full_parameters(), engine._lora or {})
    fresh = InferenceModel(engine.unwrapped.config, named, dtype=inj.dtype)
    got, want = inj.named_slots()[0], fresh.named_slots()[0]
    assert sorted(got) == sorted(want)
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"refreshed in place != built afresh: {differ[:4]}"
    if lora:  # the adapters trained: the merged slot is not the base weight
        base = dict(engine.named_full_parameters())["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
        assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"], base.to(inj.dtype))
    from engine.generation import InjectedGenerator

    again = InjectedGenerator(fresh).generate(ids, mask, GREEDY, eos_token_id=EOS, pad_token_id=PAD, return_logprobs=True)
    assert torch.equal(out.sequences, again.sequences) and torch.equal(out.logprobs, again.logprobs)


@pytest.mark.skipif(available() is None,
                    reason="vLLM is installed here: its refusals are tested in the vLLM lane (tests/vllm_lane)")
@pytest.mark.parametrize("stage,args", [
    ("sft", []), ("ppo", ["algorithm=grpo", "reward.sources=[judge]"]), ("evaluate", ["mode=policy"]),
])
def test_vllm_without_vllm_stops_before_any_weights_load(stage, args, tmp_path, tiny_stages):
    """engine.generation=vllm where vLLM is not installed: one line saying how to install it, exit 2, before any
    model loads (no model/ written, no summary.json)."""
    from conftest import run_stage

    model = {"sft": [], "ppo": [f"actor.model={tiny_stages / 'sft'}"],
             "evaluate": [f"model.name_or_path={tiny_stages / 'sft'}"]}[stage]
    out = tmp_path / stage
    proc = run_stage(stage, f"output_dir={out}", "engine.generation=vllm", *model, *args, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "engine.generation=vllm" in line]
    assert len(lines) == 1 and "needs vLLM, which is not installed here" in lines[0]
    assert "scripts/vllm_cpu_venv.sh" in lines[0] and '.[vllm]' in lines[0]
    assert not (out / "model").exists() and not (out / "summary.json").exists()
