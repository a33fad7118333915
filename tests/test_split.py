"""engine.placement=split: training and generation ranks in one torchrun job (rlhf/rl/split.py, engine/weight_stream.py).

The protocol's arithmetic and the options' validation in-process; then on 2 gloo ranks (1 trainer + 1 generator):
sync (max_staleness 0) equals the colocated 1-rank run of the same seed and samples, the weights received are the
trainer's (bytes; the receiver's fingerprint check runs on every transfer), the same job as two "nodes" on the
loopback address equals one node, and an async run whose generator hangs stops with a message naming the rank and
the phase within engine.timeout_s."""
from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from engine.config import EngineConfig
from engine.distributed import DistInfo, Placement
from engine.weight_stream import plan_buckets
from rlhf.config import PPOConfig, SFTConfig
from rlhf.config.validate import engine_config, validate_sft, validate_split
from rlhf.core.errors import ConfigError
from rlhf.rl import split
from rlhf.rl.old_logprobs import OldLogprobs

from conftest import ROOT, cli_env, comparable, metrics, run_stage, summary

INFO = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), is_main=True)


# --------------------------------------------------------------------------- the protocol's arithmetic


@pytest.mark.parametrize("k,start,total,versions", [
    (0, 0, 4, [0, 1, 2, 3]),     # sync: step s sampled with the weights after step s-1
    (1, 0, 4, [0, 0, 1, 2]),     # one step off
    (2, 0, 5, [0, 0, 0, 1, 2]),
    (2, 2, 6, [2, 2, 2, 3]),     # resumed at step 2: nothing older than the checkpoint's weights exists
])
def test_policy_version_of_each_step(k, start, total, versions):
    assert [split.version_for(s, start, k) for s in range(start, total)] == versions
    assert split.last_needed_version(total, start, k) == versions[-1]  # versions after it are never sent


def test_generators_serve_trainers_round_robin():
    p = Placement(role="train", world_rank=0, trainer_ranks=(0, 1, 2), generator_ranks=(3, 4), train_group=None,
                  stream_group=None)
    assert [split.served_by(t, p) for t in range(3)] == [3, 4, 3]
    assert split.trainers_of(3, p) == [0, 2] and split.trainers_of(4, p) == [1]
    assert split.describe_rank(p, 4) == "rank 4 (generator)"


def test_buckets_pack_consecutive_tensors_up_to_the_size():
    # 4-byte elements, 100-byte buckets: 40 | 80 + 20 | 400 alone (larger than a bucket) | 4
    assert plan_buckets([10, 20, 5, 100, 1], 4, 100) == [[0], [1, 2], [3], [4]]
    assert plan_buckets([10, 20, 5], 4, 1 << 30) == [[0, 1, 2]]
    assert plan_buckets([], 4, 100) == []


def test_async_recomputes_the_old_logprobs():
    cfg = PPOConfig()
    cfg.rollout.mode, cfg.rollout.max_staleness = "async", 1
    assert OldLogprobs(cfg.ppo, cfg.rollout).mode == "recompute"  # the version trained, not the sampler's
    cfg.rollout.max_staleness = 0
    assert OldLogprobs(cfg.ppo, cfg.rollout).mode == "auto"


# --------------------------------------------------------------------------- the options


@pytest.mark.parametrize("change,key", [
    ({"rollout.mode": "later"}, "rollout.mode"),
    ({"rollout.max_staleness": -1}, "rollout.max_staleness"),
    ({"rollout.max_staleness": 1.5}, "rollout.max_staleness"),
    ({"rollout.mode": "async"}, "engine.placement=split"),  # async needs split ranks
    ({"engine.placement": "split", "engine.generation": "injected"}, "engine.generation=injected"),
    ({"engine.placement": "split", "rollout.mode": "async", "ppo.old_logprobs": "sampler"}, "ppo.old_logprobs=sampler"),
])
def test_bad_split_options_name_the_key(change, key):
    cfg = PPOConfig()
    for path, value in change.items():
        group, name = path.split(".")
        setattr(getattr(cfg, group), name, value)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_split(cfg)


def test_good_split_options_pass():
    cfg = PPOConfig()
    cfg.engine.placement, cfg.rollout.mode, cfg.rollout.max_staleness = "split", "async", 3
    validate_split(cfg)  # no error
    cfg.rollout.max_staleness = 0
    validate_split(cfg)
    cfg.engine.generation = "vllm"  # a vLLM engine per generation rank, in a process of its own (tests/vllm_lane)
    validate_split(cfg)


