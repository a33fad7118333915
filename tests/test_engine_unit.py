"""Single-process engine tests: config validation, optimizer groups and schedules, loss scaling,
checkpoint directories, memory formulas, and TrainEngine semantics on a world-size-1 group."""
from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "engine_scripts"))

from toy import TinyNet, tiny_loss_fn  # noqa: E402

from engine import (  # noqa: E402
    DynamicLossScaler,
    EngineConfig,
    OptimConfig,
    TrainEngine,
    atomic_directory,
    format_memory_report,
    init_distributed,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    validate_engine_config,
    validate_optim_config,
)
from engine.memory import zero_formula_bytes  # noqa: E402
from engine.optim import LRSchedule, is_decayed, param_groups  # noqa: E402


@pytest.fixture(scope="module")
def info():
    return init_distributed()


def batch(seed: int, rows: int = 8, seq: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 16, (rows, seq), generator=g)
    labels = torch.randint(0, 16, (rows, seq), generator=g)
    labels[torch.rand(rows, seq, generator=g) < 0.3] = -100  # ragged: a varying number of targets per row
    return {"input_ids": ids, "labels": labels}


def split(b: dict, parts: int) -> list[dict]:
    n = b["input_ids"].shape[0] // parts
    return [{k: v[i * n : (i + 1) * n] for k, v in b.items()} for i in range(parts)]


OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, scheduler="constant", grad_clip=0.0)


# ---------------------------------------------------------------- config validation


@pytest.mark.parametrize(
    "cfg,key",
    [
        (EngineConfig(stage=5), "engine.stage"),
        (EngineConfig(precision="fp8"), "engine.precision"),
        (EngineConfig(precision="fp16"), "engine.precision"),  # no CUDA here
        (EngineConfig(stage=1, offload=True), "engine.offload"),
        (EngineConfig(loss_scale_window=0), "engine.loss_scale_window"),
    ],
)
def test_bad_engine_config_raises_at_construction(info, cfg, key):
    if cfg.precision == "fp16" and torch.cuda.is_available():
        pytest.skip("fp16 is valid on CUDA")
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        validate_engine_config(cfg, info)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        TrainEngine(TinyNet(), cfg, OPTIM, total_steps=1, info=info)


def test_offload_error_names_stage_too(info):
    with pytest.raises(ValueError, match=r"engine\.stage"):
        validate_engine_config(EngineConfig(stage=0, offload=True), info)
    validate_engine_config(EngineConfig(stage=0, offload=True), info, frozen=True)  # FrozenEngine moves by hand


