"""rlhf.plan: the planned model-state bytes are the engine's measured ones, per rank; the budget
verdict and its proposed change; bad inputs.

The measured side: tests/engine_scripts/plan_ranks.py, one process and 2 gloo ranks launched at once,
for the tiny default model and a ~25M-parameter Llama (saved to a temporary directory;
its vocabulary of 4,099 rows does not split evenly over 2 ranks; the planner reads only its config.json), at ZeRO stages 0-3.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, cli_env
from rlhf.core.errors import ConfigError
from rlhf.run.plan import format_plan, run_plan
from test_engine_dist import _free_port

SCRIPT = os.path.join(os.path.dirname(__file__), "engine_scripts", "plan_ranks.py")
TOKENIZER = f"model.tokenizer={ROOT / 'data' / 'tokenizer'}"


@pytest.fixture(scope="module")
def llama25m(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama25m")
    config = LlamaConfig(vocab_size=4099, hidden_size=512, intermediate_size=1408, num_hidden_layers=7,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(path)  # weights for the measured runs; the planner reads config.json
    return str(path)


def _launch(out: str, nproc: int, overrides: list[str]) -> subprocess.Popen:
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, SCRIPT] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), SCRIPT]
    return subprocess.Popen([*cmd, out, *overrides], env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


MODELS = {"tiny": [], "llama25m": None}  # None: the temporary directory, filled in by the fixture


@pytest.fixture(scope="module")
def measured(tmp_path_factory, llama25m) -> dict:
    """{(model, world, rank, stage): the engine's memory report}, all runs started at once."""
    root = tmp_path_factory.mktemp("measured")
    models = {"tiny": [], "llama25m": [f"model.name_or_path={llama25m}", TOKENIZER]}
    procs = {(m, n): _launch(str(root / f"{m}_{n}"), n, o) for m, o in models.items() for n in (1, 2)}
    out = {}
    for (m, n), proc in procs.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{m} on {n} rank(s):\n{log[-4000:]}"
        for rank in range(n):
            for stage in range(4):
                with open(root / f"{m}_{n}" / f"rank{rank}_stage{stage}.json") as f:
                    out[m, n, rank, stage] = json.load(f)
    return out


@pytest.mark.slow  # 4 launches (1 process and 2 ranks per model), ~2 min on 2 cores
@pytest.mark.parametrize("model", ["tiny", "llama25m"])
@pytest.mark.parametrize("world", [1, 2])
def test_planned_model_state_equals_measured(measured, llama25m, model, world):
    extra = [] if model == "tiny" else [f"model.name_or_path={llama25m}", TOKENIZER]
    for rank in range(world):
        for stage in range(4):
            got = measured[model, world, rank, stage]
            report, _ = run_plan(["stage=sft", f"world_size={world}", f"rank={rank}", "device=cpu", *extra,
                                  f"engine.stage={stage}"])
            planned = report["models"]["model"]
            assert planned["total_params"] == got["total_params"]
            for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "model_state_bytes"):
                assert planned[key] == got[key], (model, world, rank, stage, key, planned[key], got[key])
            assert planned["zero_formula_bytes"] == got["zero_formula_bytes"]
            assert planned["layout_bytes"] == got["layout_bytes"]
    if world == 2:  # uneven shards are per rank: rank 0 holds the larger chunk of an odd-sized dim 0
        r0, r1 = measured[model, 2, 0, 3], measured[model, 2, 1, 3]
        assert (r0["param_bytes"] > r1["param_bytes"]) == (model == "llama25m")