@pytest.mark.parametrize("field,value,key", [
    ("placement", "spread", "engine.placement"), ("generation_ranks", 0, "engine.generation_ranks"),
    ("generation_ranks", True, "engine.generation_ranks"), ("weight_bucket_mb", 0, "engine.weight_bucket_mb"),
])
def test_bad_engine_split_options(field, value, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        engine_config(EngineConfig(**{field: value}), INFO)


def test_split_is_refused_by_the_other_stages():
    cfg = SFTConfig()
    cfg.engine.placement = "split"
    with pytest.raises(ConfigError, match="engine.placement=split.*rlhf.ppo"):
        validate_sft(cfg, INFO)


# --------------------------------------------------------------------------- 2 gloo ranks

ARGS = ["train.max_steps=2", "train.save_every=0", "train.eval_every=0", "rollout.prompts_per_step=8",
        "rollout.mini_batch_size=8", "rollout.micro_batch_size=4", "data.num_eval_prompts=8", "actor.lr=1e-2",
        "engine.deterministic=true",  # per-row sampling streams: the same tokens on whichever rank samples them
        "engine.precision=fp32"]  # on every host (auto runs bf16 on a CPU with native bf16): the equalities are fp32's
SPLIT_ONLY = ("policy_version", "staleness", "weights_", "sampler_s")
# the sampler's own log-probs (a separate module copy on the generation rank) agree to float rounding only
ROUNDING = ("gen_logprob_gap", "alarm_gen_gap", "gen_kl", "alarm_gen_kl")


def ppo_args(stages, out):
    return [f"output_dir={out}", f"actor.model={stages / 'sft'}", f"critic.model={stages / 'reward'}", *ARGS]


def same_metrics(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(comparable(a), comparable(b)):
        x = {k: v for k, v in x.items() if not k.startswith(SPLIT_ONLY)}
        y = {k: v for k, v in y.items() if not k.startswith(SPLIT_ONLY)}
        for k in ROUNDING:
            if k in x:
                assert abs(x.pop(k) - y.pop(k)) < 1e-6, k
        assert x == y


@pytest.fixture(scope="module")
def sync_runs(tiny_stages, tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    run_stage("ppo", *ppo_args(tiny_stages, root / "colocated"))
    run_stage("ppo", *ppo_args(tiny_stages, root / "split"), "engine.placement=split", torchrun=2)
    return root


def test_split_sync_equals_the_synchronous_run(sync_runs, tiny_stages):
    from transformers import AutoModelForCausalLM

    same_metrics(metrics(sync_runs / "colocated"), metrics(sync_runs / "split"))
    s = summary(sync_runs / "split")
    assert s["placement"] == "split" and s["rollout_mode"] == "sync" and s["staleness_counts"] == {"0": 2}
    assert [r["policy_version"] for r in metrics(sync_runs / "split", "train")] == [0, 1]
    # every transfer was checked on arrival (fingerprints); its bytes are the actor's fp32 parameters
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_stages / "sft" / "model").parameters())
    assert s["weights_bytes"] == 4 * n and s["weight_transfers"] == 2 and s["rollouts_discarded"] == 0
    assert summary(sync_runs / "colocated")["gold_score_after"] == s["gold_score_after"]


def test_two_nodes_on_loopback_equal_one_node(sync_runs, tiny_stages):
    """torchrun --nnodes 2 --nproc_per_node 1, c10d rendezvous on 127.0.0.1: the same job as 1 node x 2."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = sync_runs / "two_nodes"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "split-test",
           "-m", "rlhf.ppo", *ppo_args(tiny_stages, out), "engine.placement=split"]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [n.communicate(timeout=600) for n in nodes]
    for n, (o, e) in zip(nodes, outs):
        assert n.returncode == 0, f"a node exited {n.returncode}:\n{e[-4000:]}"
    same_metrics(metrics(sync_runs / "split"), metrics(out))
    assert summary(out)["gold_score_after"] == summary(sync_runs / "split")["gold_score_after"]


def test_async_run_and_a_hung_generator(tiny_stages, tmp_path):
    """max_staleness=1: steps sampled with versions 0, 0 (staleness 0, 1), the importance weights away from 1 on
    the stale step; then the generator hangs before sending step 3's rollout: the trainer stops the job within
    engine.timeout_s, naming itself, the phase and the generation rank."""
    timeout_s = 10
    out = tmp_path / "async"
    start = time.time()
    proc = run_stage("ppo", *ppo_args(tiny_stages, out), "train.max_steps=4", "engine.placement=split",
                     "rollout.mode=async", "rollout.max_staleness=1", "ppo.is_correction=tis",
                     f"engine.timeout_s={timeout_s}", torchrun=2, check=False, timeout=400,
                     env={"ENGINE_KILL_AT": "split_send_rollout:3:hang"})
    ended = time.time()
    assert proc.returncode != 0
    assert ("rank 0 (trainer), phase 'waiting for the rollout of step 3': generation rank 1 (generator) died or "
            f"hangs (no answer, or an error, within engine.timeout_s={timeout_s} s)") in proc.stderr, proc.stderr[-3000:]
    train = metrics(out, "train")
    assert [(r["policy_version"], r["staleness"]) for r in train] == [(0, 0), (0, 1)]
    assert train[0]["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)  # fresh weights: the sampler's policy
    assert abs(train[1]["is_weight_mean"] - 1.0) > 1e-4 and math.isfinite(train[1]["is_weight_mean"])
    waited = ended - os.path.getmtime(out / "metrics.jsonl")  # from step 2's record to the end of the job
    assert waited < timeout_s + 30, f"the job took {waited:.0f} s after the last step, engine.timeout_s={timeout_s}"
    assert waited < ended - start


def test_the_receiving_check_names_a_changed_tensor():
    """The weight stream's check on arrival: equal copies pass; one element off by one float32 ulp, or two rows
    swapped (the plain sum unchanged), is a line naming that tensor."""
    from engine.weight_check import fingerprint
    from engine.weight_stream import received_mismatches

    g = torch.Generator().manual_seed(0)
    sent = {"a.weight": torch.randn(64, 32, generator=g), "b.bias": torch.randn(32, generator=g)}
    fps = torch.stack([fingerprint(t) for t in sent.values()])
    names = list(sent)
    assert received_mismatches(names, {k: v.clone() for k, v in sent.items()}, fps, torch.float32) == []
    ulp = {k: v.clone() for k, v in sent.items()}
    ulp["b.bias"][7] = torch.nextafter(ulp["b.bias"][7], torch.tensor(float("inf")))
    bad = received_mismatches(names, ulp, fps, torch.float32)
    assert len(bad) == 1 and bad[0].startswith("b.bias: received")
    swapped = {k: v.clone() for k, v in sent.items()}
    swapped["a.weight"][[3, 9]] = swapped["a.weight"][[9, 3]]
    bad = received_mismatches(names, swapped, fps, torch.float32)
    assert len(bad) == 1 and bad[0].startswith("a.weight: received")
