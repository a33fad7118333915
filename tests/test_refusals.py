"""The refusal table: a mistake at the edges (a reward that cannot arrive, a model in the wrong role, a
value or an extra that cannot work, a pipeline that would fail at a later stage) ends in one line naming
the key, file or URL, exit code 2, and nothing that could be mistaken for a result: no exported model,
no summary.json. Each case fails before any weights load, so each costs seconds."""
from __future__ import annotations

import http.server
import json
import os
import socket
import threading

import pytest

from conftest import ROOT, SMALL_MODEL, cli_env, run_stage

# what a PPO refusal runs with: GRPO (no critic to name), the small prompts of the other PPO tests
PPO = ["algorithm=grpo", "rollout.n_samples_per_prompt=2", "rollout.prompts_per_step=4", "rollout.mini_batch_size=8",
       "rollout.micro_batch_size=8", "train.max_steps=1", "data.num_eval_prompts=4", "alarms.enabled=false"]


def refused(proc, named: str, out=None) -> str:
    """The refusal's one line (the last of stderr): exit 2, no traceback, one error line naming `named`, and
    in `out` (an output_dir) no model and no summary.json."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = lines[-1]
    assert last.startswith(("error (", "rlhf.report: ", "run_all.sh: ")), last
    assert named in last, last
    assert sum(line.startswith(("error (", "rlhf.report: ", "run_all.sh: ")) for line in lines) == 1, lines[-5:]
    if out is not None:
        for result in ("summary.json", "model", "metrics.jsonl", "checkpoints"):
            assert not os.path.exists(os.path.join(out, result)), result
    return last


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NotFound(http.server.BaseHTTPRequestHandler):
    """Another service's answer to every request a reward client makes: 404."""

    def do_GET(self):  # noqa: N802 - http.server's naming
        self.send_error(404, "Not Found")

    do_POST = do_GET  # noqa: N815

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture(scope="module")
def plain_http():
    """A plain-HTTP server that is not a reward server: every path a 404 (as another service's would be)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server.server_address[1]
    server.shutdown()


# ----------------------------------------------------------------------------- a reward that never arrives


@pytest.mark.parametrize("kind", ["never started", "https to plain HTTP", "not a reward server (404)"])
def test_a_reward_that_cannot_arrive_stops_ppo_naming_reward_url(kind, tiny_stages, plain_http, tmp_path):
    url = {"never started": f"http://127.0.0.1:{free_port()}", "https to plain HTTP": f"https://127.0.0.1:{plain_http}",
           "not a reward server (404)": f"http://127.0.0.1:{plain_http}/api"}[kind]
    out = tmp_path / "ppo"
    proc = run_stage("ppo", f"output_dir={out}", f"actor.model={tiny_stages / 'sft'}", *PPO, "reward.sources=[http]",
                     f"reward.url={url}", check=False, timeout=120)
    last = refused(proc, f"reward.url={url}", out)
    assert {"never started": "nothing answers there (ConnectError",
            "https to plain HTTP": "the TLS handshake failed (",
            "not a reward server (404)": "is not a reward server: GET /health answered HTTP 404"}[kind] in last


# ----------------------------------------------------------------------------- a model in the wrong role


def test_a_policy_served_as_the_reward_model_is_refused(tiny_stages, tmp_path):
    pytest.importorskip("fastapi", reason="rlhf.serve needs the serve extra (fastapi, uvicorn)")
    sft = tiny_stages / "sft"
    proc = run_stage("serve", f"output_dir={tmp_path / 'serve'}", f"reward.model={sft}", "server.port=0",
                     check=False, timeout=120)
    last = refused(proc, f"reward.model='{sft}' is a causal LM (a policy: {sft}/model/config.json has "
                         "architectures ['LlamaForCausalLM']), not a reward model", tmp_path / "serve")
    assert last.endswith("e.g. the reward stage's output_dir or a *ForSequenceClassification model")


@pytest.mark.parametrize("key", ["reward.ensemble_models", "reward_model.model"])
def test_a_policy_as_a_reward_model_of_ppo_is_refused(key, tiny_stages, tmp_path):
    sft, rm = tiny_stages / "sft", tiny_stages / "reward"
    models = [f"reward.ensemble_models=[{sft}]", f"critic.model={rm}"] if key == "reward.ensemble_models" else \
        [f"reward_model.model={sft}", f"critic.model={rm}"]
    out = tmp_path / "ppo"
    proc = run_stage("ppo", f"output_dir={out}", f"actor.model={sft}", *PPO, *models, check=False, timeout=120)
    named = f"reward.ensemble_models[0]='{sft}'" if key == "reward.ensemble_models" else f"reward_model.model='{sft}'"
    refused(proc, f"{named} is a causal LM", out)


def test_evaluate_mode_reward_on_a_policy_is_refused(tiny_stages, tmp_path):
    sft = tiny_stages / "sft"
    out = tmp_path / "ev"
    proc = run_stage("evaluate", f"output_dir={out}", f"model.name_or_path={sft}", "mode=reward", check=False,
                     timeout=120)
    refused(proc, f"model.name_or_path (mode=reward)='{sft}' is a causal LM", out)


# ----------------------------------------------------------------------------- what used to be a traceback


def test_kto_rows_of_one_kind_are_refused_naming_the_data(tiny_stages, tmp_path):
    rows = [json.loads(line) for line in open(ROOT / "data/default/eval_prompts.jsonl")][:40]
    data = tmp_path / "kto.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": " " + r["answer"], "label": True}) + "\n"
                            for r in rows))
    out = tmp_path / "dpo"
    proc = run_stage("dpo", f"output_dir={out}", f"model.name_or_path={tiny_stages / 'sft'}", "dpo.loss_type=kto",
                     f"data.path={data}", "data.eval_size=4", "train.max_steps=1", check=False, timeout=120)
    last = refused(proc, f"data.path={data}", out)
    assert "dpo.loss_type=kto needs rows of both kinds: the training rows of" in last
    assert "have 36 desirable and 0 undesirable; add undesirable (label false) rows" in last


def test_serve_without_its_extra_names_the_extra(tmp_path):
    """fastapi hidden (a package on PYTHONPATH that is not importable, as when it is not installed)."""
    shadow = tmp_path / "shadow" / "fastapi"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'fastapi'\", name='fastapi')\n")
    env = {"PYTHONPATH": f"{shadow.parent}{os.pathsep}{ROOT}"}
    proc = run_stage("serve", f"output_dir={tmp_path / 'serve'}", "reward.source=judge", check=False, timeout=120,
                     env=env, fresh=True)
    last = refused(proc, "python -m rlhf.serve needs the fastapi package (the serve extra)", tmp_path / "serve")
    assert last.endswith('pip install -e ".[serve]" (or pip install fastapi uvicorn)')


def test_report_out_under_a_file_names_the_file(tmp_path):
    import subprocess
    import sys

    (tmp_path / "a_file").write_text("x")
    for out, named in [(tmp_path / "a_file" / "sub" / "r.html", f"{tmp_path / 'a_file'} is a file, not a directory"),
                       (tmp_path, f"--out {tmp_path} is a directory")]:
        proc = subprocess.run([sys.executable, "-m", "rlhf.report", str(tmp_path), "--out", str(out)], cwd=ROOT,
                              env=cli_env(), capture_output=True, text=True, timeout=120)
        refused(proc, named)
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


@pytest.mark.parametrize("stage,overrides,named", [
    ("sft", ["engine.deterministic=true", "model.attn_implementation=flex_attention"],
     "engine.deterministic=true cannot make model.attn_implementation=flex_attention deterministic"),
    ("sft", ["model.attn_implementation=flash_attention_2"], "model.attn_implementation=flash_attention_2 runs on CUDA "
                                                             "only"),
    ("reward", ["reward.margin=nan", "model.fallback_to_config=true"], "reward.margin must be a finite number"),
    ("reward", ["reward.margin=-inf", "model.fallback_to_config=true"], "reward.margin must be a finite number"),
])
def test_values_that_cannot_work_are_one_line(stage, overrides, named, tmp_path):
    out = tmp_path / "o"
    proc = run_stage(stage, f"output_dir={out}", *SMALL_MODEL, *overrides, check=False, timeout=120)
    refused(proc, named, out)


def test_deterministic_with_sampled_evaluation_is_said_in_a_warning():
    """Covered by the docs as "not covered": the run goes on, with one warning saying what is not."""
    import logging

    from rlhf.config import SCHEMAS, compose, to_config
    from rlhf.config.validate import deterministic_notes

    cfg = to_config(compose("sft", ["engine.deterministic=true", "eval.greedy=false"]), SCHEMAS["sft"])
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("rlhf").addHandler(handler)
    try:
        deterministic_notes(cfg.engine, cfg.eval)
        deterministic_notes(cfg.engine, to_config(compose("sft", []), SCHEMAS["sft"]).eval)  # greedy: nothing
    finally:
        logging.getLogger("rlhf").removeHandler(handler)
    assert [r.levelname for r in records] == ["WARNING"]
    assert records[0].getMessage().startswith("engine.deterministic=true with eval.greedy=false: the sampled "
                                              "evaluation repeats on this machine and world size, but is not "
                                              "batch-invariant")


# ----------------------------------------------------------------------------- the pipeline checks every stage first


@pytest.mark.parametrize("env,args,stage,named", [
    ({"DRY_RUN": "1"}, ["ppo:ppo.kl_coeff=0.05"], "ppo", "unknown config key 'ppo.kl_coeff'"),
    ({}, ["ppo:ppo.kl_coeff=0.05"], "ppo", "did you mean 'ppo.kl_coef'?"),  # a real run: stopped before SFT starts
    ({"DRY_RUN": "1"}, ["ppo:rollout.mini_batch_size=24"], "ppo", "must be a multiple of rollout.mini_batch_size"),
    ({"DRY_RUN": "1", "PIPELINE": "dpo"}, ["dpo:dpo.loss_type=orpo"], "dpo", "dpo.loss_type must be one of"),
    ({"DRY_RUN": "1", "RM_ENSEMBLE": "2"}, ["reward_2:train.lr=fast"], "reward_2", "config key 'train.lr'"),
    ({"DRY_RUN": "1", "LAUNCH": "torchrun --nproc_per_node 3"}, [], "sft", "x world size (3)"),  # LAUNCH's ranks
    ({"DRY_RUN": "1", "TASK": "tools", "PIPELINE": "dpo"}, [], None, "run_all.sh: TASK=tools runs its own pipeline"),
])
def test_run_all_refuses_a_stage_it_would_fail_at_before_the_first(env, args, stage, named, tmp_path):
    import subprocess

    root = tmp_path / "outputs"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "run_all.sh"), *args], cwd=ROOT, capture_output=True,
                          text=True, env={**cli_env(), "OUTPUT_DIR": str(root), **env}, timeout=120)
    last = refused(proc, named)
    if stage is not None:  # the stage named by its directory (several reward stages in an ensemble)
        kind = stage.split("_")[0]
        assert last.startswith(f"error (configuration/data): the {kind} stage (output_dir={root / stage}) would "
                               "stop: "), last
    assert "== " not in proc.stdout  # no stage was planned, let alone run
    assert not root.exists()  # nothing written


def test_rlhf_check_checks_each_stage_for_the_ranks_it_is_told():
    """python -m rlhf.check, in process: stages split at ---, the batch arithmetic of LAUNCH's world size, and model
    directories that earlier stages will write need not exist yet."""
    import torch

    from engine.distributed import DistInfo
    from rlhf.check import check_stage, split_stages
    from rlhf.core.errors import ConfigError

    assert split_stages(["sft", "a=1", "---", "ppo", "---", "reward", "b=2", "c=3"]) == [
        ("sft", ["a=1"]), ("ppo", []), ("reward", ["b=2", "c=3"])]
    ranks = lambda n: DistInfo(rank=0, world_size=n, local_rank=0, device=torch.device("cpu"), is_main=True)  # noqa: E731
    later = ["output_dir=/nowhere/ppo", "actor.model=/nowhere/sft", "critic.model=/nowhere/reward"]
    check_stage("sft", ["output_dir=/nowhere/sft"], ranks(1))
    check_stage("ppo", later, ranks(2))
    with pytest.raises(ConfigError, match=r"^train.global_batch_size \(32\) must be a multiple of train.micro_batch_size "
                                          r"\(32\) x world size \(3\) = 96"):
        check_stage("sft", ["output_dir=/nowhere/sft"], ranks(3))
    with pytest.raises(ConfigError, match=r"^rollout.prompts_per_step \(64\) must be a multiple of the world size \(3\)"):
        check_stage("ppo", later, ranks(3))
    with pytest.raises(ConfigError, match="rlhf.check checks the stages sft, reward, dpo, ppo, got 'serve'"):
        check_stage("serve", [], ranks(1))
