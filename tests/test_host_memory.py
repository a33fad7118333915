"""The host allocator on the CPU (engine/memory.py): engine.cpu_mmap_threshold_mb, engine.cpu_trim_heap, and the
phases' peaks the RL stage reports.

The allocator's behaviour is measured in fresh processes (a test process's heap has a history): the resident
memory (VmRSS) a freed tensor leaves behind, with and without our settings. glibc only (skipped elsewhere).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine import EngineConfig, OptimConfig, TrainEngine, init_distributed, validate_engine_config
from engine.memory import KERNEL_CACHE_ENV, PhasePeaks, _glibc, process_memory, set_cpu_kernel_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
glibc = pytest.mark.skipif(_glibc() is None or process_memory() is None, reason="glibc and /proc (Linux) only")

# A fresh process: (optionally) our threshold; a 24 MiB tensor allocated and freed (glibc then raises its own
# threshold to 24 MiB: it does so for mapped blocks of up to 32 MiB), then a 16 MiB tensor, written, and freed:
# how many bytes of it stay resident.
KEPT_AFTER_FREE = """
import json, sys, torch
from engine.memory import process_memory, set_mmap_threshold
applied = set_mmap_threshold(float(sys.argv[1])) if sys.argv[1] != "none" else False
x = torch.ones(6 << 20); del x
base = process_memory()
y = torch.ones(4 << 20); del y
print(json.dumps({"applied": applied, "kept": process_memory() - base}))
"""

# A fresh process: 4,096 tensors of 64 KiB (below every mmap threshold: in the heap), every other one freed
# (holes the heap keeps), then (optionally) trim_host_heap: how many of the freed 128 MiB stay resident.
KEPT_HOLES = """
import json, sys, torch
from engine.memory import process_memory, trim_host_heap
base = process_memory()
xs = [torch.ones(16 << 10) for _ in range(4096)]
full = process_memory()
del xs[::2]
trimmed = trim_host_heap() if sys.argv[1] == "trim" else False
print(json.dumps({"trimmed": trimmed, "grew": full - base, "kept": process_memory() - base}))
"""


# A fresh process: (optionally) engine.cpu_kernel_cache's setting, then a bf16 matmul and its backward at 400 row
# counts (every one a new shape, as rows of varying lengths give): how much the process grew.
KERNEL_SHAPES = """
import json, sys, torch
from engine.memory import process_memory, set_cpu_kernel_cache
applied = set_cpu_kernel_cache(None if sys.argv[1] == "none" else int(sys.argv[1]))
w = torch.randn(256, 256, dtype=torch.bfloat16, requires_grad=True)
(torch.randn(8, 256, dtype=torch.bfloat16) @ w).float().sum().backward()
base = process_memory()
for n in range(1, 401):
    (torch.randn(n, 256, dtype=torch.bfloat16, requires_grad=True) @ w).float().sum().backward()
print(json.dumps({"applied": applied, "grew": process_memory() - base}))
"""


def fresh(code: str, arg: str, env: dict | None = None) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in KERNEL_CACHE_ENV}
    out = subprocess.run([sys.executable, "-c", code, arg], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**clean, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **(env or {})})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_a_threshold_returns_a_freed_tensor_to_the_system():
    default, ours = fresh(KEPT_AFTER_FREE, "none"), fresh(KEPT_AFTER_FREE, "4")
    assert ours["applied"] and not default["applied"]
    assert ours["kept"] < 2 << 20  # the 16 MiB went back when freed
    assert default["kept"] > 12 << 20  # glibc's raised threshold put it in the heap, which keeps it


@glibc
def test_trim_gives_the_heaps_holes_back():
    kept, trimmed = fresh(KEPT_HOLES, "keep"), fresh(KEPT_HOLES, "trim")
    assert trimmed["trimmed"] and kept["grew"] > 200 << 20
    assert kept["kept"] > 0.9 * kept["grew"]  # without a trim the freed holes stay resident
    assert trimmed["kept"] < 0.6 * trimmed["grew"]  # half of the blocks live: ~0.5 of the growth (+ headers)


def uses_onednn_bf16() -> bool:
    """Whether PyTorch runs bf16 matmuls through oneDNN here (a CPU with AVX-512: its bf16 kernels; elsewhere its
    own, which cache nothing per shape)."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return torch.backends.mkldnn.is_available() and " avx512bw " in flags and " avx512vl " in flags


