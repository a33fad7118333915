"""scripts/bench_rl.py (#31) in its smoke form: the RL step's phases timed in a real stage run (the tests'
tiny model, this tree only), the matmul limit measured, and the step's FLOPs counted per forward."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, cli_env

pytestmark = pytest.mark.slow

SMOKE = "python scripts/bench_rl.py --baseline none --steps 2 --reps 1 --algos grpo --small --flops-model none"


def test_documented_smoke_command_is_the_one_run_here():
    doc = (ROOT / "scripts/bench_rl.py").read_text().split('"""')[1]
    assert SMOKE in doc


def test_smoke_run_times_every_phase_and_counts_the_flops(tmp_path):
    out = tmp_path / "bench.json"
    argv = [sys.executable, *SMOKE.split()[1:-2], "--flops-model", "small", "--flops-steps", "2",
            "--work", str(tmp_path / "work"),
            "--json", str(out), "--", "reward.sources=[judge]", "rollout.prompts_per_step=2", "rollout.mini_batch_size=16",
            "rollout.micro_batch_size=8", "rollout.max_new_tokens=6", "engine.precision=fp32"]
    proc = subprocess.run(argv, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "RL step phases, median seconds" in proc.stdout and "matmul" in proc.stdout
    report = json.loads(out.read_text())
    med = report["medians"]["grpo/this"]
    phases = ("generate", "score", "advantages", "update", "overhead")
    assert all(med[p] >= 0 for p in phases) and med["generate"] > 0 and med["update"] > 0, med
    assert med["step"] == pytest.approx(sum(med[p] for p in phases), rel=1e-9)  # one step's phases, one median
    assert report["matmul_flops_per_s"]["fp32"] > 1e6 and report["matmul_flops_per_s"]["bf16"] > 0
    # the counted FLOPs of the second step (ppo.old_logprobs=auto recomputes there: actor + reference
    # forwards; the judge scores without a model), all over the same rows' real tokens T: generate 2NT,
    # score 2 x 2NT, update 6NT (forward + backward)
    flops = {p: v["flops"] for p, v in report["achieved"]["phases"].items()}
    assert flops["generate"] > 0 and flops["advantages"] == 0 and flops["overhead"] == 0, flops
    assert flops["score"] == pytest.approx(2 * flops["generate"], rel=1e-12), flops
    assert flops["update"] == pytest.approx(3 * flops["generate"], rel=1e-12), flops


def test_compute_params_counts_a_tied_head_once_per_use():
    """2 x these parameters = a token's forward FLOPs: the input embedding is a lookup (left out), the
    output head a matmul (counted, also when it shares the embedding's tensor)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_rl import compute_params
    from transformers import LlamaConfig, LlamaForCausalLM

    for tied in (False, True):
        cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
        model = LlamaForCausalLM(cfg)
        # per layer: q, o (16x16), k, v (16x8), gate, up, down (16x24 each), 2 norms (16); final norm 16; head 40x16
        layer = 2 * 16 * 16 + 2 * 16 * 8 + 3 * 16 * 24 + 2 * 16
        assert compute_params(model) == 2 * layer + 16 + 40 * 16, tied


def test_profiler_tables_count_each_phase_own_ops_and_functions(tmp_path):
    """--profile's Profiler: the segments of a phase summed (the ops' calls counted exactly), each phase
    only its own ops and Python functions, the overhead's segment between them, the real-token share."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch
    from bench_rl import Profiler

    def matmuls(n: int) -> None:
        a = torch.ones(8, 8)
        for _ in range(n):
            a @ a

    def sigmoids(n: int) -> None:
        a = torch.ones(8)
        for _ in range(n):
            torch.sigmoid(a)

    prof = Profiler(cuda=False)
    for _ in range(2):  # two steps: update segments of 3 matmuls, overhead segments of 5 sigmoids
        prof.switch("update")
        matmuls(3)
        prof.switch("overhead")
        sigmoids(5)
    prof.switch(None)
    prof.real[:] = [47.0, 50]
    prof.write(str(tmp_path / "p.txt"), "title")
    text = (tmp_path / "p.txt").read_text()
    assert prof.ops["update"]["aten::mm"][0] == 6 and "aten::sigmoid" not in prof.ops["update"], prof.ops["update"]
    assert prof.ops["overhead"]["aten::sigmoid"][0] == 10 and "aten::mm" not in prof.ops["overhead"]
    assert prof.ops["generate"] == {} and prof.wall["generate"] == 0 and prof.wall["update"] > 0
    sections = text.split("\n--- ")
    assert text.startswith("==== title\nthe rollouts' real tokens: 94.0% of their padded rows' positions"), text[:200]
    update = next(s for s in sections if s.startswith("update:"))
    overhead = next(s for s in sections if s.startswith("overhead:"))
    assert "aten::mm" in update and "matmuls" in update and "sigmoids" not in update, update
    assert "aten::sigmoid" in overhead and "sigmoids" in overhead and "matmuls" not in overhead, overhead


def test_eos_spread_plants_the_same_lengths_on_both_generation_paths():
    """--eos-spread's rule (bench_rl.plant_eos): responses end uniformly between N/10 and N, by the same rule
    on the injected decoder (its decode step) and on transformers `generate` (a logits processor): the same
    greedy sequences on both paths, lengths spread over the range (mean about 0.55 N); undone afterwards."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.generation import hf_generate
    from engine.inference import InferenceModel, SamplingParams, generate

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_rl import plant_eos

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128)
    hf = LlamaForCausalLM(cfg).eval()
    model = InferenceModel(cfg, hf.state_dict().items())
    N, B = 40, 64
    ids = torch.randint(3, 290, (B, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    greedy = SamplingParams(max_new_tokens=N, greedy=True)
    free = generate(model, ids, mask, N, pad_token_id=0, sampling=greedy).sequences
    eos = max(set(range(3, 300)) - set(free.flatten().tolist()))  # a token no row says: the ends below are the rule's

    def run():
        return generate(model, ids, mask, N, eos_token_id=eos, pad_token_id=0, sampling=greedy)

    undo = plant_eos(N)
    try:
        inj = run()
        ref = hf_generate(hf, ids[:16], mask[:16], greedy, eos_token_id=eos, pad_token_id=0)
    finally:
        undo()
    assert torch.equal(inj.sequences[:16], ref.sequences) and torch.equal(inj.response_mask[:16].long(), ref.response_mask)
    lengths = inj.response_mask.sum(1)
    assert bool((inj.sequences[torch.arange(B), 5 + lengths - 1] == eos).all())  # every row ends on a planted EOS
    assert lengths.min() >= N // 10 and lengths.max() <= N and len(set(lengths.tolist())) >= 15, lengths
    assert 0.45 < lengths.float().mean().item() / N < 0.65, lengths
    assert run().response_mask.all()  # undone
