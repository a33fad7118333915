"""engine.compile: torch.compile per transformer block (engine/parallelize.py compile_blocks) on 2
gloo ranks, ZeRO-3 (FSDP2) and stage 0 (DDP), against the same runs eager (tests/engine_scripts/runs.py
phase `compile`). Inductor compiles C++ on the CPU: ~40-90 s for the tiny Llama, hence one launch."""
from __future__ import annotations

import os

import pytest

from test_engine_dist import _launch, _rel, _wait_all

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import json

    out = str(tmp_path_factory.mktemp("compile_runs"))
    _wait_all({"compile": _launch("compile", out, 2)})
    with open(os.path.join(out, "compile.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("stage", [3, 0])
def test_compiled_blocks_train_as_eager(runs, stage):
    got, ref = runs[f"s{stage}_compile"], runs[f"s{stage}_eager"]
    assert len(got["losses"]) == 5
    # inductor may reorder a reduction: equal to fp32 rounding, not bit for bit
    assert _rel(got["losses"], ref["losses"]) <= 1e-5
    assert _rel(got["grad_norms"], ref["grad_norms"]) <= 1e-4
    assert got["weights"] == ref["weights"]


def test_compiled_model_keeps_names_and_parameters(runs):
    assert runs["s3_compile"]["state_keys_match_plain"]  # no `_orig_mod.` in exported names
    assert runs["state_rel_diff"] <= 1e-4  # after 5 steps, per tensor


def test_compile_time_is_measured_and_generation_stays_eager(runs):
    assert runs["compile_s_before"] == 0.0  # the eager run compiled nothing
    assert runs["compile_s"] > 0.0  # dynamo + inductor, forward and backward (inductor's disk cache may be warm)
    # transformers generate on the compiled model runs under the force_eager stance: no new graph
    assert runs["compile_s_after_generate"] == runs["compile_s"]
    assert runs["generate_equal"]  # same tokens as the plain model with the same weights


def test_sft_stage_with_compile_reports_compile_time(tmp_path):
    """`engine.compile=true` through the stage's command line: the same losses and exported weights as
    the eager run (fp32), and summary.json's compile_s (absent without compile)."""
    from safetensors.torch import load_file

    from conftest import SMALL_MODEL, metrics, run_stage, summary

    base = [*SMALL_MODEL, "train.max_steps=4", "train.log_every=1", "train.eval_every=0", "data.num_eval_prompts=8",
            "train.lr=1e-2", "engine.precision=fp32"]
    run_stage("sft", f"output_dir={tmp_path / 'eager'}", *base)
    run_stage("sft", f"output_dir={tmp_path / 'compiled'}", *base, "engine.compile=true")
    eager, compiled = (metrics(tmp_path / name, "train") for name in ("eager", "compiled"))
    assert len(eager) == len(compiled) == 4
    assert _rel([r["loss"] for r in compiled], [r["loss"] for r in eager]) <= 1e-5
    assert "compile_s" not in summary(tmp_path / "eager")
    s = summary(tmp_path / "compiled")
    assert 0 < s["compile_s"] < s["time_s"]
    a, b = (load_file(str(tmp_path / name / "model" / "model.safetensors")) for name in ("eager", "compiled"))
    assert sorted(a) == sorted(b)  # the export's names: no `_orig_mod.`
    assert max(((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-12)).item() for k in a) <= 1e-4