def test_the_kernel_caches_bound_what_new_shapes_keep():
    """engine.cpu_kernel_cache: bf16 kernels are cached per shape with their buffers (oneDNN's primitive cache and
    ideep's LRU, 1,024 entries each): 400 new shapes kept hundreds of MiB (measured here: +727 MiB); bounded at 64
    entries the process stays within a few tens (+73 MiB)."""
    bounded = fresh(KERNEL_SHAPES, "64")
    assert bounded["applied"] == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}
    assert bounded["grew"] < 160 << 20, bounded
    if uses_onednn_bf16():
        default = fresh(KERNEL_SHAPES, "none")
        assert default["applied"] == {}
        assert default["grew"] > 3 * bounded["grew"] and default["grew"] > 300 << 20, (default, bounded)


@pytest.mark.parametrize("trim,row_tokens,calls", [(True, 2048, 3), (True, None, 3), (True, 100, 0), (False, 2048, 0)])
def test_long_rows_trim_the_heap_after_each_micro_batch(monkeypatch, trim, row_tokens, calls):
    """engine.cpu_trim_heap where the rows reach engine.cpu_mmap_min_row_tokens (or are not known): a trim after each
    micro-batch's backward too (before the update), and the step's result is the same as without."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import engine.train_engine as te

    def run(trim_heap: bool) -> tuple[list[torch.Tensor], int]:
        trims: list = []
        monkeypatch.setattr(te, "trim_host_heap", lambda: trims.append(1) or True)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2))
        eng = TrainEngine(model, EngineConfig(generation="hf", cpu_trim_heap=trim_heap), OptimConfig(), total_steps=1,
                          info=init_distributed(), row_tokens=row_tokens)
        batches = [{"input_ids": torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(i))}
                   for i in range(3)]

        def loss_fn(m, mb):
            out = m(input_ids=mb["input_ids"], labels=mb["input_ids"])
            return out.loss * 5, 5, {}

        eng.train_step(batches, loss_fn)
        return [p.detach().clone() for p in eng.unwrapped.parameters()], len(trims)

    params, n = run(trim)
    assert n == calls
    untrimmed, none = run(False)
    assert none == 0 and all(torch.equal(a, b) for a, b in zip(params, untrimmed))


@pytest.mark.parametrize("entries", [64, None])
def test_a_cpu_engine_bounds_the_kernel_caches(monkeypatch, entries, caplog):
    from transformers import LlamaConfig, LlamaForCausalLM

    import engine.train_engine as te

    for var in KERNEL_CACHE_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(te, "_KERNEL_CACHE_LOGGED", [])
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    with caplog.at_level("INFO", logger="engine.train_engine"):
        TrainEngine(model, EngineConfig(cpu_kernel_cache=entries), OptimConfig(), total_steps=1, info=init_distributed())
    if entries is None:
        assert not any(v in os.environ for v in KERNEL_CACHE_ENV) and "CPU kernel caches" not in caplog.text
    else:
        assert all(os.environ[v] == "64" for v in KERNEL_CACHE_ENV)
        assert ("CPU kernel caches: ONEDNN_PRIMITIVE_CACHE_CAPACITY=64, LRU_CACHE_CAPACITY=64 "
                "(engine.cpu_kernel_cache)") in caplog.text


def test_the_kernel_cache_setting_leaves_the_environments_values(monkeypatch):
    for var in KERNEL_CACHE_ENV:
        monkeypatch.delenv(var, raising=False)
    assert set_cpu_kernel_cache(None) == {} and not any(v in os.environ for v in KERNEL_CACHE_ENV)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "8")  # the user's
    assert set_cpu_kernel_cache(64) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "8"}
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"


def test_the_options_are_validated_naming_the_key():
    info = init_distributed()
    assert EngineConfig().cpu_trim_heap is True and EngineConfig().cpu_mmap_threshold_mb == 16
    validate_engine_config(EngineConfig(cpu_mmap_threshold_mb=None), info)
    validate_engine_config(EngineConfig(cpu_mmap_threshold_mb=0.5), info)
    for bad in (0, -1, "4", True):
        with pytest.raises(ValueError, match=r"^engine.cpu_mmap_threshold_mb must be null \(glibc's default\) or a "
                                             r"size in MiB > 0, got "):
            validate_engine_config(EngineConfig(cpu_mmap_threshold_mb=bad), info)
    for bad in (-1, 1.5, "512", True):
        with pytest.raises(ValueError, match=r"^engine.cpu_mmap_min_row_tokens must be an integer >= 0 \(tokens of "
                                             r"the longest row; 0 = always\), got "):
            validate_engine_config(EngineConfig(cpu_mmap_min_row_tokens=bad), info)
    with pytest.raises(ValueError, match=r"^engine.cpu_trim_heap must be true or false, got 'yes'$"):
        validate_engine_config(EngineConfig(cpu_trim_heap="yes"), info)
    assert EngineConfig().cpu_kernel_cache == 64
    validate_engine_config(EngineConfig(cpu_kernel_cache=None), info)
    validate_engine_config(EngineConfig(cpu_kernel_cache=0), info)
    for bad in (-1, 1.5, "64", True):
        with pytest.raises(ValueError, match=r"^engine.cpu_kernel_cache must be null \(the libraries' 1024\) or an "
                                             r"integer >= 0 \(entries; 0 = no cache"):
            validate_engine_config(EngineConfig(cpu_kernel_cache=bad), info)


def test_phase_peaks_report_the_phase_in_progress():
    peaks = PhasePeaks(torch.device("cpu"))
    assert peaks.as_metrics() == {}
    peaks.enter("generation")
    peaks.enter("training")
    x = torch.ones(64 << 20)  # 256 MiB written during the training phase: its peak so far counts them
    x += 1
    m = peaks.as_metrics()
    del x
    if process_memory() is None:
        assert m == {}
        return
    assert set(m) == {"mem_generation_peak_gib", "mem_training_peak_gib"}
    assert m["mem_training_peak_gib"] >= m["mem_generation_peak_gib"] + 0.2


@pytest.mark.parametrize("trim", [True, False])
def test_the_engine_trims_at_each_switch_between_generation_and_training(monkeypatch, trim):
    from transformers import LlamaConfig, LlamaForCausalLM

    import engine.train_engine as te

    calls = []
    monkeypatch.setattr(te, "trim_host_heap", lambda: calls.append(1) or True)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    eng = TrainEngine(model, EngineConfig(generation="hf", cpu_trim_heap=trim), OptimConfig(), total_steps=1,
                      info=init_distributed())
    for _ in range(2):
        with eng.generation():
            pass
    assert len(calls) == (4 if trim else 0)  # entering and leaving each generation phase


def test_a_threshold_the_c_library_cannot_take_is_said(monkeypatch, caplog):
    """engine.cpu_mmap_threshold_mb where the C library is not glibc: one warning naming the key, and the run goes on."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import engine.train_engine as te

    monkeypatch.setattr(te, "set_mmap_threshold", lambda mib: False)
    caplog.set_level("WARNING", logger="engine.train_engine")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    TrainEngine(model, EngineConfig(cpu_mmap_threshold_mb=16), OptimConfig(), total_steps=1, info=init_distributed())
    said = [r.getMessage() for r in caplog.records if "engine.cpu_mmap_threshold_mb" in r.getMessage()]
    assert said == ["engine.cpu_mmap_threshold_mb=16 does nothing here: the C library is not glibc (or refused the "
                    "value); host allocations keep the C library's own rule"]
    caplog.clear()
    # null, or rows shorter than engine.cpu_mmap_min_row_tokens: no threshold is set, nothing to say
    TrainEngine(model, EngineConfig(cpu_mmap_threshold_mb=None), OptimConfig(), total_steps=1, info=init_distributed())
    TrainEngine(model, EngineConfig(), OptimConfig(), total_steps=1, info=init_distributed(), row_tokens=511)
    assert not [r for r in caplog.records if "cpu_mmap_threshold_mb" in r.getMessage()]


