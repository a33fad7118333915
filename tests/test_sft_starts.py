"""`starts.n`: several starts of the SFT stage compared by held-out loss after `starts.steps`, the best
continued (rlhf/run/stage.py Run.best_start)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import comparable, metrics, run_stage, summary
from test_sft import BASE, load_safetensors

STARTS = ["starts.n=3", "starts.steps=6"]


@pytest.fixture(scope="module")
def starts_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("starts") / "s"
    run_stage("sft", f"output_dir={out}", *BASE, *STARTS)
    return out


def test_the_lowest_held_out_loss_is_continued(starts_run):
    with open(starts_run / "starts.json") as f:
        found = json.load(f)
    seeds = [s["seed"] for s in found["starts"]]
    assert seeds == [1234, 2234, 3234] and found["steps"] == 6
    losses = [s["eval_loss"] for s in found["starts"]]
    assert len(set(losses)) == 3  # three different starts, not one three times
    assert found["chosen_seed"] == seeds[losses.index(min(losses))]
    s = summary(starts_run)
    assert s["start_seed"] == found["chosen_seed"] and s["starts"] == found["starts"] and s["steps"] == 12
    # the step-6 evaluation logged for the run is the chosen start's, the one it was chosen by
    ev = {r["step"]: r for r in metrics(starts_run, "eval")}
    assert sorted(ev) == [0, 6, 12] and ev[6]["loss"] == min(losses)
    assert not os.path.exists(starts_run / "starts")  # the scratch checkpoints of the starts are gone


def test_the_continued_start_is_the_run_of_its_seed(starts_run, tmp_path):
    # the chosen start, continued from its checkpoint, equals the plain run with its seed: every
    # logged figure, the samples and the exported weights
    chosen = summary(starts_run)["start_seed"]
    plain = tmp_path / "plain"
    run_stage("sft", f"output_dir={plain}", *BASE, f"seed={chosen}")
    assert comparable(metrics(starts_run)) == comparable(metrics(plain))
    with open(starts_run / "samples.jsonl") as a, open(plain / "samples.jsonl") as b:
        assert a.read() == b.read()
    a, b = load_safetensors(starts_run / "model"), load_safetensors(plain / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert summary(starts_run)["gold_score_after"] == summary(plain)["gold_score_after"]


def test_a_resumed_run_keeps_the_chosen_start(starts_run, tmp_path):
    # a copy of the run cut back to its step-6 checkpoint (the chosen start's, where the starts ended)
    # resumes with that start's data order and ends as the uninterrupted run
    import shutil

    out = tmp_path / "r"
    shutil.copytree(starts_run, out)
    shutil.rmtree(out / "checkpoints" / "step_0000012")
    shutil.rmtree(out / "model")
    os.remove(out / "summary.json")
    run_stage("sft", f"output_dir={out}", *BASE, *STARTS, "train.resume=true")
    assert comparable(metrics(out)) == comparable(metrics(starts_run))
    a, b = load_safetensors(starts_run / "model"), load_safetensors(out / "model")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert summary(out)["start_seed"] == summary(starts_run)["start_seed"]


@pytest.mark.parametrize("extra,words", [
    (["starts.n=0"], "starts.n is the number of starts"),
    (["starts.n=2", "starts.steps=0"], "starts.steps is how many steps"),
    (["starts.n=2", "starts.steps=12"], "starts.steps=12"),
    (["starts.n=2", "starts.steps=6", "data.eval_size=0"], "held-out loss"),
])
def test_bad_starts_are_refused_naming_the_key(tmp_path, extra, words):
    proc = run_stage("sft", f"output_dir={tmp_path / 'bad'}", *BASE, *extra, check=False)
    assert proc.returncode != 0 and words in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_two_ranks_under_zero3_choose_and_train_as_one_process(starts_run, tmp_path):
    out = tmp_path / "z3"
    run_stage("sft", f"output_dir={out}", *BASE, *STARTS, "engine=zero3", "train.micro_batch_size=16", torchrun=2)
    assert summary(out)["start_seed"] == summary(starts_run)["start_seed"]
    for one, two in zip(summary(starts_run)["starts"], summary(out)["starts"]):
        assert one["seed"] == two["seed"] and abs(one["eval_loss"] - two["eval_loss"]) <= 1e-5 * one["eval_loss"]
    one, two = [r["loss"] for r in metrics(starts_run, "train")], [r["loss"] for r in metrics(out, "train")]
    assert len(two) == 12 and max(abs(a - b) / abs(a) for a, b in zip(one, two)) <= 1e-5


def test_a_run_over_a_previous_one_keeps_nothing_of_it(starts_run, tmp_path):
    # train.overwrite=true into a directory a run with starts left: the same starts again log exactly their own
    # records (not the previous run's too), and a run of one start reports no starts
    import shutil

    out = tmp_path / "o"
    shutil.copytree(starts_run, out)
    run_stage("sft", f"output_dir={out}", *BASE, *STARTS, "train.overwrite=true")
    assert comparable(metrics(out)) == comparable(metrics(starts_run))
    with open(out / "samples.jsonl") as a, open(starts_run / "samples.jsonl") as b:
        assert a.read() == b.read()
    run_stage("sft", f"output_dir={out}", *BASE, "train.overwrite=true")
    assert "start_seed" not in summary(out) and not os.path.exists(out / "starts.json")
    assert [r["step"] for r in metrics(out, "eval")] == [0, 6, 12]


def test_starts_on_a_users_own_model_data_and_adapter(tmp_path):
    # a user's OPT with its own byte-pair tokenizer and chat template, their own message rows (system turn
    # included) with their own held-out rows, LoRA: the starts differ (the adapter's initialisation and the
    # data order), the lowest held-out loss is continued, and the result is the plain run of its seed
    import random

    from safetensors.torch import load_file
    from test_user_model import LORA, user_model_dir, vocab

    user = user_model_dir(tmp_path)
    rng, words = random.Random(0), ["cat", "dog", "sun", "tree", "moon", "fish", "bird", "rain"]
    with open(tmp_path / "mine.jsonl", "w") as f:
        for _ in range(64):
            w = rng.choice(words) + str(rng.randrange(100))
            f.write(json.dumps({"messages": [{"role": "system", "content": "Answer tersely."},
                                             {"role": "user", "content": f"Say {w} twice."},
                                             {"role": "assistant", "content": f"{w} {w}"}]}) + "\n")
    common = [f"model.name_or_path={user}", f"data.path={tmp_path / 'mine.jsonl'}", "data.eval_size=16",
              "train.max_steps=6", "train.save_every=0", "train.eval_every=3", "train.lr=1e-2",
              "train.micro_batch_size=8", "train.global_batch_size=8", "engine.precision=fp32", *LORA]
    run_stage("sft", f"output_dir={tmp_path / 's'}", *common, "starts.n=3", "starts.steps=3")
    found = summary(tmp_path / "s")
    losses = [s["eval_loss"] for s in found["starts"]]
    assert len(set(losses)) == 3 and found["start_seed"] == found["starts"][losses.index(min(losses))]["seed"]
    assert "gold_score" not in found["starts"][0]  # no gold judge for the user's rows: judged by loss alone
    run_stage("sft", f"output_dir={tmp_path / 'p'}", *common, f"seed={found['start_seed']}")
    adapter = {d: load_file(tmp_path / d / "model" / "adapter_model.safetensors") for d in "sp"}
    assert adapter["s"].keys() == adapter["p"].keys() and all(torch.equal(adapter["s"][k], adapter["p"][k])
                                                                for k in adapter["s"])
    assert vocab(tmp_path / "s" / "model") == vocab(user)
    assert comparable(metrics(tmp_path / "s")) == comparable(metrics(tmp_path / "p"))
