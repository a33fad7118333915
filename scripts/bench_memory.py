"""Planned (python -m rlhf.plan) vs measured memory of one real SFT training step, same config.

    python scripts/bench_memory.py                                  # tiny default model, CUDA if present
    python scripts/bench_memory.py model=llama model.name_or_path=/models/Llama-3.2-1B engine=zero3 \
        train.micro_batch_size=8 data.max_len=512                   # any SFT overrides

The model is loaded as the SFT stage loads it, wrapped in its Policy role and a TrainEngine; one
optimizer step runs on `train.micro_batch_size` rows of `data.max_len` random tokens (one process:
world size 1). Measured: the engine's memory report (params, grads, optimizer state: these must
equal the plan exactly) and the peak: on CUDA `torch.cuda.max_memory_allocated` over building +
the step; on CPU the growth of the process's peak RSS over the same span (allocator and library
overhead included, so only a rough check of the estimate).
"""
from __future__ import annotations

import os
import resource
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(overrides: list[str]) -> None:
    from engine import TrainEngine, init_distributed
    from engine.memory import fmt_bytes
    from rlhf.config import SFTConfig, compose, to_config
    from rlhf.config.validate import engine_config, optim_config
    from rlhf.modeling.load import load_causal_lm, load_tokenizer
    from rlhf.run.plan import run_plan
    from rlhf.modeling.roles import Policy

    info = init_distributed()
    dev = info.device.type
    report, _ = run_plan(["stage=sft", f"device={dev}", *overrides])
    planned = report["models"]["model"]
    cfg = to_config(compose("sft", overrides), SFTConfig)
    tok = load_tokenizer(cfg.model)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    model = Policy(load_causal_lm(cfg.model, tok, seed=cfg.seed), fused=cfg.engine.kernels)
    engine = TrainEngine(model, engine_config(cfg.engine, info), optim_config(cfg.train), total_steps=2, info=info)
    b, s = cfg.train.micro_batch_size, cfg.data.max_len
    ids = torch.randint(3, len(tok), (b, s), generator=torch.Generator().manual_seed(0))

    def loss_fn(m, mb):
        nll = m(mb["ids"], torch.ones_like(mb["ids"]), targets=mb["ids"][:, 1:], reduction="sum")
        return nll, float(b * (s - 1)), {}

    engine.train_step([{"ids": ids}], loss_fn)
    if dev == "cuda":
        peak, how = torch.cuda.max_memory_allocated() - base, "CUDA max allocated"
    else:
        peak, how = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base, "CPU peak RSS growth"
    got = engine.memory_report()
    print(f"SFT step, {b} x {s} tokens, ZeRO stage {cfg.engine.stage}, {report['precision']} on {dev}, "
          f"{planned['total_params']:,} params\n")
    print(f"| {'':<30} | {'planned':>12} | {'measured':>12} |\n|{'-' * 32}|{'-' * 14}|{'-' * 14}|")
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "model_state_bytes"):
        print(f"| {key:<30} | {fmt_bytes(planned[key]):>12} | {fmt_bytes(got[key]):>12} |")
    print(f"| {'peak (' + how + ')':<30} | {fmt_bytes(report['peak_bytes']):>12} | {fmt_bytes(peak):>12} |")
    exact = all(planned[k] == got[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
    print(f"\nmodel state planned exactly: {exact}; peak measured / planned = {peak / report['peak_bytes']:.2f}")
    if not exact:
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