@pytest.mark.parametrize("row_tokens, min_rows, threshold, applied", [
    (None, 512, 16, 16), (511, 512, 16, None), (512, 512, 16, 16), (2096, 512, 4.5, 4.5), (0, 0, 16, 16),
    (4096, 512, None, None)])
def test_the_threshold_applies_from_the_longest_rows_length(monkeypatch, row_tokens, min_rows, threshold, applied):
    """engine.cpu_mmap_min_row_tokens: the threshold only where the engine's longest row reaches it (not known: set)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import engine.train_engine as te
    from engine.config import host_mmap_threshold

    cfg = EngineConfig(cpu_mmap_threshold_mb=threshold, cpu_mmap_min_row_tokens=min_rows)
    assert host_mmap_threshold(cfg, row_tokens) == applied
    calls = []
    monkeypatch.setattr(te, "set_mmap_threshold", lambda mib: calls.append(mib) or True)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    TrainEngine(model, cfg, OptimConfig(), total_steps=1, info=init_distributed(), row_tokens=row_tokens)
    assert calls == ([] if applied is None else [applied])


def test_the_longest_row_a_stage_trains_on():
    """RL: the prompt and the response, or a multi-turn episode's budget (the rows the update trains on); the
    row-trained stages: data.max_len, or the pack's width (data.pack_length=0, one pack of all rows: not known)."""
    from types import SimpleNamespace

    from rlhf.config import PPOConfig, compose, to_config
    from rlhf.config.validate import trained_row_tokens
    from rlhf.data.packing import widest_row

    d = SimpleNamespace(max_len=96)
    assert (widest_row(d, None), widest_row(d, 1024), widest_row(d, 0)) == (96, 1024, None)

    def rl(*over):
        return trained_row_tokens(to_config(compose("ppo", list(over)), PPOConfig))

    assert rl("data.max_prompt_len=48", "rollout.max_new_tokens=2048") == 2096
    env = ("data.max_prompt_len=40", "rollout.max_new_tokens=16", "rollout.max_turns=3",
           "rollout.env=rlhf.rl.environments.calculator:Calculator")
    assert rl(*env, "rollout.max_episode_tokens=null") == 88  # 40 + 3 x 16
    assert rl(*env, "rollout.max_episode_tokens=100") == 140


def test_heap_probe_reads_resident_memory_by_kind_of_mapping():
    """scripts/heap_probe.py's split of /proc/<pid>/smaps: the heap, anonymous mappings and the rest."""
    from scripts.heap_probe import smaps_rss

    lines = ["55d0c0a00000-55d0c0b00000 rw-p 00000000 00:00 0                          [heap]\n", "Size: 1024 kB\n",
             "Rss:                 800 kB\n",
             "7f0000000000-7f0000100000 rw-p 00000000 00:00 0 \n", "Rss:                 300 kB\n",
             "7f0000200000-7f0000300000 rw-p 00000000 00:00 0    [anon:glibc]\n", "Rss:  20 kB\n",
             "7f0000400000-7f0000500000 r-xp 00000000 fd:01 123   /usr/lib/libc.so.6\n", "Rss:                  64 kB\n",
             "7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]\n", "Rss: 8 kB\n"]
    assert smaps_rss(lines) == {"heap": 800 << 10, "anon": 320 << 10, "file": 72 << 10}