def test_budget_too_small_proposes_a_change_that_fits(llama25m):
    args = ["stage=sft", "world_size=2", f"model.name_or_path={llama25m}", TOKENIZER, "data.max_len=256",
            "train.micro_batch_size=16", "budget_gib=0.5"]
    report, change = run_plan(args)
    assert report["fits"] is False and report["peak_bytes"] > 0.5 * 2**30
    assert change, "a change should have been found"
    again, more = run_plan([*args, *change])
    assert again["fits"] is True and more is None and again["peak_bytes"] <= 0.5 * 2**30
    # the cheapest one: nothing simpler (any one of its keys alone) fits as well
    for key in change:
        if len(change) > 1:
            assert run_plan([*args, key])[0]["fits"] is False
    roomy, none = run_plan([*args[:-1], "budget_gib=80"])
    assert roomy["fits"] is True and none is None


def test_ppo_models_follow_the_algorithm(llama25m):
    paths = [f"actor.model={llama25m}", f"critic.model={llama25m}", TOKENIZER]
    ppo, _ = run_plan(["stage=ppo", "world_size=2", *paths, "rollout.max_new_tokens=32"])
    assert list(ppo["models"]) == ["actor", "critic", "reference", "reward_model"]
    assert ppo["models"]["critic"]["total_params"] < ppo["models"]["actor"]["total_params"]  # value head, no LM head
    a = ppo["models"]["actor"]
    # KV cache: 2 (k, v) x 7 layers x 32 rows per rank x (48 + 32 tokens, rounded up to 32 slots: 96) x 4 heads
    # x 64 dims x 2 bytes (bf16)
    assert ppo["kv_cache_bytes"] == 2 * 7 * 32 * 96 * 256 * 2 and ppo["generation_path"] == "injected"
    assert a["grad_bytes"] > 0 and ppo["models"]["reference"]["grad_bytes"] == 0
    # the documented formulas (rlhf/plan.py): L*b*s*(7h + 2kv + 4i)*e, under autocast (stage 0 in bf16: fp32
    # residual stream and norms) 27h for 7h; with checkpointing L*b*s*h*e + one block's share; logits
    # b*s*V*(e + 8); stage 0 in bf16 keeps autocast's casts of every parameter (Psi*e)
    tokens = 32 * 80  # rollout.micro_batch_size x (data.max_prompt_len + rollout.max_new_tokens)
    act = 7 * tokens * (27 * 512 + 2 * 256 + 4 * 1408) * 2
    assert a["activation_bytes"] == act and a["activation_ckpt_bytes"] == 7 * tokens * 512 * 2 + act / 7
    assert a["logits_bytes"] == tokens * 4099 * 10 and a["gathered_bytes"] == a["total_params"] * 2
    assert ppo["peak_bytes"] == ppo["resident_bytes"] + max(ppo["phases"].values())
    # the injected model's weights and KV cache stay between phases (resident) unless released after each
    kept = ppo["kv_cache_bytes"] + ppo["generation_weight_bytes"]
    states = sum(m["device_bytes"] for m in ppo["models"].values())
    assert ppo["inference_kept_bytes"] == kept and ppo["phases"]["generation"] == 0
    # + the buffers a run keeps: the weight check's position weights (2 x 2^20 float64) and, on CUDA, cuBLAS's
    # workspaces (no GPU here to ask its compute capability: 32 MiB each) for the forward's and the backward's thread
    # and the decode graphs' stream
    buffers = 2 * 2**20 * 8 + 3 * 32 * 2**20
    assert ppo["buffers"] == {"weight check": 2 * 2**20 * 8, "cuBLAS workspaces": 3 * 32 * 2**20}
    assert ppo["resident_bytes"] == states + kept + buffers
    freed, _ = run_plan(["stage=ppo", "world_size=2", *paths, "rollout.max_new_tokens=32",
                         "engine.release_inference_cache=true"])
    assert freed["inference_kept_bytes"] == 0 and freed["phases"]["generation"] == kept
    assert freed["resident_bytes"] == states + buffers and freed["peak_bytes"] <= ppo["peak_bytes"]
    grpo, _ = run_plan(["stage=ppo", *paths, "algorithm=grpo", "reward.sources=[judge]", "device=cpu"])
    assert list(grpo["models"]) == ["actor", "reference"] and grpo["generation_path"] == "hf"
    # on CPU the plan is of the process's RSS: the process itself (torch and transformers loaded) counts too
    assert 100 * 2**20 < grpo["runtime_bytes"] < 4 * 2**30 and ppo["runtime_bytes"] == 0
    assert grpo["peak_bytes"] == grpo["runtime_bytes"] + grpo["resident_bytes"] + max(grpo["phases"].values())
    # glibc's own threshold (engine.cpu_mmap_threshold_mb=null; the default is 16): on the CPU the plan says what it
    # does not count; not with a threshold set (the default), nor on CUDA
    assert "allocator_note" not in grpo and "allocator_note" not in ppo
    glibc, _ = run_plan(["stage=ppo", *paths, "algorithm=grpo", "reward.sources=[judge]", "device=cpu",
                         "engine.cpu_mmap_threshold_mb=null"])
    assert "engine.cpu_mmap_threshold_mb=null" in glibc["allocator_note"]
    assert "  note: engine.cpu_mmap_threshold_mb=null: glibc keeps freed blocks" in format_plan(glibc, None)
    assert glibc["peak_bytes"] - glibc["runtime_bytes"] == grpo["peak_bytes"] - grpo["runtime_bytes"]
    # the threshold the training engines set: from rows of engine.cpu_mmap_min_row_tokens (512) on
    row = grpo["models"]["actor"]["seq"]
    assert row < 512 and grpo["host_mmap"] == {"threshold_mb": None, "row_tokens": row, "min_row_tokens": 512}
    assert f"host allocator: glibc's own mmap threshold (rows of {row} tokens < engine.cpu_mmap_min_row_tokens=512)" \
        in format_plan(grpo, None)
    always, _ = run_plan(["stage=ppo", *paths, "algorithm=grpo", "reward.sources=[judge]", "device=cpu",
                          "engine.cpu_mmap_min_row_tokens=0"])
    assert always["host_mmap"]["threshold_mb"] == 16 and "host_mmap" not in ppo
    # bf16 on the CPU: a note on later steps' growth only where a setting lifts the engines' bounds on it (the kernel
    # caches; the trims after each micro-batch where rows reach the floor); never in fp32, nor on CUDA
    assert "shapes_note" not in grpo and "shapes_note" not in ppo
    cpu = ["stage=ppo", *paths, "algorithm=grpo", "reward.sources=[judge]", "device=cpu"]
    unbounded, _ = run_plan([*cpu, "engine.cpu_kernel_cache=null"])
    untrimmed, _ = run_plan([*cpu, "engine.cpu_trim_heap=false", "engine.cpu_mmap_min_row_tokens=0"])
    short, _ = run_plan([*cpu, "engine.cpu_trim_heap=false"])  # rows under the floor: never trimmed per micro-batch
    fp32, _ = run_plan([*cpu, "engine.precision=fp32", "engine.cpu_kernel_cache=null"])
    assert "shapes_note" not in fp32 and "shapes_note" not in short
    if grpo["precision"] == "bf16":
        assert unbounded["shapes_note"].startswith("engine.cpu_kernel_cache=null: oneDNN and ideep keep up to 1,024")
        assert "  note: engine.cpu_kernel_cache=null: oneDNN" in format_plan(unbounded, None)
        assert untrimmed["shapes_note"].startswith("engine.cpu_trim_heap=false: the heap keeps what each micro-batch")
    assert (f"host allocator: blocks of 16 MiB or more mapped apart (engine.cpu_mmap_threshold_mb; rows of {row} "
            "tokens >= engine.cpu_mmap_min_row_tokens=0)") in format_plan(always, None)
    # multi-turn: rows of prompt + the episode budget (48 + 64), the KV cache every turn's new tokens
    # (48 + 3 x 16 + 2 x 64 = 224 slots, a multiple of 32) for 8 prompts x 8 samples
    tools, _ = run_plan(["stage=ppo", *paths, "algorithm=grpo", "reward.sources=[judge]",
                         "rollout.env=rlhf.rl.environments.calculator:Calculator", "rollout.max_turns=3",
                         "rollout.max_new_tokens=16", "rollout.max_episode_tokens=64"])
    assert tools["models"]["actor"]["seq"] == 48 + 64 and tools["kv_cache_bytes"] == 2 * 7 * 64 * 224 * 256 * 2
    hf, _ = run_plan(["stage=ppo", *paths, "algorithm=grpo", "reward.sources=[judge]", "device=cpu",
                      "rollout.env=rlhf.rl.environments.calculator:Calculator", "rollout.max_turns=3",
                      "rollout.max_new_tokens=16", "rollout.max_episode_tokens=64",
                      "engine.precision=fp32"])  # on every host: auto is bf16 on a CPU with native bf16
    assert hf["generation_path"] == "hf" and hf["kv_cache_bytes"] == 2 * 7 * 64 * (48 + 64) * 256 * 4  # re-prefilled, fp32


