"""engine.kernels=true: kernels injected into transformers modules keep the model's meaning (logits,
gradients, state-dict names) and touch no other model; the Policy role's fused log-probs equal
log_softmax of the logits; SFT and PPO runs give the same losses with the switch on and off."""
from __future__ import annotations

import pytest
import torch

from conftest import SMALL_MODEL, metrics, run_stage
from engine.kernel_injection import inject_kernels
from rlhf.modeling.roles import Policy


def tiny(kind: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0)
    if kind == "opt":
        cfg = AutoConfig.for_model("opt", ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, **common)
    else:
        cfg = AutoConfig.for_model(kind, intermediate_size=64, num_key_value_heads=2, **common)
    return AutoModelForCausalLM.from_config(cfg).double()


def batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 50, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    return ids, mask, (mask.cumsum(-1) - 1).clamp_min(0)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "opt"])
def test_injected_model_keeps_logits_gradients_and_names(kind):
    plain, fused = tiny(kind), tiny(kind)
    names = inject_kernels(fused)
    assert any(("RMSNorm" in n) if kind != "opt" else ("LayerNorm" in n) for n in names), names
    if kind != "opt":
        assert any("MLP" in n for n in names) and "rotary x2" in names  # one per attention module
    assert list(plain.state_dict()) == list(fused.state_dict())
    ids, mask, pos = batch()
    outs = []
    for m in (plain, fused):
        logits = m(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        logits[mask.bool()].square().sum().backward()
        outs.append((logits.detach(), {k: p.grad.clone() for k, p in m.named_parameters()}))
    (a, ga), (b, gb) = outs
    # (in fp64 too, but transformers' RMSNorm computes in fp32 whatever the input: compare at fp32 level)
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    for k in ga:
        assert ((gb[k] - ga[k]).norm() / ga[k].norm()).item() < 1e-5, k


def test_rotary_kernel_runs_only_in_injected_models(monkeypatch):
    """The rotary kernel replaces a module-level transformers function, yet only the injected
    model's attention calls it: another model in the same process keeps the original code."""
    import kernels

    calls = []
    real = kernels.apply_rotary
    monkeypatch.setattr(kernels, "apply_rotary", lambda *a: calls.append(1) or real(*a))
    injected, plain, other = tiny("llama"), tiny("llama"), tiny("qwen2")
    inject_kernels(injected)
    ids, mask, pos = batch()
    want = plain(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    other(input_ids=ids, attention_mask=mask, position_ids=pos)
    assert calls == []
    got = injected(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert len(calls) == 2  # one per layer
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["llama", "opt"])
@pytest.mark.parametrize("fused", [False, True])
def test_policy_logprobs_equal_log_softmax_of_the_logits(kind, fused):
    """Policy role (fused from hidden states or from the logits): log-probs, entropy, their gradients
    and the summed NLL equal the plain transformers computation (float64)."""
    import torch.nn.functional as F

    model = tiny(kind)
    ids, mask, pos = batch()
    P = 4
    targets = ids[:, P:]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, P - 1 : -1] / 0.7
    want = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    want_ent = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    want.sum().backward()
    want_grad = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    policy = Policy(model, fused=fused)
    logp, ent = policy(ids, mask, pos, targets=targets, start=P - 1, temperature=0.7, with_entropy=True)
    # the fused op keeps the model's float64; the logits path computes in float32 by design
    tol = dict(rtol=1e-10, atol=1e-12) if fused else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logp.double(), want.detach(), **tol)
    torch.testing.assert_close(ent.double(), want_ent.detach(), **tol)
    assert not ent.requires_grad  # entropy is a metric here, never a loss term
    logp.sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grad[k], rtol=1e-8 if fused else 1e-4, atol=1e-12 if fused else 1e-6)
    # reduction="sum": SFT's loss, -100 labels skipped
    labels = ids[:, 1:].clone()
    labels[:, :3] = -100
    full = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    want_nll = F.cross_entropy(full.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    nll = policy(ids, mask, targets=labels, reduction="sum")
    torch.testing.assert_close(nll.double(), want_nll.detach(), rtol=1e-10 if fused else 1e-6, atol=1e-8)
    assert [n for n, _ in policy.named_parameters()] == ["_view_module." + n for n, _ in model.named_parameters()]


SFT = [*SMALL_MODEL, "train.max_steps=4", "train.log_every=1", "train.eval_every=0", "train.save_every=0",
       "data.num_eval_prompts=8", "train.lr=1e-2"]


@pytest.mark.slow
def test_sft_and_ppo_losses_are_the_same_with_kernels_on_and_off(tmp_path):
    for k in ("false", "true"):
        run_stage("sft", f"output_dir={tmp_path / ('sft_' + k)}", *SFT, f"engine.kernels={k}")
    off, on = metrics(tmp_path / "sft_false", "train"), metrics(tmp_path / "sft_true", "train")
    assert len(on) == 4
    # fp32 on this CPU: rounding alone; on CUDA (bf16 compute, the Triton kernels' own reduction order) the
    # tolerance is bf16's, a few units of its 2^-8 rounding averaged over the tokens
    rel = 2e-3 if torch.cuda.is_available() else None
    for a, b in zip(off, on):
        assert b["loss"] == pytest.approx(a["loss"], rel=rel or 1e-5)
    run_stage("reward", f"output_dir={tmp_path / 'rm'}", f"model.name_or_path={tmp_path / 'sft_false'}",
              "model.fallback_to_config=false", "train.max_steps=3", "train.eval_every=0")
    ppo = ["train.max_steps=2", "train.eval_every=0", "rollout.prompts_per_step=8", "rollout.mini_batch_size=8",
           "rollout.micro_batch_size=4", "data.num_eval_prompts=8", "ppo.ptx_coef=0.5",
           f"actor.model={tmp_path / 'sft_false'}", f"critic.model={tmp_path / 'rm'}"]
    for k in ("false", "true"):
        run_stage("ppo", f"output_dir={tmp_path / ('ppo_' + k)}", *ppo, f"engine.kernels={k}")
    off, on = metrics(tmp_path / "ppo_false", "train"), metrics(tmp_path / "ppo_true", "train")
    assert len(on) == 2
    for a, b in zip(off, on):
        for key in ("actor_loss", "critic_loss", "ptx_loss", "kl", "reward", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=rel or 1e-4, abs=1e-6), key