@pytest.mark.parametrize(
    "cfg,key",
    [
        (OptimConfig(scheduler="step"), "optim.scheduler"),
        (OptimConfig(lr=0.0), "optim.lr"),
        (OptimConfig(min_lr_ratio=2.0), "optim.min_lr_ratio"),
        (OptimConfig(grad_clip=-1.0), "optim.grad_clip"),
        (OptimConfig(warmup_steps=-1), "optim.warmup_steps"),
    ],
)
def test_bad_optim_config(cfg, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        validate_optim_config(cfg, total_steps=10)


# ---------------------------------------------------------------- optimizer


def test_precision_auto_follows_the_device(monkeypatch):
    from engine.config import cpu_has_bf16, resolve_precision

    auto = EngineConfig(precision="auto")
    assert resolve_precision(auto, torch.device("cuda")).precision == "bf16"
    assert resolve_precision(EngineConfig(precision="fp32"), torch.device("cuda")).precision == "fp32"  # as written
    assert resolve_precision(auto, torch.device("cpu")).precision == ("bf16" if cpu_has_bf16() else "fp32")
    # a CPU without native bf16 dot products (bf16 emulated, slower than fp32) gets fp32
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert not cpu_has_bf16() and resolve_precision(auto, torch.device("cpu")).precision == "fp32"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert resolve_precision(auto, torch.device("cpu")).precision == "bf16"


def test_weight_decay_groups():
    assert is_decayed("model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 4))
    assert is_decayed("model.embed_tokens.weight", torch.zeros(4, 4))
    assert is_decayed("lm_head.weight", torch.zeros(4, 4))
    assert not is_decayed("model.layers.0.self_attn.q_proj.bias", torch.zeros(4))
    assert not is_decayed("model.layers.0.input_layernorm.weight", torch.zeros(4))
    assert not is_decayed("model.norm.weight", torch.zeros(4))
    assert not is_decayed("transformer.ln_f.scale", torch.zeros(4))  # any 1-d param

    net = TinyNet()
    net.layers[1].proj.requires_grad_(False)  # frozen params stay out of the optimizer
    groups = {g["group"]: g for g in param_groups(net, 0.1)}
    names = {id(p): n for n, p in net.named_parameters()}
    decayed = sorted(names[id(p)] for p in groups["decay"]["params"])
    plain = sorted(names[id(p)] for p in groups["no_decay"]["params"])
    assert decayed == ["embed.weight", "head.weight", "layers.0.proj.weight"]
    assert plain == ["layers.0.norm.bias", "layers.0.norm.weight", "layers.0.proj.bias", "layers.1.norm.bias", "layers.1.norm.weight"]
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0


@pytest.mark.parametrize(
    "scheduler,warmup,total,want",
    [
        ("constant", 2, 6, [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
        # p = (s - 0) / (5 - 0 - 1): 0, 1/4, 1/2, 3/4, 1 (then clamped)
        ("linear", 0, 5, [1.0, 0.775, 0.55, 0.325, 0.1, 0.1]),
        # warmup 1/4 .. 1, then p = (s - 4) / 3
        ("linear", 4, 8, [0.25, 0.5, 0.75, 1.0, 1.0, 0.7, 0.4, 0.1]),
        # cosine: 0.1 + 0.9 * (1 + cos(pi p)) / 2 with p = 0, 1/3, 2/3, 1
        ("cosine", 2, 6, [0.5, 1.0, 1.0, 0.775, 0.325, 0.1]),
    ],
)
def test_schedule_values(scheduler, warmup, total, want):
    f = LRSchedule(scheduler, warmup, total, 0.1)
    assert [f(s) for s in range(len(want))] == pytest.approx(want, abs=1e-12)


def test_engine_lr_follows_schedule(info):
    optim = OptimConfig(lr=0.1, scheduler="cosine", warmup_steps=2, min_lr_ratio=0.1, grad_clip=1.0)
    engine = TrainEngine(TinyNet(), EngineConfig(stage=0), optim, total_steps=6, info=info)
    lrs = [engine.train_step([batch(s)], tiny_loss_fn)["lr"] for s in range(6)]
    assert lrs == pytest.approx([0.05, 0.1, 0.1, 0.0775, 0.0325, 0.01], abs=1e-12)


# ---------------------------------------------------------------- loss scaling


def test_loss_scaler_policy():
    s = DynamicLossScaler(enabled=True, init_scale=1024.0, window=3, min_scale=256.0)
    s.update(True)
    assert s.scale == 512.0 and s.overflows == 1
    for _ in range(2):
        s.update(False)
    assert s.scale == 512.0
    s.update(False)
    assert s.scale == 1024.0  # doubled after `window` clean steps
    s.update(True), s.update(True), s.update(True)
    assert s.scale == 256.0  # floor
    restored = DynamicLossScaler(enabled=True)
    restored.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert restored.state_dict() == s.state_dict()
    off = DynamicLossScaler(enabled=False, init_scale=1024.0)
    off.update(True)
    assert off.scale == 1.0


def test_overflow_skips_step_and_halves_scale(info):
    engine = TrainEngine(TinyNet(), EngineConfig(stage=0), OPTIM, total_steps=10, info=info)
    # fp16 needs CUDA; the scaler logic is precision-independent, so switch it on in fp32.
    engine.scaler = DynamicLossScaler(enabled=True, init_scale=1024.0, window=2)
    before = {k: v.clone() for k, v in engine.unwrapped.state_dict().items()}
    handle = engine.unwrapped.head.weight.register_hook(lambda g: g + float("inf"))
    out = engine.train_step([batch(0)], tiny_loss_fn)
    handle.remove()
    assert out["skipped"] and out["loss_scale"] == 1024.0 and math.isinf(out["grad_norm"])
    assert engine.scaler.scale == 512.0 and engine.skipped_steps == 1
    assert all(torch.equal(v, before[k]) for k, v in engine.unwrapped.state_dict().items())
    assert not engine.optimizer.state  # optimizer untouched
    assert all(p.grad is None for p in engine.unwrapped.parameters())
    for s in range(2):
        assert not engine.train_step([batch(s)], tiny_loss_fn)["skipped"]
    assert engine.scaler.scale == 1024.0

    # a scaled step (power-of-two scale) updates exactly as an unscaled one
    ref = TrainEngine(TinyNet(), EngineConfig(stage=0), OPTIM, total_steps=10, info=info)
    scaled = TrainEngine(TinyNet(), EngineConfig(stage=0), OPTIM, total_steps=10, info=info)
    scaled.scaler = DynamicLossScaler(enabled=True, init_scale=2.0**12, window=100)
    a = ref.train_step([batch(3)], tiny_loss_fn)
    b = scaled.train_step([batch(3)], tiny_loss_fn)
    assert a["loss"] == b["loss"] and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    for (k, p), (_, q) in zip(ref.unwrapped.state_dict().items(), scaled.unwrapped.state_dict().items()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=k)


def test_a_step_with_zero_weight_updates_nothing(info):
    """Every target masked (e.g. every PPO response empty): no optimizer step, though AdamW would
    still move the parameters on its momentum and weight decay; the step is counted as skipped."""
    engine = TrainEngine(TinyNet(), EngineConfig(stage=0), OPTIM, total_steps=10, info=info)
    assert not engine.train_step([batch(0)], tiny_loss_fn)["skipped"]  # momentum now non-zero
    before = {k: v.clone() for k, v in engine.unwrapped.state_dict().items()}
    steps = {k: s["step"].clone() for k, s in engine.optimizer.state.items()}
    lr = engine.scheduler.get_last_lr()
    empty = batch(1)
    empty["labels"][:] = -100
    out = engine.train_step(split(empty, 2), tiny_loss_fn)
    assert out["skipped"] and out["empty"] and out["weight"] == 0 and out["loss"] == 0.0
    assert engine.skipped_steps == 1 and engine.empty_steps == 1
    assert all(torch.equal(v, before[k]) for k, v in engine.unwrapped.state_dict().items())
    assert all(torch.equal(s["step"], steps[k]) for k, s in engine.optimizer.state.items())
    assert engine.scheduler.get_last_lr() == lr
    # and without the guard the same step (zero gradients) would have moved them (the test can fail)
    for p in engine.unwrapped.parameters():
        p.grad = torch.zeros_like(p)
    engine.optimizer.step()
    assert any(not torch.equal(v, before[k]) for k, v in engine.unwrapped.state_dict().items())


# ---------------------------------------------------------------- train_step semantics


@pytest.mark.parametrize("stage", [0, 3])
def test_accumulation_equals_one_big_batch(info, stage):
    cfg = OptimConfig(lr=1e-2, scheduler="constant", grad_clip=1.0)
    one = TrainEngine(TinyNet(), EngineConfig(stage=stage), cfg, total_steps=3, info=info)
    four = TrainEngine(TinyNet(), EngineConfig(stage=stage), cfg, total_steps=3, info=info)
    # one rank: no DDP wrapper at stage 0 (its all-reduce is the identity), so no no_sync either
    assert not isinstance(four.model, torch.nn.parallel.DistributedDataParallel) and (stage or four.model is four.unwrapped)
    for s in range(3):
        a = one.train_step([batch(s)], tiny_loss_fn)
        b = four.train_step(split(batch(s), 4), tiny_loss_fn)  # ragged: micro-batch weights differ
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["weight"] == a["weight"] == a["tokens"]
        w = [int((mb["labels"] != -100).sum()) for mb in split(batch(s), 4)]
        assert b["tokens"] == pytest.approx(sum(x * x for x in w) / sum(w))  # metrics: weighted mean
    for k, v in one.full_state_dict().items():
        torch.testing.assert_close(four.full_state_dict()[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 3])
def test_transformers_blocks_are_recomputed_in_an_eval_mode_engine(info, stage, monkeypatch):
    """engine.activation_checkpointing on a transformers model that the caller keeps in eval() (the RL
    stage does): each block's forward runs twice per train_step (forward, recompute in backward), the
    gradients are those without it, and the blocks are back in eval mode after."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, pad_token_id=0)
    calls = []
    mlp = modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: calls.append(1) or mlp(self, x))
    ids = torch.randint(1, 40, (2, 7), generator=torch.Generator().manual_seed(0))

    def loss(model, mb):
        logits = model(input_ids=mb["ids"]).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb["ids"][:, 1:].flatten(), reduction="sum"), \
            torch.tensor(mb["ids"][:, 1:].numel()), {}

    norms = {}
    for ac in (False, True):
        torch.manual_seed(0)
        engine = TrainEngine(LlamaForCausalLM(cfg), EngineConfig(stage=stage, activation_checkpointing=ac), OPTIM,
                             total_steps=1, info=info)
        engine.eval()
        calls.clear()
        norms[ac] = engine.train_step([{"ids": ids}], loss)["grad_norm"]
        assert len(calls) == (4 if ac else 2), (ac, len(calls))  # 2 layers, recomputed with checkpointing
        assert not any(m.training for m in engine.unwrapped.modules())
    assert norms[True] == pytest.approx(norms[False], rel=1e-5)


@pytest.mark.parametrize("stage", [0, 3])
def test_activation_checkpointing_fallback_keeps_names_clean(info, stage):
    plain = TinyNet()
    keys = sorted(plain.state_dict())
    engine = TrainEngine(TinyNet(), EngineConfig(stage=stage, activation_checkpointing=True), OPTIM, total_steps=2, info=info)
    assert any("_checkpoint_wrapped_module" in n for n, _ in engine.unwrapped.named_parameters())
    ref = TrainEngine(TinyNet(), EngineConfig(stage=stage), OPTIM, total_steps=2, info=info)
    for s in range(2):
        assert engine.train_step([batch(s)], tiny_loss_fn)["loss"] == ref.train_step([batch(s)], tiny_loss_fn)["loss"]
    assert sorted(engine.full_state_dict()) == keys
    assert sorted(n for n, _ in engine.named_full_parameters()) == sorted(n for n, _ in plain.named_parameters())


def test_checkpoint_roundtrip_world1(info, tmp_path):
    def make():
        return TrainEngine(TinyNet(), EngineConfig(stage=3), OptimConfig(lr=1e-2, warmup_steps=1), total_steps=6, info=info)

    a = make()
    for s in range(2):
        a.train_step([batch(s)], tiny_loss_fn)
    a.save_checkpoint(str(tmp_path / "step_2"), {"data_pos": 2, "epoch": 0})
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    want = [a.train_step([batch(s)], tiny_loss_fn)["loss"] for s in range(2, 5)]
    b = make()
    assert b.load_checkpoint(str(tmp_path / "step_2")) == {"data_pos": 2, "epoch": 0}
    assert b.global_step == 2
    got = [b.train_step([batch(s)], tiny_loss_fn)["loss"] for s in range(2, 5)]
    assert got == want
    with pytest.raises(TypeError):
        a.save_checkpoint(str(tmp_path / "bad"), {"x": object()})
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_2")


def test_meta_device_hf_model(info):
    from toy import tiny_llama

    from transformers import LlamaForCausalLM

    plain = tiny_llama()
    with torch.device("meta"):
        model = LlamaForCausalLM(plain.config)
    engine = TrainEngine(model, EngineConfig(stage=3), OPTIM, total_steps=1, info=info)
    assert not any(p.is_meta for p in engine.unwrapped.parameters())
    for (name, b), (_, want) in zip(engine.unwrapped.named_buffers(), plain.named_buffers()):
        assert torch.equal(b, want), name  # rotary inv_freq recomputed, not garbage
    ids = torch.randint(0, 64, (2, 8))

    def lm_loss(model, b):
        out = model(input_ids=b["ids"], labels=b["ids"])
        return out.loss * 7, 7, {}

    assert math.isfinite(engine.train_step([{"ids": ids}], lm_loss)["loss"])


# ---------------------------------------------------------------- checkpoint directories


def _fake_ckpt(root, name: str, step: int | None) -> str:
    path = os.path.join(root, name)
    os.makedirs(path)
    if step is not None:
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump({"step": step}, f)
    return path


def test_listing_ignores_incomplete_and_prune_keeps_last(tmp_path):
    root = str(tmp_path)
    for step in (10, 2, 30):
        _fake_ckpt(root, f"step_{step}", step)
    _fake_ckpt(root, "step_40.tmp-1a2b3c4d", 40)  # killed after meta.json, before the rename
    _fake_ckpt(root, "step_50", None)  # no meta.json: incomplete
    assert list_checkpoints(root) == [os.path.join(root, f"step_{s}") for s in (2, 10, 30)]
    assert latest_checkpoint(root) == os.path.join(root, "step_30")
    assert prune_checkpoints(root, 2) == [os.path.join(root, "step_2")]
    assert list_checkpoints(root) == [os.path.join(root, f"step_{s}") for s in (10, 30)]
    assert prune_checkpoints(root, 0) == []
    assert latest_checkpoint(str(tmp_path / "missing")) is None
    # a prune killed mid-delete leaves a renamed (.tmp-) directory, never a listed half checkpoint
    import shutil

    from engine.checkpoint import remove_leftovers

    real = shutil.rmtree
    shutil.rmtree = lambda path, **kw: (_ for _ in ()).throw(KeyboardInterrupt)  # "killed" inside the delete
    try:
        with pytest.raises(KeyboardInterrupt):
            prune_checkpoints(root, 1)
    finally:
        shutil.rmtree = real
    assert list_checkpoints(root) == [os.path.join(root, "step_30")]
    left = sorted(n for n in os.listdir(root) if ".tmp-" in n)
    assert len(left) == 2 and left[0].startswith("step_10.tmp-")  # + the killed write's step_40.tmp-
    assert sorted(remove_leftovers(root)) == sorted(os.path.join(root, n) for n in left)
    assert sorted(os.listdir(root)) == ["step_30", "step_50"]


def test_atomic_directory(tmp_path):
    target = tmp_path / "export"
    with atomic_directory(str(target)) as tmp:
        assert ".tmp-" in tmp and not target.exists()
        (open(os.path.join(tmp, "a.txt"), "w")).write("1")
    assert (target / "a.txt").read_text() == "1"
    with pytest.raises(RuntimeError):
        with atomic_directory(str(target)) as tmp:
            open(os.path.join(tmp, "b.txt"), "w").write("2")
            raise RuntimeError("killed")
    assert sorted(os.listdir(target)) == ["a.txt"]  # untouched
    with atomic_directory(str(target)) as tmp:
        open(os.path.join(tmp, "c.txt"), "w").write("3")
    assert sorted(os.listdir(target)) == ["c.txt"]  # replaced as a whole
    assert os.listdir(tmp_path) == ["export"]  # no leftovers


# ---------------------------------------------------------------- memory


def test_zero_formulas_and_report(info):
    psi, n = 1000, 4
    assert zero_formula_bytes(0, psi, n) == 16000
    assert zero_formula_bytes(1, psi, n) == 4000 + 3000
    assert zero_formula_bytes(2, psi, n) == 2000 + 3500
    assert zero_formula_bytes(3, psi, n) == 4000
    engine = TrainEngine(TinyNet(), EngineConfig(stage=0), OPTIM, total_steps=1, info=info)
    engine.train_step([batch(0)], tiny_loss_fn)
    r = engine.memory_report()
    numel = sum(p.numel() for p in TinyNet().parameters())
    assert r["trainable_params"] == numel
    assert r["param_bytes"] == r["grad_bytes"] == 4 * numel
    assert r["optimizer_bytes"] >= 8 * numel  # exp_avg + exp_avg_sq (+ step counters)
    text = format_memory_report(r)
    assert "ZeRO stage 0" in text and "16Ψ" in text


def test_more_ranks_than_gpus_on_a_node_is_a_clear_launch_error(monkeypatch, capsys):
    """torchrun --nproc_per_node 2 on a one-GPU node: the rank without a GPU stops with what to start
    instead (not CUDA's 'invalid device ordinal' from deep inside torch), and a stage reports it as
    one line with exit code 2."""
    import engine.distributed as d
    from engine.errors import LaunchError
    from rlhf.run.app import user_errors

    monkeypatch.setattr(d, "_INFO", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("set_device reached"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(LaunchError) as e:
        d.init_distributed()
    msg = str(e.value)
    assert msg.startswith("local rank 1 has no GPU: 2 processes were started on this node but it has 1 CUDA device;")
    assert "torchrun --nproc_per_node 1" in msg and "CUDA_VISIBLE_DEVICES= empty" in msg
    with pytest.raises(SystemExit) as ex, user_errors():
        d.init_distributed()
    assert ex.value.code == 2 and capsys.readouterr().err.startswith("error (launch): local rank 1 has no GPU")
