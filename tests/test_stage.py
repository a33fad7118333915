"""The stage skeleton (rlhf/run/stage.py) on a fake checkpointable state: cadence, resume, skip limit."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from engine.checkpoint import META, write_meta
from rlhf.config import SFTConfig, TrainConfig
from rlhf.core.errors import TrainingError
from rlhf.run.runlog import read_metrics, read_samples
from rlhf.run.stage import Run


class FakeState:
    """Checkpointable: a checkpoint is a directory with meta.json holding extra_state."""

    def __init__(self):
        self.saved: list[tuple[str, dict]] = []

    def save_checkpoint(self, path: str, extra_state: dict) -> None:
        shutil.rmtree(path, ignore_errors=True)  # as the engines' publish: the new one replaces it
        os.makedirs(path)
        write_meta(path, {"step": extra_state["step"], "extra_state": extra_state})
        self.saved.append((os.path.basename(path), extra_state))

    def load_checkpoint(self, path: str) -> dict:
        with open(os.path.join(path, META)) as f:
            return json.load(f)["extra_state"]


def make_run(tmp_path, **train):
    t = TrainConfig(log_every=2, eval_every=3, save_every=2, keep_last_n=2, max_consecutive_skips=2, **train)
    cfg = SFTConfig(output_dir=str(tmp_path), train=t)
    run, _ = Run.open("sft", "SFT", cfg, cfg.train, lambda c, info: None)
    return run


def drive(run, state, evals, total=5, skipped=()):
    def evaluate():
        evals.append(len(evals))
        return {"score": float(len(evals)), "samples": [{"prompt": "p", "response": f"evaluation {len(evals)}"}]}

    run.begin(state, total, evaluate, lambda ev: f"score {ev['score']}", state_fn=lambda: {"extra": 1})
    for step in run.steps():
        run.check({"skipped": step in skipped, "loss": 0.0})
        if run.logs(step):
            run.log_train(step, {"loss": float(step)}, {})
    return run.evaluate_after()


def test_cadence_of_logs_evaluations_and_checkpoints(tmp_path):
    state, evals = FakeState(), []
    run = make_run(tmp_path)
    drive(run, state, evals)
    assert [r["step"] for r in read_metrics(str(tmp_path), "train")] == [2, 4, 5]  # every 2nd and the last
    assert [(r["step"], r["score"]) for r in read_metrics(str(tmp_path), "eval")] == [(0, 1.0), (3, 2.0), (5, 3.0)]
    assert all("samples" not in r for r in read_metrics(str(tmp_path)))
    # each evaluation's samples in samples.jsonl, with its step
    assert [(r["step"], r["response"]) for r in read_samples(str(tmp_path))] == [
        (0, "evaluation 1"), (3, "evaluation 2"), (5, "evaluation 3")]
    assert [name for name, _ in state.saved] == ["step_0000002", "step_0000004", "step_0000005"]
    saved = state.saved[0][1]
    assert {k: v for k, v in saved.items() if k != "run"} == {"step": 2, "before": {"score": 1.0}, "extra": 1}
    assert saved["run"]["world_size"] == 1 and saved["run"]["config"]["train.save_every"] == 2  # what a resume compares
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_0000004", "step_0000005"]  # keep_last_n=2
    out = run.finish({"figure": 1.5}, "model/", [("loss", [("train", "train", "loss")])])
    assert list(out) == ["stage", "time_s", "steps", "figure", "model_dir"] and out["steps"] == 5
    assert (tmp_path / "sft.png").is_file() and json.loads((tmp_path / "summary.json").read_text())["figure"] == 1.5


def test_resume_keeps_the_before_evaluation_and_truncates_metrics(tmp_path):
    state, evals = FakeState(), []
    drive(make_run(tmp_path), state, evals)
    evals.clear()
    run = make_run(tmp_path, resume=str(tmp_path / "checkpoints" / "step_0000004"))
    drive(run, state, evals)
    assert run.start == 4 and run.before == {"score": 1.0} and run.extra_state["extra"] == 1
    assert evals == [0]  # only the final evaluation: "before" came from the checkpoint
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 2, 3, 4, 5, 5]
    # the first run's step-5 samples dropped with its records after step 4; the resumed run's step-5 ones kept
    assert [(r["step"], r["response"]) for r in read_samples(str(tmp_path))] == [
        (0, "evaluation 1"), (3, "evaluation 2"), (5, "evaluation 1")]


def test_consecutive_skipped_steps_stop_the_run(tmp_path):
    drive(make_run(tmp_path), FakeState(), [], skipped={1, 3})  # never two in a row: fine
    with pytest.raises(TrainingError, match="2 consecutive steps"):
        drive(make_run(tmp_path / "b"), FakeState(), [], skipped={2, 3})


def test_a_fresh_run_into_a_previous_run_is_refused_unless_overwrite(tmp_path):
    """Forgetting train.resume=true after a crash must not cost the run: nothing is deleted without
    train.overwrite=true, and the refusal names both keys."""
    from rlhf.config import ConfigError

    drive(make_run(tmp_path), FakeState(), [])
    kept = sorted(os.listdir(tmp_path / "checkpoints"))
    (tmp_path / "model").mkdir()
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"train\.resume=true .* train\.overwrite=true") as e:
        make_run(tmp_path, max_steps=1)
    assert f"checkpoints/{kept[-1]}" in str(e.value) and "summary.json" in str(e.value)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == kept and (tmp_path / "model").is_dir()
    run = make_run(tmp_path, max_steps=1, overwrite=True)  # removed before any model would load
    assert not any((tmp_path / f).exists() for f in ("checkpoints", "model", "summary.json"))
    run.begin(FakeState(), 1, lambda: {}, str)
    assert dataclasses.is_dataclass(run.cfg)
    # resume=auto with nothing to resume from is a fresh run too: refused again over a finished run
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match="summary.json") as e:
        make_run(tmp_path, resume="auto")
    assert "train.resume=true" not in str(e.value)  # no checkpoint: resuming is not a way on


def test_resume_true_needs_a_checkpoint_and_auto_resumes_only_when_there_is_one(tmp_path, caplog):
    """train.resume=true with nothing to resume used to start from scratch with a warning (#29): it is
    refused, naming the key, the directory and train.resume=auto, which resumes when it can."""
    import logging

    from rlhf.config import ConfigError
    from rlhf.run.app import resolve_resume

    root = tmp_path / "checkpoints"
    for value in (True, "true", "True"):
        with pytest.raises(ConfigError) as e:
            resolve_resume(value, str(tmp_path))
        assert str(e.value).startswith("train.resume=true: ") and str(root) in str(e.value)
        assert "train.resume=auto" in str(e.value)
    with caplog.at_level(logging.INFO, logger="rlhf"):
        assert resolve_resume("auto", str(tmp_path)) is None
    assert "train.resume=auto" in caplog.text and "starting fresh" in caplog.text
    drive(make_run(tmp_path), FakeState(), [])  # checkpoints step 4 and 5 (keep_last_n=2)
    assert resolve_resume("auto", str(tmp_path)) == resolve_resume(True, str(tmp_path)) == str(root / "step_0000005")
    assert resolve_resume(False, str(tmp_path)) is None and resolve_resume("false", str(tmp_path)) is None
    run = make_run(tmp_path, resume="auto")
    assert run.resume_path == str(root / "step_0000005")


def test_ranks_that_disagree_on_the_checkpoint_or_config_stop(monkeypatch):
    """Rank 0's view of the resume checkpoint and the config hash against the other ranks': any
    difference is an error (raised on every rank, as every rank sees every view)."""
    from rlhf.config import ConfigError
    from rlhf.run import stage
    from rlhf.run.stage import agree

    cfg = SFTConfig()
    agree("/ckpt/step_4", cfg)  # one process: nothing to disagree with
    views = {}
    monkeypatch.setattr(stage, "all_gather_object", lambda obj: [obj, views["other"]])
    views["other"] = ("/ckpt/step_4", None)
    import hashlib

    from rlhf.config import as_yaml

    same = hashlib.sha256(as_yaml(cfg).encode()).hexdigest()[:16]
    views["other"] = ("/ckpt/step_4", same)
    agree("/ckpt/step_4", cfg)
    views["other"] = ("/ckpt/step_2", same)
    with pytest.raises(ConfigError, match="disagree on the checkpoint to resume from: rank 0: /ckpt/step_4"):
        agree("/ckpt/step_4", cfg)
    views["other"] = ("/ckpt/step_4", "0123456789abcdef")
    with pytest.raises(ConfigError, match="disagree on the configuration"):
        agree("/ckpt/step_4", cfg)


def test_default_micro_batches_fit_two_ranks_and_explicit_ones_are_kept():
    """The defaults (32 rows per forward, 32 per step) run as they are on 2 ranks: the micro-batch is
    lowered to what one rank holds; one that fits is kept, one that cannot divide is still an error."""
    from rlhf.config import ConfigError, PPOConfig, SFTConfig, TrainConfig
    from rlhf.config.validate import validate_train
    from rlhf.config.validate import validate_ppo as check_ppo

    t = SFTConfig().train
    assert validate_train(t, 2) == 1 and t.micro_batch_size == 16
    t = TrainConfig(micro_batch_size=8, global_batch_size=32)
    assert validate_train(t, 2) == 2 and t.micro_batch_size == 8
    with pytest.raises(ConfigError, match="multiple of train.micro_batch_size"):
        validate_train(TrainConfig(micro_batch_size=12, global_batch_size=32), 2)
    cfg = PPOConfig(data=dataclasses.replace(PPOConfig().data, path="prompts.jsonl"))
    for key in ("actor", "critic"):  # ${model.lora} is resolved by to_config; built in Python, set it
        setattr(cfg, key, dataclasses.replace(getattr(cfg, key), lora=cfg.model.lora))
    check_ppo(cfg, SimpleNamespace(world_size=2, device=torch.device("cpu")))
    assert cfg.rollout.micro_batch_size == 16 and cfg.rollout.mini_batch_size == 32


@pytest.mark.parametrize("stop_at,saved,evals_at", [
    (3, ["step_0000002", "step_0000003"], [0, 3]),  # stopped right after an evaluation: it is the final one
    (1, ["step_0000001"], [0, 1]),  # saved although save_every=2 would not have saved step 1
])
def test_stop_saves_a_checkpoint_then_finishes_as_after_the_last_step(tmp_path, stop_at, saved, evals_at):
    state, evals = FakeState(), []
    run = make_run(tmp_path)

    def evaluate():
        evals.append(len(evals))
        return {"score": float(len(evals))}

    run.begin(state, 5, evaluate, lambda ev: "", state_fn=lambda: {"extra": 1})
    for step in run.steps():
        if step + 1 == stop_at:
            run.stop("an alarm")
    ev = run.evaluate_after()
    assert run.stop_reason == "an alarm" and run.total == stop_at
    assert [name for name, _ in state.saved] == saved
    assert [r["step"] for r in read_metrics(str(tmp_path), "eval")] == evals_at and ev["score"] == len(evals_at)
    assert run.finish({}, "model/", [])["steps"] == stop_at


class FakeEngine(FakeState):
    """A TrainEngine stand-in for `Run.loop`: records each step's micro-batches, returns fixed figures."""

    def __init__(self):
        super().__init__()
        self.steps: list[list[dict]] = []
        self.skipped_steps = 0

    def train_step(self, batches: list[dict], loss) -> dict:
        self.steps.append(batches)
        return {"skipped": False, "loss": loss(batches), "lr": 1e-3 * len(self.steps), "unlogged": 7.0}


def test_loop_reads_the_order_rows_and_logs_the_named_figures(tmp_path):
    """`Run.loop`: each step gets `order.rank_rows(step, rank, world, accum)` as micro-batches through
    `batch`, `before_step` runs first, every log step writes `keys` + tokens_per_s + skipped_steps +
    `extra`, and the last record comes back."""
    from rlhf.data.stage import StepOrder

    run, engine = make_run(tmp_path), FakeEngine()
    order, seen = StepOrder(20, global_batch=4, seed=3), []
    run.begin(engine, 5, lambda: {"score": 0.0}, lambda ev: "")

    def batch(rows: list[int]) -> dict:
        ids = torch.ones(len(rows), 3, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "rows": rows}

    last = run.loop(engine, order, 2, batch, lambda bs: float(sum(sum(b["rows"]) for b in bs)), ("loss", "lr"),
                    {"loss": ("loss", ".1f")}, before_step=seen.append, extra=lambda step: {"epoch": step / 5})
    assert seen == [0, 1, 2, 3, 4]
    assert [[b["rows"] for b in bs] for bs in engine.steps] == [order.rank_rows(s, 0, 1, 2) for s in range(5)]
    train = read_metrics(str(tmp_path), "train")
    assert [r["step"] for r in train] == [2, 4, 5]
    for r in train:
        want = float(sum(order.global_rows(r["step"] - 1)))
        assert r["loss"] == want and r["lr"] == pytest.approx(1e-3 * r["step"]) and r["epoch"] == (r["step"] - 1) / 5
        assert r["skipped_steps"] == 0 and r["tokens_per_s"] > 0 and "unlogged" not in r
    assert last == {k: v for k, v in train[-1].items() if k not in ("step", "kind")}
