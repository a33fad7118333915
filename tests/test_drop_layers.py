"""scripts/drop_layers.py: a smaller model from some of a larger one's decoder layers (the start of a
smaller distillation student, docs/results-log.md "Distillation, measured")."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from conftest import ROOT

spec = importlib.util.spec_from_file_location("drop_layers", ROOT / "scripts/drop_layers.py")
drop_layers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(drop_layers)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A stage-shaped output dir: a random 3-layer Llama in model/, with a tokenizer file beside it."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    root = tmp_path_factory.mktemp("src")
    LlamaForCausalLM(cfg).eval().save_pretrained(root / "model")
    (root / "model" / "tokenizer.json").write_text(json.dumps({"stand-in": True}))
    return root


def test_kept_layers_are_the_sources_and_the_model_runs_as_the_source_without_the_dropped_one(source, tmp_path):
    assert drop_layers.main([str(source), "--keep", "0", "2", "--out", str(tmp_path / "st")]) == 0
    src = AutoModelForCausalLM.from_pretrained(source / "model").eval()
    small = AutoModelForCausalLM.from_pretrained(tmp_path / "st" / "model").eval()
    assert small.config.num_hidden_layers == 2 and len(small.model.layers) == 2
    s_sd, d_sd = src.state_dict(), small.state_dict()
    for new, old in ((0, 0), (1, 2)):  # layer 1 of the small model is the source's layer 2
        for name, value in d_sd.items():
            if name.startswith(f"model.layers.{new}."):
                assert torch.equal(value, s_sd[name.replace(f"layers.{new}.", f"layers.{old}.")]), name
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(d_sd[name], s_sd[name]), name
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in src.parameters())
    # its forward is the source's with layer 1 skipped (the same function, computed by hand)
    ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
    with torch.no_grad():
        h = src.model.embed_tokens(ids)
        pos = torch.arange(ids.shape[1])[None]
        rope = src.model.rotary_emb(h, pos)
        mask = torch.full((ids.shape[1],) * 2, float("-inf")).triu(1)[None, None]
        for i in (0, 2):
            out = src.model.layers[i](h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
            h = out[0] if isinstance(out, tuple) else out
        want = src.lm_head(src.model.norm(h))
        got = small(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # generation with the KV cache (indexed by layer) gives what a full forward per token gives
    with torch.no_grad():
        gen = small.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True, pad_token_id=0)
        seq = ids
        for _ in range(5):
            seq = torch.cat([seq, small(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert gen.tolist() == seq.tolist()
    assert json.loads((tmp_path / "st" / "model" / "tokenizer.json").read_text()) == {"stand-in": True}


@pytest.mark.parametrize("keep", [["0", "3"], ["1", "1"], ["-1"]])
def test_a_bad_layer_index_exits_2_naming_the_range(source, tmp_path, keep, capsys):
    assert drop_layers.main([str(source), "--keep", *keep, "--out", str(tmp_path / "st")]) == 2
    assert "--keep must name distinct layer indices in [0, 2]" in capsys.readouterr().err
    assert not (tmp_path / "st" / "model").exists()