def test_split_placement_plans_both_rank_kinds(llama25m):
    """engine.placement=split on 4 ranks, 1 generating: the training rank's models are sharded over the 3 trainers
    (as a 3-rank colocated plan), the generation rank holds the whole actor, its KV cache and one stream bucket."""
    paths = [f"actor.model={llama25m}", f"critic.model={llama25m}", TOKENIZER, "rollout.max_new_tokens=32",
             "engine.stage=3", "rollout.prompts_per_step=96", "rollout.mini_batch_size=96", "rollout.micro_batch_size=8"]
    split, _ = run_plan(["stage=ppo", "world_size=4", *paths, "engine.placement=split", "engine.weight_bucket_mb=16"])
    three, _ = run_plan(["stage=ppo", "world_size=3", *paths])
    assert split["training_ranks"] == 3 and split["models"] == three["models"]
    g = split["generation_rank"]
    assert g["weight_bytes"] == split["models"]["actor"]["total_params"] * 2  # the whole actor in bf16
    # 32 rows per trainer, the one generator serves all 3: 96 rows x (48 + 32 tokens), 7 layers, 4 x 64 kv, bf16
    assert g["rows"] == 96 and g["kv_cache_bytes"] == 2 * 7 * 96 * 80 * 256 * 2
    assert g["bucket_bytes"] == 16 * 2**20 and g["peak_bytes"] == g["weight_bytes"] + g["kv_cache_bytes"] + 16 * 2**20
    assert "1 generation rank(s)" in format_plan(split, None) and "a generation rank: the actor's weights" in format_plan(split, None)
    with pytest.raises(ConfigError, match="engine.generation_ranks=4"):
        run_plan(["stage=ppo", "world_size=4", *paths, "engine.placement=split", "engine.generation_ranks=4"])


