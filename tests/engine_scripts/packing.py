"""Packed vs padded training steps for tests/test_packing.py; writes <out>/<world>.json (rank 0).

    torchrun --nproc_per_node 2 packing.py <out>   ZeRO-3 (FSDP2), 2 gloo ranks
    python packing.py <out>                        one process (stage 0), the reference

SFT (Policy, token-sum loss) and reward (ValueModel, pairwise loss) each train STEPS steps from
the same init, padded and packed, on GLOBAL rows per step split over the ranks and into 2
micro-batches per rank (so the loss normalisation runs across packs, accumulation and ranks).
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from test_packing import PAD, pair_rows, sft_rows, tiny  # noqa: E402

from engine import EngineConfig, OptimConfig, TrainEngine, exit_process, init_distributed  # noqa: E402
from rlhf.data import collate_pairs, collate_sft  # noqa: E402
from rlhf.data.packing import pack_pairs, pack_sft  # noqa: E402
from rlhf.modeling.forward import sft_loss
from rlhf.modeling.roles import Policy, ValueModel
from rlhf.reward import make_loss  # noqa: E402

STEPS, ACCUM = 2, 2
OPTIM = OptimConfig(lr=1e-2, scheduler="constant", grad_clip=0.0)


def train(kind: str, packed: bool, info) -> dict:
    if kind == "sft":
        model, rows, loss_fn = Policy(tiny("llama", "lm", seed=3)), sft_rows() + sft_rows(7), sft_loss
        collate = (lambda r: pack_sft(r, PAD, 0)) if packed else (lambda r: collate_sft(r, PAD))
    else:
        model, rows, loss_fn = ValueModel(tiny("llama", "value", seed=3)), pair_rows() + pair_rows(5)[:2], make_loss(0.0, 0.0)
        collate = (lambda r: pack_pairs(r, PAD, 0)) if packed else (lambda r: collate_pairs(r, PAD))
    stage = 3 if info.world_size > 1 else 0
    engine = TrainEngine(model, EngineConfig(stage=stage), OPTIM, total_steps=STEPS, info=info)
    per_step = len(rows) // STEPS
    losses = []
    for step in range(STEPS):
        mine = rows[step * per_step : (step + 1) * per_step][info.rank :: info.world_size]
        m = len(mine) // ACCUM
        out = engine.train_step([collate(mine[i * m : (i + 1) * m]) for i in range(ACCUM)], loss_fn)
        losses.append(out["loss"])
    state = engine.full_state_dict()
    norms = {k: v.double().norm().item() for k, v in state.items()} if info.is_main else None
    return {"losses": losses, "param_norms": norms}


def main() -> None:
    out_dir = sys.argv[1]
    info = init_distributed()
    torch.manual_seed(0)
    results = {f"{kind}_{'packed' if packed else 'padded'}": train(kind, packed, info)
               for kind in ("sft", "reward") for packed in (False, True)}
    if info.is_main:
        with open(os.path.join(out_dir, f"{info.world_size}.json"), "w") as f:
            json.dump(results, f)
    exit_process(0)


if __name__ == "__main__":
    main()
