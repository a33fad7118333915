"""engine.max_logits_mb: a policy forward whose float32 [rows, length, vocab] logits would exceed the limit takes
its log-probs and entropy from the hidden states, a [chunk, vocab] slice at a time (kernels.fused_logprobs_entropy),
and gives the logits path's values and gradients; under the limit, or with an adapter on the head, or with top-k /
top-p truncation, the model's own logits are used; a bad value is refused naming the key."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import EngineConfig, validate_engine_config
from engine.distributed import DistInfo
from rlhf.modeling.roles import Policy


def tiny(seed: int = 0, vocab: int = 50):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, num_key_value_heads=2, pad_token_id=0, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg)


def batch(rows: int = 4, length: int = 11, P: int = 4):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 50, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    mask[1, -3:] = 0  # a response that ended early
    return ids, mask, (mask.cumsum(-1) - 1).clamp_min(0), P


def head_calls(policy: Policy) -> list:
    calls = []
    policy.inner.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
    return calls


def run(policy: Policy, ids, mask, pos, P, **kw):
    policy.zero_grad()
    logp, ent = policy(ids, mask, pos, targets=ids[:, P:], start=P - 1, temperature=0.7, with_entropy=True, **kw)
    (logp * mask[:, P:]).sum().backward()
    return logp.detach(), ent, {k: p.grad.clone() for k, p in policy.named_parameters()}


@pytest.mark.parametrize("shared", [False, True])
def test_over_the_limit_the_hidden_states_give_the_logits_values_and_gradients(shared):
    ids, mask, pos, P = batch()
    if shared:  # rows 2 and 3 share row 2's prompt: the shared-prompt forward on both paths
        ids[3, :P], mask[3, :P], pos = ids[2, :P], mask[2, :P], None
    kw = {"prompt_len": P} if shared else {}
    plain, limited = Policy(tiny()), Policy(tiny(), max_logits_mb=3 * 50 * 4 / 2**20)  # 3 rows of logits
    seen_plain, seen_limited = head_calls(plain), head_calls(limited)
    want = run(plain, ids, mask, pos, P, **kw)
    got = run(limited, ids, mask, pos, P, **kw)
    assert seen_plain and seen_limited == []  # the head's module never ran: no [B, T, V] logits
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    for k, g in want[2].items():
        assert ((got[2][k] - g).norm() / g.norm().clamp_min(1e-12)).item() < 1e-5, k


def test_the_summed_nll_over_the_limit_equals_the_logits_cross_entropy():
    ids, mask, pos, _ = batch()
    labels = ids[:, 1:].clone()
    labels[:, :3] = -100
    plain, limited = Policy(tiny()), Policy(tiny(), max_logits_mb=1e-4)
    want = plain(ids, mask, pos, targets=labels, reduction="sum")
    got = limited(ids, mask, pos, targets=labels, reduction="sum")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_under_the_limit_and_where_chunks_cannot_apply_the_model_logits_run():
    ids, mask, pos, P = batch()
    roomy = Policy(tiny(), max_logits_mb=1.0)  # 4 x 7 x 50 x 4 bytes: far under 1 MiB
    calls = head_calls(roomy)
    run(roomy, ids, mask, pos, P)
    assert calls == [1]
    truncated = Policy(tiny(), max_logits_mb=1e-4)  # top-k / top-p need the whole row of logits
    calls = head_calls(truncated)
    truncated(ids, mask, pos, targets=ids[:, P:], start=P - 1, temperature=0.7, truncate=(5, 0.9))
    assert calls == [1]

    class Adapter(nn.Module):  # an adapter on the head (not a plain linear layer): its own forward
        def __init__(self, head: nn.Linear):
            super().__init__()
            self.base, self.extra = head, nn.Linear(head.in_features, head.out_features, bias=False)
            nn.init.zeros_(self.extra.weight)

        def forward(self, x):
            return self.base(x) + self.extra(x)

    model = tiny()
    model.set_output_embeddings(Adapter(model.get_output_embeddings()))
    adapted = Policy(model, max_logits_mb=1e-4)
    calls = head_calls(adapted)
    want = run(Policy(tiny()), ids, mask, pos, P)[0]
    got = run(adapted, ids, mask, pos, P)[0]
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [0, -1.0, "big"])
def test_a_bad_limit_is_refused_naming_the_key(bad):
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), is_main=True)
    with pytest.raises(ValueError, match="engine.max_logits_mb"):
        validate_engine_config(EngineConfig(precision="fp32", max_logits_mb=bad), info)
    validate_engine_config(EngineConfig(precision="fp32", max_logits_mb=None), info)  # null: the model's logits