def test_a_directory_holding_only_config_json_is_enough(tmp_path):
    """The docs say the planner needs only config.json; with no tokenizer files beside it, it used to fail
    asking for sentencepiece / tiktoken (#29): the vocabulary comes from config.json, no tokenizer is loaded."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=4099, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256).save_pretrained(tmp_path / "llama")
    assert os.listdir(tmp_path / "llama") == ["config.json"]
    sft, _ = run_plan(["stage=sft", f"model.name_or_path={tmp_path / 'llama'}", "device=cpu"])
    m = sft["models"]["model"]
    embedding = 4099 * 64
    assert m["total_params"] == 2 * embedding + 2 * (4 * 64 * 64 - 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    ppo, _ = run_plan(["stage=ppo", f"actor.model={tmp_path / 'llama'}", f"critic.model={tmp_path / 'llama'}",
                       "device=cpu"])
    assert list(ppo["models"]) == ["actor", "critic", "reference", "reward_model"]
    assert ppo["models"]["actor"]["total_params"] == m["total_params"]


@pytest.mark.parametrize("args, message", [
    (["stage=bogus"], "stage='bogus': the planner knows the stages sft, reward, dpo, ppo"),
    (["model.name_or_path=/nonexistent/model"], "model.name_or_path"),
    (["engine.stagee=3"], "did you mean 'engine.stage'"),
])
def test_bad_inputs_exit_2(args, message):
    proc = subprocess.run([sys.executable, "-m", "rlhf.plan", *args], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_bench_memory_runs_on_cpu():
    """scripts/bench_memory.py: real SFT steps of a small model, batched as the stage batches them (here one pack
    of the micro-batch), planned vs measured, both printed."""
    from conftest import SMALL_MODEL

    proc = subprocess.run([sys.executable, "scripts/bench_memory.py", *SMALL_MODEL, "train.micro_batch_size=4",
                           "data.max_len=32", "data.packing=true", "data.pack_length=0"], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2:4] for line in proc.stdout.splitlines()
            if line.startswith("| ") and "planned" not in line}
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "model_state_bytes"):
        assert rows[key][0].strip() == rows[key][1].strip(), (key, rows[key])
    assert "2 steps of 4 x 32 tokens (packed [1, 128])" in proc.stdout
    assert "peak (CPU peak RSS)" in rows and "model state planned exactly: True" in proc.stdout


SFT_EAGER = ["device=cpu", "data.max_len=64", "train.micro_batch_size=4"]  # the tiny default: eager attention


def test_packed_rows_widen_the_planned_attention():
    """SFT / reward / DPO forwards as the stage batches them: packed (data.packing), the same tokens fill rows of
    data.pack_length (0: one row of the micro-batch), and eager attention's kept scores grow with the row's width
    (rows x width^2 per head and layer); the rest is per token, unchanged. Measured on a ~25M Llama, 4 x 1,024
    tokens: plan / peak RSS 0.99 / 1.00 / 1.01 padded / in rows of 2,048 / in one row (docs/deepspeed.md)."""
    plans = {k: run_plan(["stage=sft", *SFT_EAGER, *o])[0]["models"]["model"] for k, o in {
        "padded": ["data.packing=false"], "auto": [],  # auto: packs of data.max_len (pack_length=null)
        "128": ["data.packing=true", "data.pack_length=128"], "0": ["data.packing=true", "data.pack_length=0"]}.items()}
    assert [(p["rows"], p["seq"]) for p in plans.values()] == [(4, 64), (4, 64), (2, 128), (1, 256)]
    base = plans["padded"]
    for p in plans.values():
        assert p["logits_bytes"] == base["logits_bytes"] and p["activation_ckpt_bytes"] > 0
    # the eager block's share: L x H x (rows x width^2 - 4 x 64^2) x (4 + e), in the ratio of the squares' excess
    extra = {k: plans[k]["activation_bytes"] - base["activation_bytes"] for k in ("128", "0")}
    assert plans["auto"]["activation_bytes"] == base["activation_bytes"]
    assert extra["0"] == pytest.approx(3 * extra["128"], rel=1e-12)  # (256^2 - 4 x 64^2) / (2 x 128^2 - 4 x 64^2)
    assert extra["128"] == 3 * 6 * (2 * 128 ** 2 - 4 * 64 ** 2) * (4 + 2)  # 3 layers, 6 heads, bf16
    # pairs: chosen + rejected, 2 x 4 rows; data.shared_prompts=true does not pack, whatever data.packing says
    pairs = {k: run_plan(["stage=reward", *SFT_EAGER, "model.name_or_path=null", *o])[0]["models"]["model"] for k, o in {
        "packed": ["data.pack_length=0"], "shared": ["data.pack_length=0", "data.shared_prompts=true"]}.items()}
    assert (pairs["packed"]["rows"], pairs["packed"]["seq"]) == (1, 512)
    # shared: 4 prompts of up to data.max_prompt_len (48) once, 8 responses of up to 63 tokens on them, as rows of
    # 48 + 63 (the longest prompt and the longest response may be in different pairs)
    shared = pairs["shared"]
    assert shared["seq"] == 111 and shared["rows"] * shared["seq"] == pytest.approx(4 * 48 + 8 * 63, rel=1e-12)
    dpo, _ = run_plan(["stage=dpo", *SFT_EAGER, "model.name_or_path=null", "data.pack_length=128", "dpo.reference=online"])
    assert [(m["rows"], m["seq"]) for m in dpo["models"].values()] == [(4, 128), (4, 128)]


def test_a_model_that_does_not_pack_is_planned_padded(tmp_path):
    """data.packing=auto on a model family not checked to keep packed rows apart: padded rows, as the stage runs
    it; data.packing=true: the stage's error, naming the key."""
    from transformers import GPT2Config

    GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=256).save_pretrained(tmp_path / "gpt2")
    args = ["stage=sft", f"model.name_or_path={tmp_path / 'gpt2'}", *SFT_EAGER, "data.pack_length=0"]
    auto, _ = run_plan(args)
    assert (auto["models"]["model"]["rows"], auto["models"]["model"]["seq"]) == (4, 64)
    with pytest.raises(ConfigError, match=r"data.packing=true: model_type 'gpt2' is not one of"):
        run_plan([*args, "data.packing=true"])


