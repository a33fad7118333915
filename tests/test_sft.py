"""`python -m rlhf.sft` through its real command line on the shipped default data (small model)."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from conftest import SMALL_MODEL, comparable, killed_at, leftovers, metrics, run_stage, summary

STEPS = 12
BASE = [*SMALL_MODEL, f"train.max_steps={STEPS}", "train.log_every=1", "train.save_every=6", "train.eval_every=6",
        "train.warmup_steps=2", "train.lr=1e-2", "data.num_eval_prompts=20",
        "engine.precision=fp32"]  # compared across ZeRO stages and ranks, where bf16 rounds differently


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "a"
    proc = run_stage("sft", f"output_dir={out}", *BASE)
    return out, proc


def load_safetensors(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def logits_of(model_dir, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_output_directory_is_complete(run_a):
    out, proc = run_a
    for name in ("config.yaml", "metrics.jsonl", "sft.png", "summary.json", "model/config.json", "model/model.safetensors"):
        assert os.path.isfile(out / name), name
    with open(out / "sft.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    s = summary(out)
    assert s["stage"] == "sft" and s["steps"] == STEPS and s["time_s"] > 0
    assert s["gold_score_before"] is not None and s["gold_score_after"] is not None
    # the last thing printed is the summary with both gold scores
    assert "gold_score_before" in proc.stdout and "gold_score_after" in proc.stdout
    assert sorted(os.listdir(out / "checkpoints")) == ["step_0000006", "step_0000012"]


def test_loss_decreases(run_a):
    out, _ = run_a
    losses = [r["loss"] for r in metrics(out, "train")]
    assert len(losses) == STEPS
    assert sum(losses[-3:]) / 3 < 0.85 * sum(losses[:3]) / 3  # 12 steps from a random init
    ev = metrics(out, "eval")
    assert [r["step"] for r in ev] == [0, 6, 12]
    assert ev[-1]["loss"] < ev[0]["loss"]


def test_exported_model_reloads_with_the_trained_weights(run_a):
    # The HF export equals the model state of the final sharded checkpoint, and reloads as a model
    # whose logits are exactly those of that state.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = run_a
    tmp = out / "ckpt.pt"
    dcp_to_torch_save(str(out / "checkpoints" / "step_0000012"), str(tmp))
    trained = torch.load(tmp)["model"]
    exported = load_safetensors(out / "model")
    assert exported and set(exported) <= set(trained)
    for k, v in exported.items():
        assert torch.equal(v, trained[k]), k
    tok = AutoTokenizer.from_pretrained(out / "model")
    ids = torch.tensor([tok("Human: What is 1+2?\n\nAssistant: 3")["input_ids"]])
    model = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    ref = AutoModelForCausalLM.from_config(model.config).eval()
    ref.load_state_dict(trained, strict=False)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_same_seed_same_run(run_a, tmp_path):
    out_a, _ = run_a
    out_b = tmp_path / "b"
    run_stage("sft", f"output_dir={out_b}", *BASE)
    assert [r["loss"] for r in metrics(out_a, "train")] == [r["loss"] for r in metrics(out_b, "train")]
    a, b = load_safetensors(out_a / "model"), load_safetensors(out_b / "model")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("point,extra,complete", [
    ("checkpoint_write:2", [], ["step_0000006"]),  # SIGKILL inside the step-12 checkpoint write
    ("prune:1", ["train.keep_last_n=1"], ["step_0000012"]),  # SIGKILL while deleting step 6 (after step 12's save)
])
def test_killed_run_resumes_exactly(run_a, tmp_path, point, extra, complete):
    from engine import list_checkpoints

    out_a, _ = run_a
    out = tmp_path / "k"
    killed_at("sft", out, point, *BASE, *extra)
    assert [os.path.basename(c) for c in list_checkpoints(out / "checkpoints")] == complete
    run_stage("sft", f"output_dir={out}", *BASE, *extra, "train.resume=true")
    assert not leftovers(out)  # the killed write's (or prune's) leftover is cleaned on the next start
    want = [(r["step"], r["loss"], r["lr"]) for r in metrics(out_a, "train")]
    got = [(r["step"], r["loss"], r["lr"]) for r in metrics(out, "train")]
    assert got == want  # steps kept from before the kill, the rest recomputed bit for bit
    assert comparable(metrics(out, "eval")) == comparable(metrics(out_a, "eval"))
    a, r = load_safetensors(out_a / "model"), load_safetensors(out / "model")
    assert all(torch.equal(a[k], r[k]) for k in a)
    assert summary(out)["gold_score_after"] == summary(out_a)["gold_score_after"]


def test_checkpoints_record_the_run_and_a_changed_resume_says_what_changed(run_a, tmp_path):
    import json

    out_a, _ = run_a
    with open(out_a / "checkpoints" / "step_0000006" / "meta.json") as f:
        meta = json.load(f)["extra_state"]["run"]
    assert meta["world_size"] == 1 and len(meta["config_hash"]) == 16
    assert meta["config"]["train.global_batch_size"] == 32 and meta["config"]["engine.precision"] == "fp32"
    with open(out_a / "checkpoints" / "step_0000006" / "engine.json") as f:
        assert json.load(f) == {"step": 6, "world_size": 1, "stage": 0, "precision": "fp32"}
    out = tmp_path / "r"
    shutil.copytree(out_a, out)
    for gone in ("checkpoints/step_0000012", "model", "summary.json"):
        shutil.rmtree(out / gone) if (out / gone).is_dir() else os.remove(out / gone)
    proc = run_stage("sft", f"output_dir={out}", *BASE, "train.resume=true", "train.lr=2e-2", "train.max_steps=7")
    log = proc.stdout + proc.stderr
    assert "with another setup than the run that saved it" in log
    assert "train.lr: 0.01 -> 0.02" in log and "train.max_steps: 12 -> 7" in log
    assert "train.resume:" not in log  # what a resume changes by design is not listed


def test_a_checkpoint_missing_a_rank_file_is_refused(run_a, tmp_path):
    out_a, _ = run_a
    out = tmp_path / "r"
    shutil.copytree(out_a / "checkpoints", out / "checkpoints")
    os.remove(out / "checkpoints" / "step_0000012" / "rank0.pt")
    proc = run_stage("sft", f"output_dir={out}", *BASE, "train.resume=true", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "error (checkpoint): checkpoint" in proc.stderr and "has no rank0.pt" in proc.stderr


def test_lora_trains_only_adapters_merged_or_not(run_a, tmp_path):
    out_a, _ = run_a
    base_dir = out_a / "model"
    lora = [f"model.name_or_path={out_a}", "model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,v_proj]",
            "train.max_steps=4", "train.save_every=0", "train.eval_every=0", "data.num_eval_prompts=4", "train.lr=1e-2"]
    run_stage("sft", f"output_dir={tmp_path / 'merged'}", *lora)
    run_stage("sft", f"output_dir={tmp_path / 'adapter'}", *lora, "model.lora.merge_on_save=false")
    base, merged = load_safetensors(base_dir), load_safetensors(tmp_path / "merged" / "model")
    assert set(base) == set(merged)
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    # peft initialises lora_B to zero, so step 1 moves only B; after 4 steps every target has moved
    assert changed == {k for k in base if "q_proj" in k or "v_proj" in k}, changed
    assert os.path.isfile(tmp_path / "adapter" / "model" / "adapter_config.json")
    assert not os.path.exists(tmp_path / "adapter" / "model" / "model.safetensors")
    # the adapter directory loads onto its base (merged on load) as the same model as the merged export
    from rlhf.config import ModelConfig
    from rlhf.modeling.load import load_causal_lm, load_tokenizer

    cfg = ModelConfig(name_or_path=str(tmp_path / "adapter"))
    tok = load_tokenizer(cfg)
    m = load_causal_lm(cfg, tok, seed=0).eval()
    ids = torch.tensor([tok("Human: Reverse abc.\n\nAssistant: cba")["input_ids"]])
    with torch.no_grad():
        got = m(input_ids=ids).logits
    torch.testing.assert_close(got, logits_of(tmp_path / "merged" / "model", ids), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, logits_of(base_dir, ids))


def test_bad_value_fails_before_loading_with_the_key(tmp_path):
    proc = run_stage("sft", f"output_dir={tmp_path}", "train.global_batch_size=48", check=False)
    assert proc.returncode == 2
    assert "train.global_batch_size" in proc.stderr and "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "metrics.jsonl")  # nothing ran


def test_a_fresh_run_into_a_finished_run_stops_and_deletes_nothing(run_a):
    out, _ = run_a
    before = sorted(p.name for p in (out / "checkpoints").iterdir()), (out / "model" / "model.safetensors").stat()
    proc = run_stage("sft", f"output_dir={out}", *BASE, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "train.resume=true" in proc.stderr and "train.overwrite=true" in proc.stderr, proc.stderr[-2000:]
    after = sorted(p.name for p in (out / "checkpoints").iterdir()), (out / "model" / "model.safetensors").stat()
    assert after == before and len(metrics(out, "train")) == STEPS  # nothing touched, metrics kept


def test_an_unfinished_stage_output_is_not_a_model_to_start_from(run_a, tmp_path):
    """A killed SFT run's directory (no summary.json) may hold an older model/: the next stage refuses it."""
    out, _ = run_a
    half = tmp_path / "half"
    shutil.copytree(out, half)
    os.remove(half / "summary.json")
    proc = run_stage("reward", f"output_dir={tmp_path / 'rm'}", f"model.name_or_path={half}", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "without summary.json" in proc.stderr and "train.resume=true" in proc.stderr
    assert not (tmp_path / "rm" / "metrics.jsonl").exists()


def test_malformed_data_names_file_line_and_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c"}\n')
    proc = run_stage("sft", f"output_dir={tmp_path / 'o'}", f"data.path={bad}", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{bad}:2" in proc.stderr and "'response'" in proc.stderr and "Accepted SFT shapes" in proc.stderr


def test_cfg_job_prints_the_resolved_config():
    proc = run_stage("sft", "train.lr=0.123", "--cfg", "job")
    assert "lr: 0.123" in proc.stdout and "micro_batch_size:" in proc.stdout and "model_type: llama" in proc.stdout


@pytest.mark.slow
def test_torchrun_zero3_matches_one_process(run_a, tmp_path):
    out_a, _ = run_a
    out = tmp_path / "z3"
    run_stage("sft", f"output_dir={out}", *BASE, "engine=zero3", "train.micro_batch_size=16", "train.save_every=0", torchrun=2)
    one = [r["loss"] for r in metrics(out_a, "train")]
    two = [r["loss"] for r in metrics(out, "train")]
    assert len(two) == STEPS
    assert max(abs(a - b) / abs(a) for a, b in zip(one, two)) <= 1e-5
    a, b = load_safetensors(out_a / "model"), load_safetensors(out / "model")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
