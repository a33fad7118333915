"""`engine.check_weights`: on entering generation mode the generation layout is compared with the
training parameters (engine/weight_check.py). The fingerprint's properties on hand-made tensors; the
pass case on both paths; the three faults of issue #30 (a corrupted weight after the refresh, a LoRA
adapter left unmerged, a stale cache from the previous step), each an error naming the tensor;
`first` checks once, `never` never; ZeRO-3 on 2 gloo ranks (every rank raises)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

import engine.weight_check as wc
from engine import EngineConfig, init_distributed, validate_engine_config
from engine.errors import WeightCheckError
from engine.inference import InferenceModel
from engine.weight_check import agree, fingerprint
from test_generation_mode import EOS, GREEDY, PAD, engine_for, lm_loss, prompts, tiny

SCRIPT = os.path.join(os.path.dirname(__file__), "engine_scripts", "weight_check.py")


def step(engine, seed=0):
    ids = torch.randint(3, 40, (4, 10), generator=torch.Generator().manual_seed(seed))
    return engine.train_step([{"input_ids": ids}], lm_loss)


def generate(engine):
    with engine.generation() as gen:
        return gen.generate(*prompts(), GREEDY, eos_token_id=EOS, pad_token_id=PAD)


# --------------------------------------------------------------------------- the fingerprint


def test_fingerprint_is_the_formula_and_sees_one_element_and_a_permutation():
    x = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    w = [(i * wc.PHI) % 1.0 + 0.5 for i in range(4)]
    assert w == pytest.approx([wc.position_weight(i) for i in range(4)], rel=1e-15)
    want = [2.5, 1.0 * w[0] - 2.0 * w[1] + 3.0 * w[2] + 0.5 * w[3], 6.5]
    torch.testing.assert_close(fingerprint(x), torch.tensor(want, dtype=torch.float64), rtol=1e-15, atol=0)

    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 257, generator=g) * 0.02
    ref = fingerprint(big, torch.bfloat16).tolist()
    one = big.to(torch.bfloat16).clone()
    one[123, 45] = torch.nextafter(one[123, 45].float(), torch.tensor(1.0)).to(torch.bfloat16) * 1.01  # ~1% of one element
    assert not agree(fingerprint(one).tolist(), ref)
    perm = big.to(torch.bfloat16)[torch.randperm(300, generator=g)]  # same values, rows shuffled: same plain sum
    got = fingerprint(perm).tolist()
    assert got[0] == pytest.approx(ref[0], rel=1e-12) and not agree(got, ref)
    assert agree(fingerprint(big.to(torch.bfloat16).T.contiguous().T.contiguous()).tolist(), ref)  # same values, same order
    assert not agree(fingerprint(big.to(torch.bfloat16).T.contiguous()).tolist(), ref)  # a transposed copy


def test_fingerprints_across_chunks_weigh_by_position(monkeypatch):
    monkeypatch.setattr(wc, "CHUNK", 8)
    monkeypatch.setattr(wc, "_WEIGHTS", {})
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(2), dtype=torch.float64)  # 35 elements, 5 chunks
    flat = x.reshape(-1).tolist()
    want = [sum(flat), sum(v * wc.position_weight(j) for j, v in enumerate(flat)), sum(abs(v) for v in flat)]
    torch.testing.assert_close(fingerprint(x), torch.tensor(want, dtype=torch.float64), rtol=1e-13, atol=0)
    parts = fingerprint(x[:2], offset=0) + fingerprint(x[2:], offset=14)  # a shard starting mid-chunk
    assert agree(parts.tolist(), want)
    swapped = x.reshape(-1).clone()
    swapped[[3, 11]] = swapped[[11, 3]]  # the same chunk-local position in two chunks
    assert not agree(fingerprint(swapped).tolist(), want)


def test_shard_fingerprints_add_up_to_the_whole_and_the_cast_is_applied():
    x = torch.randn(10, 6, generator=torch.Generator().manual_seed(1))
    whole = fingerprint(x, torch.bfloat16)
    parts = fingerprint(x[:4], torch.bfloat16, 0) + fingerprint(x[4:], torch.bfloat16, 4 * 6)
    assert agree(parts.tolist(), whole.tolist())
    assert torch.equal(whole, fingerprint(x.to(torch.bfloat16)))
    assert not agree(fingerprint(x).tolist(), whole.tolist())  # fp32 values are not their bf16 copy


def test_bad_value_names_the_key():
    validate_engine_config(EngineConfig(check_weights="first"), init_distributed())
    with pytest.raises(ValueError, match=r"engine\.check_weights must be one of \('every', 'first', 'never'\)"):
        validate_engine_config(EngineConfig(check_weights="always"), init_distributed())


def test_the_stage_config_rejects_a_bad_value_naming_the_key():
    from rlhf.config import ConfigError, SFTConfig, compose, to_config
    from rlhf.config.validate import validate_sft

    assert to_config(compose("sft", []), SFTConfig).engine.check_weights == EngineConfig().check_weights
    with pytest.raises(ConfigError, match=r"engine\.check_weights"):
        validate_sft(to_config(compose("sft", ["engine.check_weights=sometimes"]), SFTConfig), init_distributed())


# --------------------------------------------------------------------------- pass cases


@pytest.mark.parametrize("kind,stage,precision", [("llama", 0, "fp32"), ("llama_tied", 3, "bf16"), ("opt", 3, "fp32")])
def test_injected_layout_fingerprints_equal_the_parameters(kind, stage, precision):
    engine = engine_for(tiny(kind), stage=stage, generation="injected", precision=precision)
    for i in range(2):
        generate(engine)  # checked on entry, before and after a step
        step(engine, i)
    assert engine.weight_checks == 2
    # the same comparison by hand: every slot's fingerprint equals its parameter's, cast to the slot dtype
    generate(engine)
    slots, required = engine._inference.named_slots()
    dtype = engine._inference.dtype
    assert dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    compared = 0
    for name, p in engine.named_full_parameters():
        assert agree(fingerprint(slots[name]).tolist(), fingerprint(p, dtype).tolist()), name
        compared += 1
    assert compared == len(required)  # every slot but a tied LM head (the embedding itself)


def test_hf_path_compares_the_gathered_module_with_its_shards():
    engine = engine_for(tiny("opt"), stage=3, generation="hf", precision="bf16")
    generate(engine)
    step(engine)
    generate(engine)
    assert engine.weight_checks == 2
    plain = engine_for(tiny(), stage=0, generation="hf")  # generate runs on the training module itself
    generate(plain)
    assert plain.weight_checks == 1


def test_lora_reaches_the_injected_model_merged_and_is_checked():
    from peft import LoraConfig, get_peft_model

    from engine.generation import hf_generate

    model = get_peft_model(tiny(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    engine = engine_for(model, generation="injected")
    ids, mask = prompts()
    with engine.generation() as gen:
        assert gen.name == "injected"
        out = gen.generate(ids, mask, GREEDY, eos_token_id=EOS, pad_token_id=PAD, return_logprobs=True)
    with torch.no_grad():
        want = hf_generate(engine.unwrapped, ids, mask, GREEDY, eos_token_id=EOS, pad_token_id=PAD, return_logprobs=True)
    assert torch.equal(out.sequences, want.sequences)
    torch.testing.assert_close(out.logprobs, want.logprobs, rtol=1e-4, atol=1e-5)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    merged = q.base_layer.weight + q.scaling["default"] * q.lora_B["default"].weight @ q.lora_A["default"].weight
    slots, _ = engine._inference.named_slots()
    torch.testing.assert_close(slots["model.layers.0.self_attn.q_proj.weight"], merged, rtol=0, atol=1e-6)
    assert engine.weight_checks == 1


# --------------------------------------------------------------------------- faults


@contextlib.contextmanager
def corrupting_load(monkeypatch, name, index=(3, 5)):
    """After each refresh, one element of the slot `name` is changed by ~1% (a bad copy)."""
    load = InferenceModel.load_weights

    def bad_load(self, named, strict=True):
        n = load(self, named, strict)
        slot = self.named_slots()[0][name]
        slot[index] = slot[index] * 1.01 + 1e-3
        return n

    monkeypatch.setattr(InferenceModel, "load_weights", bad_load)
    yield


@pytest.mark.parametrize("stage", [0, 3])
def test_a_corrupted_generation_weight_is_caught_naming_it(monkeypatch, stage):
    engine = engine_for(tiny(), stage=stage, generation="injected")
    generate(engine)
    name = "model.layers.1.self_attn.k_proj.weight"  # a slice of the fused wqkv slot
    with corrupting_load(monkeypatch, name), pytest.raises(WeightCheckError) as err:
        generate(engine)
    msg = str(err.value)
    assert f"{name}: generation layout (sum" in msg and "!= training parameter (sum" in msg
    assert "1 tensors differ" in msg  # q_proj and v_proj, the other rows of the same fused slot, still agree


def test_a_corrupted_gathered_weight_on_the_hf_path_is_caught(monkeypatch):
    engine = engine_for(tiny(), stage=3, generation="hf")
    gathered = engine.gathered_parameters

    @contextlib.contextmanager
    def bad_gather():
        with gathered():
            p = engine.unwrapped.get_parameter("model.layers.0.mlp.down_proj.weight")
            with torch.no_grad():
                p[0, 0] += 0.5
            yield

    monkeypatch.setattr(engine, "gathered_parameters", bad_gather)
    with pytest.raises(WeightCheckError, match=r"model\.layers\.0\.mlp\.down_proj\.weight: generation layout"):
        generate(engine)


def test_a_lora_adapter_left_unmerged_is_caught_naming_the_layer(monkeypatch):
    from peft import LoraConfig, get_peft_model

    import engine.train_engine as te

    model = get_peft_model(tiny(), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    assert model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.abs().sum() > 0
    engine = engine_for(model, generation="injected")

    def base_weights_only(named, layers, lazy=False):  # the adapter never reaches the rollout model (verl #7495)
        for name, t in named:
            if ".lora_" not in name:
                yield name.replace(".base_layer.", "."), t

    monkeypatch.setattr(te, "merge_lora", base_weights_only)
    with pytest.raises(WeightCheckError) as err:
        generate(engine)
    msg = str(err.value)
    assert "model.layers.0.self_attn.q_proj.weight: generation layout" in msg
    assert "model.layers.1.self_attn.q_proj.weight: generation layout" in msg and "2 tensors differ" in msg


def test_a_stale_generation_cache_from_the_previous_step_is_caught(monkeypatch):
    engine = engine_for(tiny(), generation="injected")
    generate(engine)
    assert step(engine)["skipped"] is False
    monkeypatch.setattr(InferenceModel, "load_weights", lambda self, named, strict=True: 0)  # the refresh copies nothing
    with pytest.raises(WeightCheckError) as err:
        generate(engine)
    msg = str(err.value)
    n_params = sum(1 for _ in engine.unwrapped.parameters())
    assert f"on rank 0 ({n_params} tensors differ)" in msg  # every parameter moved in the step, none was copied
    assert "model.embed_tokens.weight: generation layout" in msg  # the first of them, with both fingerprints


# --------------------------------------------------------------------------- every, first, never


@pytest.mark.parametrize("mode,checks", [("every", 3), ("first", 1), ("never", 0)])
def test_first_checks_once_and_never_never(monkeypatch, mode, checks):
    calls = []
    real = wc.fingerprint
    monkeypatch.setattr(wc, "fingerprint", lambda *a, **k: calls.append(1) or real(*a, **k))
    engine = engine_for(tiny(), generation="injected", check_weights=mode)
    per_check = None
    for i in range(3):
        generate(engine)
        per_check = per_check or len(calls)
        step(engine, i)
    assert engine.weight_checks == checks
    n_slots = len(engine._inference.named_slots()[0])  # a layout fingerprint and an expected one per tensor
    assert len(calls) == checks * 2 * n_slots


# --------------------------------------------------------------------------- ZeRO-3, 2 gloo ranks


@pytest.mark.slow
def test_zero3_on_two_ranks_checks_consistently_and_every_rank_raises(tmp_path):
    from test_engine_dist import _free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), SCRIPT, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, got in enumerate(ranks):
        assert got["pass"] == {"injected": 2, "hf": 2}, (r, got)
        # the layout refreshed in place after a ZeRO-3 step = one built afresh; the refresh allocated nothing
        assert got["fresh"]["slots_equal"] and got["fresh"]["tokens_equal"], (r, got["fresh"])
        assert got["allocations"][0] == got["allocations"][1] == 2, (r, got["allocations"])  # weights + KV cache
        for path in ("injected", "hf"):
            err = got["fault"][path]
            assert err is not None and err.startswith("WeightCheckError"), (r, path, err)
    # the corruption was made on rank 1 only: rank 1 names the tensor, rank 0 raises pointing at it
    assert "model.layers.1.self_attn.v_proj.weight: generation layout" in ranks[1]["fault"]["injected"]
    assert "another rank" in ranks[0]["fault"]["injected"]
    assert "model.layers.0.mlp.up_proj.weight: generation layout" in ranks[1]["fault"]["hf"]
    assert "another rank" in ranks[0]["fault"]["hf"]