def test_the_host_threshold_follows_the_width_the_stage_gives_its_engine():
    """The planned host allocator threshold is the one the stage's engine sets from its widest row: data.max_len
    padded, the pack's width packed, unknown (taken as long) for one pack per micro-batch."""
    short, _ = run_plan(["stage=sft", *SFT_EAGER, "data.packing=false"])
    wide, _ = run_plan(["stage=sft", *SFT_EAGER, "data.packing=true", "data.pack_length=512"])
    one, _ = run_plan(["stage=sft", *SFT_EAGER, "data.packing=true", "data.pack_length=0"])
    assert short["host_mmap"] == {"threshold_mb": None, "row_tokens": 64, "min_row_tokens": 512}
    assert wide["host_mmap"] == {"threshold_mb": 16, "row_tokens": 512, "min_row_tokens": 512}
    assert one["host_mmap"] == {"threshold_mb": 16, "row_tokens": None, "min_row_tokens": 512}
    assert "one pack per micro-batch, data.pack_length=0: taken as long" in format_plan(one, None)
    assert "rows of 64 tokens < engine.cpu_mmap_min_row_tokens=512" in format_plan(short, None)


def test_a_token_budget_sizes_the_rl_forwards_and_is_what_the_plan_halves(llama25m):
    """rollout.micro_batch_tokens: each forward holds at most the budget's tokens (b x s = the budget), and a plan
    that does not fit proposes a smaller budget (down to one whole row) or checkpointing; the change fits."""
    base = ["stage=ppo", f"actor.model={llama25m}", TOKENIZER, "algorithm=grpo", "reward.sources=[judge]",
            "device=cpu", "data.max_prompt_len=48", "rollout.max_new_tokens=464", "rollout.micro_batch_size=8"]
    rows, _ = run_plan(base)  # 8 rows x 512 tokens per forward
    budget, _ = run_plan([*base, "rollout.micro_batch_tokens=2048"])
    a, b = rows["models"]["actor"], budget["models"]["actor"]
    assert b["activation_bytes"] == pytest.approx(a["activation_bytes"] * 2048 / (8 * 512), rel=1e-12)
    assert b["rows"] == 4 and b["logits_bytes"] < a["logits_bytes"]
    # a memory budget between the plans of 2048 and 4096 tokens: 4096 does not fit, a change that fits is proposed
    big, _ = run_plan([*base, "rollout.micro_batch_tokens=4096"])
    gib = (big["peak_bytes"] + budget["peak_bytes"]) / 2 / 2**30
    tight, change = run_plan([*base, "rollout.micro_batch_tokens=4096", f"budget_gib={gib}"])
    assert tight["fits"] is False and change
    assert any(c in ("rollout.micro_batch_tokens=2048", "rollout.micro_batch_tokens=1024",
                     "engine.activation_checkpointing=true") for c in change), change
    fixed, more = run_plan([*base, "rollout.micro_batch_tokens=4096", f"budget_gib={gib}", *change])
    assert fixed["fits"] is True and more is None
    assert "rollout.micro_batch_tokens=256" not in " ".join(change)  # never below one whole row (512 tokens)


