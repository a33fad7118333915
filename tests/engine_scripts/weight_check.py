"""engine.check_weights under ZeRO-3 on 2 ranks, for tests/test_weight_check.py; each rank writes
<out>/rank<r>.json.

    torchrun --nproc_per_node 2 weight_check.py <out>

pass: two generation phases (around a training step) on each path, checked without error: the
number of checks. fresh (injected path, after the second phase): the layout refreshed in place against
an InferenceModel built afresh from the gathered parameters (every slot bit-equal, the same greedy
tokens), and the injected model's allocation count after the first and the second phase. fault: the same with one element corrupted on rank 1 only (the injected model's
slot after its refresh; the gathered module's parameter on the transformers path): the error each
rank raised, "WeightCheckError: ..." (None if it raised nothing). Every rank must raise and none hang.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from toy import dataset, loss_fn, tiny_llama  # noqa: E402

from engine import EngineConfig, OptimConfig, TrainEngine, exit_process, init_distributed  # noqa: E402
from engine.errors import WeightCheckError  # noqa: E402
from engine.generation import InjectedGenerator, SamplingParams  # noqa: E402


IDS = torch.tensor([[0, 0, 1, 5, 9], [1, 7, 3, 4, 8]])
GREEDY = SamplingParams(max_new_tokens=4, greedy=True)


def generate(engine):
    with engine.generation() as gen:
        return gen.generate(IDS, (IDS != 0).long(), GREEDY, eos_token_id=2, pad_token_id=0)


def fresh_equals_refreshed(engine, refreshed_tokens: torch.Tensor) -> dict:
    """An InferenceModel built afresh from the gathered parameters (collective) vs the engine's,
    refreshed in place: slot by slot, bit for bit, and greedy tokens."""
    from engine.inference import InferenceModel
    from engine.parallelize import hf_base_model

    old = engine._inference
    fresh = InferenceModel(hf_base_model(engine.unwrapped).config, engine.named_full_parameters(), dtype=old.dtype)
    got, want = old.named_slots()[0], fresh.named_slots()[0]

    out = InjectedGenerator(fresh).generate(IDS, (IDS != 0).long(), GREEDY, eos_token_id=2, pad_token_id=0)
    return {"slots_equal": sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want),
            "tokens_equal": torch.equal(out.sequences, refreshed_tokens), "tokens": out.sequences.tolist()}


def build(info, path: str) -> TrainEngine:
    cfg = EngineConfig(stage=3, precision="bf16", generation=path, timeout_s=120)
    return TrainEngine(tiny_llama(), cfg, OptimConfig(lr=1e-2), total_steps=4, info=info)


def batch(info) -> list[dict]:
    data = dataset()
    return [{k: v[4 * info.rank : 4 * info.rank + 4] for k, v in data.items()}]


def main(out: str) -> None:
    info = init_distributed()
    result: dict = {"pass": {}, "fault": {}}
    for path in ("injected", "hf"):
        engine = build(info, path)
        generate(engine)
        allocations = engine._inference.allocations if path == "injected" else None
        engine.train_step(batch(info), loss_fn)
        second = generate(engine)
        result["pass"][path] = engine.weight_checks
        if path == "injected":
            result["allocations"] = [allocations, engine._inference.allocations]
            result["fresh"] = fresh_equals_refreshed(engine, second.sequences)

        corrupt = info.rank == 1
        if path == "injected":
            load = engine._inference.load_weights

            def bad_load(named, strict=True, load=load):
                n = load(named, strict)
                if corrupt:
                    engine._inference.named_slots()[0]["model.layers.1.self_attn.v_proj.weight"][2, 3] += 0.25
                return n

            engine._inference.load_weights = bad_load
        else:
            gathered = engine.gathered_parameters

            @contextlib.contextmanager
            def bad_gather(gathered=gathered, engine=engine):
                with gathered():
                    if corrupt:
                        with torch.no_grad():
                            engine.unwrapped.get_parameter("model.layers.0.mlp.up_proj.weight")[1, 1] += 0.25
                    yield

            engine.gathered_parameters = bad_gather
        try:
            generate(engine)
            result["fault"][path] = None
        except WeightCheckError as e:
            result["fault"][path] = f"WeightCheckError: {e}"
    with open(os.path.join(out, f"rank{info.rank}.json"), "w") as f:
        json.dump(result, f)
    exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1])
