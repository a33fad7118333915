"""Planned (python -m rlhf.plan) vs measured memory of real SFT training steps, same config.

    python scripts/bench_memory.py                                  # tiny default model, CUDA if present
    python scripts/bench_memory.py model=llama model.name_or_path=/models/Llama-3.2-1B engine=zero3 \
        train.micro_batch_size=8 data.max_len=512                   # any SFT overrides
    python scripts/bench_memory.py data.packing=true data.pack_length=0    # the micro-batch packed in one row

The model is loaded as the SFT stage loads it, wrapped in its Policy role and a TrainEngine given the row width
the stage gives it; `--steps` optimizer steps (2 by default: the first creates the optimizer state) run on
`train.micro_batch_size` rows of `data.max_len` random tokens each (the plan's worst case: every row full), batched
as the SFT stage batches them (rlhf/sft.py: packed per data.packing / data.pack_length where the model packs,
else padded), through the stage's loss (one process: world size 1). Measured: the engine's memory report
(params, grads, optimizer state: these must equal the plan exactly) and the peak: on CUDA
`torch.cuda.max_memory_allocated` over building + the steps, against the plan without the CUDA context; on the
CPU the process's peak RSS (ru_maxrss: Python, torch and the planner included, as the plan's own process
memory is), against the whole plan.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2, help="optimizer steps (the peak is over all of them)")
    args, overrides = p.parse_known_args(argv)
    from engine import TrainEngine, init_distributed
    from engine.memory import fmt_bytes
    from rlhf.config import SFTConfig, compose, to_config
    from rlhf.config.validate import engine_config, optim_config
    from rlhf.data import collate_sft
    from rlhf.data.packing import pack_sft, packs, widest_row
    from rlhf.modeling.forward import sft_loss
    from rlhf.modeling.load import load_causal_lm, load_tokenizer, packing_support, stage_pack_length
    from rlhf.modeling.roles import Policy
    from rlhf.run.plan import run_plan

    info = init_distributed()
    dev = info.device.type
    report, _ = run_plan(["stage=sft", f"device={dev}", *overrides])
    planned = report["models"]["model"]
    cfg = to_config(compose("sft", overrides), SFTConfig)
    d, tok = cfg.data, load_tokenizer(cfg.model)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    model = Policy(load_causal_lm(cfg.model, tok, seed=cfg.seed), fused=cfg.engine.kernels,
                   max_logits_mb=cfg.engine.max_logits_mb)
    pack_len = stage_pack_length(d, packing_support(model))
    engine = TrainEngine(model, engine_config(cfg.engine, info), optim_config(cfg.train), total_steps=args.steps,
                         info=info, row_tokens=widest_row(d, pack_len))
    b, s = cfg.train.micro_batch_size, d.max_len
    gen = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, len(tok), (b, s), generator=gen).tolist()]
    packed = packs([s] * b, pack_len, d.packing == "auto")
    batch = pack_sft(rows, tok.pad_token_id, pack_len) if packed else collate_sft(rows, tok.pad_token_id)
    for _ in range(args.steps):
        engine.train_step([batch], sft_loss)
    if dev == "cuda":
        peak, how, plan = torch.cuda.max_memory_allocated() - base, "CUDA max allocated", report["peak_bytes"]
    else:
        peak, how, plan = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "CPU peak RSS", report["peak_bytes"]
    got = engine.memory_report()
    layout = f"packed {list(batch['input_ids'].shape)}" if packed else "padded"
    print(f"SFT, {args.steps} steps of {b} x {s} tokens ({layout}), ZeRO stage {cfg.engine.stage}, "
          f"{report['precision']} on {dev}, {planned['total_params']:,} params\n")
    print(f"| {'':<30} | {'planned':>12} | {'measured':>12} |\n|{'-' * 32}|{'-' * 14}|{'-' * 14}|")
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "model_state_bytes"):
        print(f"| {key:<30} | {fmt_bytes(planned[key]):>12} | {fmt_bytes(got[key]):>12} |")
    print(f"| {'peak (' + how + ')':<30} | {fmt_bytes(plan):>12} | {fmt_bytes(peak):>12} |")
    exact = all(planned[k] == got[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
    print(f"\nmodel state planned exactly: {exact}; plan / measured peak = {plan / peak:.2f}")
    if not exact:
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