def test_cublas_workspace_rule():
    """PyTorch's cuBLAS workspace per (handle, stream): CUBLAS_WORKSPACE_CONFIG's :KiB:count pairs summed where set,
    else 32 MiB on compute capability 9-12 (Hopper, Blackwell) and :4096:2:16:8 before; unknown (no GPU): 32 MiB."""
    from engine.memory import cublas_workspace_bytes

    assert cublas_workspace_bytes((9, 0), config="") == 32 * 2**20
    assert cublas_workspace_bytes((12, 0), config="") == 32 * 2**20
    assert cublas_workspace_bytes((8, 0), config="") == (4096 * 2 + 16 * 8) * 1024
    assert cublas_workspace_bytes(None, config="") == 32 * 2**20
    assert cublas_workspace_bytes((9, 0), config=":4096:2:16:8") == (4096 * 2 + 16 * 8) * 1024
    assert cublas_workspace_bytes((8, 0), config=":16:8") == 16 * 8 * 1024
    assert cublas_workspace_bytes((8, 0), config=":0:0") == 0  # workspaces off
    assert cublas_workspace_bytes((9, 0), config="garbage") == 32 * 2**20  # unparsed: torch's default, as torch does


def test_the_buffers_a_run_keeps(llama25m, monkeypatch):
    """The kept buffers follow the run: cuBLAS workspaces on CUDA only (2 threads on the default stream, + the decode
    graphs' stream with the injected path), the weight check's cache only in RL with engine.check_weights on; both
    in `resident` and in the printed plan."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    paths = [f"actor.model={llama25m}", f"critic.model={llama25m}", TOKENIZER]
    mib = 2**20
    sft, _ = run_plan(["stage=sft", f"model.name_or_path={llama25m}", TOKENIZER])
    assert sft["buffers"] == {"cuBLAS workspaces": 2 * 32 * mib}
    line = "  kept buffers: cuBLAS workspaces 64.00 MiB (2 x 32.00 MiB: forward, backward) (in resident)"
    assert line in format_plan(sft, None).splitlines()
    hf, _ = run_plan(["stage=ppo", *paths, "engine.generation=hf", "engine.check_weights=never"])
    assert hf["buffers"] == {"cuBLAS workspaces": 2 * 32 * mib}
    small, _ = run_plan(["stage=ppo", *paths])
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:1")
    env, _ = run_plan(["stage=ppo", *paths])
    assert env["buffers"] == {"weight check": 16 * mib, "cuBLAS workspaces": 3 * 4 * mib}
    assert small["resident_bytes"] - env["resident_bytes"] == 3 * 28 * mib
    assert ("  kept buffers: weight check 16.00 MiB | cuBLAS workspaces 12.00 MiB (3 x 4.00 MiB: forward, backward, "
            "decode graphs) (in resident)") in format_plan(env, None).splitlines()
    cpu, _ = run_plan(["stage=ppo", *paths, "device=cpu"])
    assert cpu["buffers"] == {"weight check": 16 * mib}
    sft_cpu, _ = run_plan(["stage=sft", f"model.name_or_path={llama25m}", TOKENIZER, "device=cpu"])
    assert sft_cpu["buffers"] == {} and "kept buffers" not in format_plan(sft_cpu, None)
