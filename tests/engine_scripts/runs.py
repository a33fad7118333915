"""Engine runs for tests/test_engine_dist.py; each phase writes <out>/<phase>.json (rank 0).

    torchrun --nproc_per_node 2 runs.py dist   <out>   every stage config, 2 ranks (+ checkpoints)
    python runs.py single <out>                        1-process references on the global batch
    torchrun --nproc_per_node 2 runs.py resume <out>   fresh processes resume the 2-rank checkpoints
    python runs.py resume_single <out>                 fresh process resumes the 1-process checkpoint
                                                       (and the 2-rank ones: another world size)
    torchrun --nproc_per_node 2 runs.py resume_back <out>  2 ranks resume those 1-process checkpoints

Global batch: GLOBAL rows per optimizer step, step s reads rows [GLOBAL*s, GLOBAL*(s+1)); each rank
takes a contiguous GLOBAL/world slice, split into `accum` micro-batches.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from toy import dataset, loss_fn, rows, tiny_llama  # noqa: E402

from engine import EngineConfig, FrozenEngine, OptimConfig, TrainEngine, exit_process, init_distributed  # noqa: E402

GLOBAL, TOTAL_STEPS, CKPT_AT = 8, 6, 3
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, scheduler="cosine", warmup_steps=2, min_lr_ratio=0.1, grad_clip=1.0)
DATA = dataset()


def micro_batches(step: int, rank: int, world: int, accum: int) -> list[dict]:
    per_rank = GLOBAL // world
    start = GLOBAL * step + per_rank * rank
    m = per_rank // accum
    return [rows(DATA, start + i * m, start + (i + 1) * m) for i in range(accum)]


def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def run(name, out_dir, *, stage, steps, accum=1, lora=False, tied=False, resume_from=None, ckpt=False, save_state=False,
        ckpt_at=CKPT_AT, **engine_kw):
    info = init_distributed()
    model = tiny_llama(lora=lora, tied=tied)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    engine = TrainEngine(model, EngineConfig(stage=stage, **engine_kw), OPTIM, total_steps=TOTAL_STEPS, info=info)
    res = {"losses": [], "grad_norms": [], "lrs": [], "accuracy": [], "weights": []}
    start = 0
    if resume_from:
        start = engine.load_checkpoint(os.path.join(out_dir, resume_from))["data_pos"]
        res["rand_after_ckpt"] = gather(torch.rand(2).tolist())
        res["not_restored"] = engine.not_restored
    for step in range(start, steps):
        out = engine.train_step(micro_batches(step, info.rank, info.world_size, accum), loss_fn)
        for key, v in (("losses", "loss"), ("grad_norms", "grad_norm"), ("lrs", "lr"), ("accuracy", "accuracy"), ("weights", "weight")):
            res[key].append(out[v])
        if ckpt and step + 1 == ckpt_at:
            engine.save_checkpoint(os.path.join(out_dir, f"ckpt_{name}", f"step_{ckpt_at}"), {"data_pos": ckpt_at})
            res["rand_after_ckpt"] = gather(torch.rand(2).tolist())
    res["memory"] = gather(engine.memory_report())
    if save_state or lora:
        sd = engine.full_state_dict()
        if info.is_main:
            torch.save(sd, os.path.join(out_dir, f"{name}_state.pt"))
            res["state_keys_match_plain"] = sorted(sd) == sorted(initial)
            res["changed_keys"] = sorted(k for k in sd if not torch.equal(sd[k], initial[k]))
    return res, engine


def check_gather(engine) -> dict:
    """named_full_parameters == full_state_dict; gathered_parameters unshards once and restores."""
    from torch.distributed.tensor import DTensor

    full = engine.full_state_dict()
    named = {k: v.clone() for k, v in engine.named_full_parameters()}
    batch = rows(DATA, 0, GLOBAL)
    engine.eval()
    with torch.no_grad():
        outside = engine.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        with engine.gathered_parameters():
            whole_inside = not any(isinstance(p, DTensor) for p in engine.unwrapped.parameters())
            inside = engine.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            still_whole = not any(isinstance(p, DTensor) for p in engine.unwrapped.parameters())
            prompt = batch["input_ids"][:2, :5]
            generated = engine.unwrapped.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    sharded_after = all(isinstance(p, DTensor) for p in engine.unwrapped.parameters())
    engine.train()
    res = {
        "whole_inside": whole_inside and still_whole,
        "sharded_after": sharded_after,
        "gathered_forward_equal": torch.equal(outside, inside),
    }
    if full is not None:
        res["named_full_equal"] = sorted(named) == sorted(full) and all(torch.equal(named[k], full[k]) for k in full)
        plain = tiny_llama()
        plain.load_state_dict(full)
        plain.eval()
        want = plain.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        res["generate_equal"] = torch.equal(generated, want)
    return res


def check_frozen(stage: int, offload: bool) -> float:
    """Max |logits| difference between a FrozenEngine and the plain model."""
    info = init_distributed()
    plain = tiny_llama()
    frozen = FrozenEngine(tiny_llama(), EngineConfig(stage=stage, offload=offload), info)
    batch = rows(DATA, 0, GLOBAL)
    with torch.no_grad():
        want = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = frozen.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert not any(p.requires_grad for p in frozen.unwrapped.parameters())
    return (got - want).abs().max().item()


def phase_dist(out_dir: str) -> dict:
    results = {}
    for name, kw in {
        "s0": dict(stage=0, steps=TOTAL_STEPS, ckpt=True),
        "s0_accum2": dict(stage=0, steps=5, accum=2),
        "s1": dict(stage=1, steps=TOTAL_STEPS, ckpt=True),
        "s2": dict(stage=2, steps=TOTAL_STEPS, ckpt=True),
        "s3": dict(stage=3, steps=TOTAL_STEPS, ckpt=True, save_state=True),
        "s3_accum2": dict(stage=3, steps=5, accum=2),
        "s3_offload": dict(stage=3, steps=5, offload=True),
        "s3_ac": dict(stage=3, steps=5, activation_checkpointing=True),
        "s3_lora": dict(stage=3, steps=5, lora=True),
        "s3_tied": dict(stage=3, steps=5, tied=True, save_state=True),
        "s0_lora": dict(stage=0, steps=5, lora=True),
        "s3_bf16": dict(stage=3, steps=5, precision="bf16"),
        "s0_bf16": dict(stage=0, steps=5, precision="bf16"),
    }.items():
        results[name], engine = run(name, out_dir, **kw)
        if name == "s3":
            results["s3_gather"] = check_gather(engine)
        del engine
    results["frozen_max_diff"] = {
        "s0": check_frozen(0, False),
        "s0_offload": check_frozen(0, True),
        "s3": check_frozen(3, False),
        "s3_offload": check_frozen(3, True),
    }
    return results


def phase_single(out_dir: str) -> dict:
    return {
        "ref": run("ref", out_dir, stage=0, steps=TOTAL_STEPS, ckpt=True, save_state=True)[0],
        "ref_lora": run("ref_lora", out_dir, stage=0, steps=5, lora=True)[0],
        "ref_tied": run("ref_tied", out_dir, stage=0, steps=5, tied=True, save_state=True)[0],
    }


def phase_resume(out_dir: str) -> dict:
    return {
        name: run(name, out_dir, stage=stage, steps=TOTAL_STEPS, resume_from=f"ckpt_{src}/step_{CKPT_AT}")[0]
        for name, src, stage in (("s3_resumed", "s3", 3), ("s1_resumed", "s1", 1))
    }


def phase_resume_single(out_dir: str) -> dict:
    out = {"ref_resumed": run("ref_resumed", out_dir, stage=0, steps=TOTAL_STEPS, resume_from=f"ckpt_ref/step_{CKPT_AT}")[0]}
    for s in (0, 2, 3):  # another world size: the 2-rank checkpoints in one process, saving again at step 4
        out[f"w1_s{s}"] = run(f"w1_s{s}", out_dir, stage=s, steps=TOTAL_STEPS, resume_from=f"ckpt_s{s}/step_{CKPT_AT}",
                              ckpt=True, ckpt_at=CKPT_AT + 1)[0]
    return out


def phase_resume_back(out_dir: str) -> dict:
    """2 ranks again, from the 1-process checkpoints of `phase_resume_single` (2 -> 1 -> 2 ranks)."""
    return {f"w2_s{s}": run(f"w2_s{s}", out_dir, stage=s, steps=TOTAL_STEPS, resume_from=f"ckpt_w1_s{s}/step_{CKPT_AT + 1}")[0]
            for s in (0, 2, 3)}


def phase_compile(out_dir: str) -> dict:
    """engine.compile on 2 ranks: ZeRO-3 and stage 0 (DDP) against the same runs eager, then
    generation mode (transformers generate, run eagerly) on the compiled stage-3 model."""
    from engine import compile_seconds

    res = {"s3_eager": run("s3_eager", out_dir, stage=3, steps=5, save_state=True)[0]}
    res["compile_s_before"] = compile_seconds()
    res["s3_compile"], engine = run("s3_compile", out_dir, stage=3, steps=5, save_state=True, compile=True,
                                    generation="hf")
    res["compile_s"] = compile_seconds()
    prompt = rows(DATA, 0, 2)["input_ids"][:, :5]
    with engine.generation() as gen:
        generated = gen.module.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    res["compile_s_after_generate"] = compile_seconds()
    full = engine.full_state_dict()
    if full is not None:
        plain = tiny_llama()
        plain.load_state_dict(full)
        plain.eval()
        res["generate_equal"] = torch.equal(generated, plain.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0))
        eager = torch.load(os.path.join(out_dir, "s3_eager_state.pt"))
        res["state_rel_diff"] = max(((full[k] - eager[k]).norm() / eager[k].norm().clamp_min(1e-12)).item() for k in eager)
    del engine
    res["s0_compile"] = run("s0_compile", out_dir, stage=0, steps=5, compile=True)[0]
    res["s0_eager"] = run("s0_eager", out_dir, stage=0, steps=5)[0]
    return res


PHASES = {"compile": phase_compile, "dist": phase_dist, "single": phase_single, "resume": phase_resume, "resume_single": phase_resume_single,
          "resume_back": phase_resume_back}

if __name__ == "__main__":
    phase, out_dir = sys.argv[1], sys.argv[2]
    torch.use_deterministic_algorithms(True)
    info = init_distributed()
    results = PHASES[phase](out_dir)
    if info.is_main:
        with open(os.path.join(out_dir, f"{phase}.json"), "w") as f:
            json.dump(results, f, indent=1)
    exit_process(0)  # not a plain exit: see engine.distributed.exit_process
