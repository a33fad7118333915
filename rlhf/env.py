"""What this machine offers a run, and whether the fast paths compute what their references do.

    python -m rlhf.env                          # our version and commit, versions, devices, the paths a run takes
    python -m rlhf.env --check                  # + each kernel and the injected decoder vs its reference
    python -m rlhf.env stage=ppo engine.kernels=true actor.model=outputs/sft   # a run's own settings
    TRITON_INTERPRET=1 python -m rlhf.env --check   # CPU: the kernels in Triton's interpreter (slow)

The paths come from the engine's own decisions: the device from `init_distributed`, the generation
path from `engine.generation.choose_generation_path` (for the stage's model config, built on the meta
device as rlhf/run/plan.py builds it) and each kernel's Triton-or-reference choice from
`kernels.use_triton`. `--check` compares on this device, for a few shapes in fp32 and bf16: every
kernel's Triton path with its PyTorch reference, and the injected decoder (Llama and OPT, random
weights) with `transformers` greedy tokens and log-probs, through the same comparison as the
first-use self-check (`kernels.testing.mismatch`, `engine.generation.decoder_mismatch`). One line per
check: pass / fail / skip, the relative error, the time of the fast path. Exit code 1 if any fails.
"""
from __future__ import annotations

import importlib.metadata
import platform
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine import init_distributed
from engine.config import cpu_has_bf16, resolve_precision
from engine.generation import InjectedGenerator, choose_generation_path, decoder_mismatch, probe_prompts
from engine.inference import InferenceModel
import kernels
from kernels import dispatch, testing
from rlhf.core.paths import CHECKOUT, ROOT
from rlhf.core.provenance import DISTRIBUTION, provenance
from rlhf.run.app import user_errors
from rlhf.run.plan import roles, stage_config

PACKAGES = ("torch", "transformers", "peft", "datasets", "hydra-core", "triton", "wandb")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    out["CUDA"] = torch.version.cuda or "none (CPU build)"
    return out


def backends() -> dict[str, bool]:
    if not dist.is_available():
        return {"torch.distributed": False}
    return {"nccl": dist.is_nccl_available(), "gloo": dist.is_gloo_available(), "mpi": dist.is_mpi_available()}


# ----------------------------------------------------------------------------- the kernels


def _rand(*shape, dtype, device, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def kernel_cases(device, dtype, small: bool):
    """{name: (inputs, fast, reference, output names)}: each kernel at one shape (odd sizes when small)."""
    n, d, v = (5, 37, 61) if small else (1024, 4096, 32000)
    b, hq, hk, t, hd = (2, 4, 2, 7, 16) if small else (8, 32, 8, 512, 128)
    x, res = _rand(n, d, dtype=dtype, device=device), _rand(n, d, dtype=dtype, device=device, seed=1)
    w, bias = _rand(d, dtype=dtype, device=device, seed=2), _rand(d, dtype=dtype, device=device, seed=3)
    q, k = _rand(b, hq, t, hd, dtype=dtype, device=device), _rand(b, hk, t, hd, dtype=dtype, device=device, seed=1)
    cos, sin = _rand(b, t, hd, dtype=dtype, device=device, seed=2), _rand(b, t, hd, dtype=dtype, device=device, seed=3)
    z, u = _rand(n, v, dtype=dtype, device=device), torch.rand(n, v, generator=torch.Generator().manual_seed(1)).to(device)
    h, head = _rand(n, d, dtype=dtype, device=device), _rand(v, d, dtype=dtype, device=device, seed=1) / d**0.5
    tgt = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(2)).to(device)
    return {
        "rms_norm": (lambda i: kernels.rms_norm(x, w, 1e-6, res, impl=i), ("y", "x + residual")),
        "layer_norm": (lambda i: kernels.layer_norm(x, w, bias, 1e-5, res, impl=i), ("y", "x + residual")),
        "silu_mul": (lambda i: kernels.silu_mul(x, res, impl=i), ("y",)),
        "apply_rotary": (lambda i: kernels.apply_rotary(q, k, cos, sin, impl=i), ("q", "k")),
        "sample": (lambda i: kernels.sample(z, 0.8, 10, 0.9, noise=u, impl=i), ("tokens", "log-probs")),
        "fused_logprobs_entropy": (lambda i: kernels.fused_logprobs_entropy(h, head, tgt, impl=i), ("log-probs", "entropy")),
    }


KERNELS = ("rms_norm", "layer_norm", "silu_mul", "apply_rotary", "sample", "fused_logprobs_entropy")


@dataclass
class Result:
    name: str
    dtype: str
    status: str  # pass | fail | skip
    detail: str  # the relative error, the mismatch, or why skipped
    ms: float | None = None


def _timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, (time.perf_counter() - start) * 1e3


def _error(out, ref) -> str:
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    errs = [testing.rel_err(o, r) for o, r in zip(outs, refs) if o is not None and r is not None and r.is_floating_point()]
    return f"rel err {max(errs):.1e}" if errs else "equal"


def check_kernels(device, dtypes) -> list[Result]:
    results = []
    if not dispatch.use_triton(torch.zeros(1, device=device)):
        why = ("Triton path not available here (triton not installed or kernels disabled)" if device.type == "cuda"
               else "Triton path not available here: no CUDA (TRITON_INTERPRET=1 runs it in Triton's CPU interpreter)")
        return [Result(name, "-", "skip", why) for name in KERNELS]
    for dtype in dtypes:
        for small in (True, False) if device.type == "cuda" else (True,):
            for name, (op, names) in kernel_cases(device, dtype, small).items():
                label = str(dtype).replace("torch.", "")
                if dispatch.interpret_mode() and dtype == torch.bfloat16 and name == "fused_logprobs_entropy":
                    results.append(Result(name, label, "skip", "Triton's CPU interpreter computes bf16 tl.dot "
                                          "wrongly (tests/test_kernels_logprobs.py): checked on CUDA only"))
                    continue
                try:
                    ref = op("reference")
                    out, ms = _timed(lambda: op("triton"), device)
                    out, ms = _timed(lambda: op("triton"), device)  # the second call: compiled already
                    why = testing.mismatch(out, ref, dtype, names)
                    results.append(Result(f"{name} ({'small' if small else 'large'})", label,
                                          "fail" if why else "pass", why or _error(out, ref), ms))
                except Exception as e:  # noqa: BLE001 - reported as a failed check, the others still run
                    results.append(Result(name, label, "fail", f"raised {type(e).__name__}: {e}"))
    return results


# ----------------------------------------------------------------------------- the injected decoder


def tiny_lm(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    if kind == "opt":
        return OPTForCausalLM(OPTConfig(vocab_size=97, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                        num_attention_heads=4, word_embed_proj_dim=64, dropout=0.0))
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def check_decoder(device, dtypes) -> list[Result]:
    results = []
    for kind in ("llama", "opt"):
        for dtype in dtypes:
            label = str(dtype).replace("torch.", "")
            try:
                hf = tiny_lm(kind).to(device, dtype).eval()
                fast = InjectedGenerator(InferenceModel(hf.config, hf.named_parameters(), dtype=dtype, device=device))
                ids, mask = probe_prompts(hf.config.vocab_size, device)
                stats = {}
                why, ms = _timed(lambda: decoder_mismatch(fast, hf, ids, mask, dtype=dtype, max_new_tokens=8,
                                                          stats=stats), device)
                results.append(Result(f"injected decoder ({kind})", label, "fail" if why else "pass", why or (
                    f"{stats['tokens']} greedy tokens = transformers' (largest log-prob gap {stats['max_gap']:.1e}), "
                    f"log-probs rel err {stats['logprob_rel_err']:.1e}"), ms))
            except Exception as e:  # noqa: BLE001
                results.append(Result(f"injected decoder ({kind})", label, "fail", f"raised {type(e).__name__}: {e}"))
    return results


# ----------------------------------------------------------------------------- the report


def describe(args: list[str]) -> list[str]:
    """The environment lines, and the paths a run with these stage overrides would take."""
    stage, cfg, keys = stage_config(args)
    world = keys["world_size"]
    device = init_distributed().device
    code = provenance()
    where = f"the checkout {CHECKOUT}, commit {code['commit']}" if code["commit"] else f"installed, data in {ROOT}"
    lines = [f"{DISTRIBUTION} {code['version']} ({where})",
             "versions: " + " | ".join(f"{k} {v}" for k, v in versions().items())]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"device cuda:{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability "
                         f"{p.major}.{p.minor}, bf16 {'yes' if torch.cuda.is_bf16_supported() else 'no'}")
    lines.append(f"device for a run: {device} (CPU threads: {torch.get_num_threads()})")
    resolved = resolve_precision(cfg.engine, device).precision
    native = f"; this CPU {'has' if cpu_has_bf16() else 'has no'} native bf16 (AVX512-BF16/AMX)" if device.type == "cpu" else ""
    lines.append(f"precision: engine.precision={cfg.engine.precision} -> {resolved}{native}")
    lines.append("distributed back-ends: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in backends().items()))
    models, _, _ = roles(stage, cfg, world)
    model = next(m for m in models if m.trained and m.logits) if stage != "reward" else models[0]
    path, why = choose_generation_path(cfg.engine.generation, device.type, model.arch.config,
                                       adapters=model.arch.adapters)
    lines.append(f"generation path ({stage}, {model.name}: {model.arch.config.model_type}): {path} ({why})")
    probe = torch.zeros(1, device=device)
    triton = "Triton" if kernels.use_triton(probe) else "PyTorch reference"
    lines.append(f"kernels: triton {'installed' if kernels.triton_available() else 'not installed'}, "
                 f"interpreter {'on' if kernels.dispatch.interpret_mode() else 'off'}; on {device} each op runs: {triton}")
    used = "used by this run" if cfg.engine.kernels else "not used (engine.kernels=false)"
    lines.append(f"  model kernels (rms_norm, layer_norm, silu_mul, apply_rotary, fused_logprobs_entropy): {used}")
    lines.append("  injected decoder (generation mode): rms_norm/layer_norm (residual add fused), apply_rotary, silu_mul, "
                 "sample, whenever that path runs (engine/inference/ops.py)")
    return lines


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    check = "--check" in argv
    args = [a for a in argv if a != "--check"]
    with user_errors():
        lines = describe(args)
    print("\n".join(lines))
    if not check:
        return 0
    device = init_distributed().device
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type != "cuda" or torch.cuda.is_bf16_supported() else [])
    results = check_kernels(device, dtypes) + check_decoder(device, dtypes)
    print(f"\nchecks on {device} (fast path vs reference):")
    for r in results:
        ms = f"{r.ms:9.2f} ms" if r.ms is not None else " " * 12
        print(f"  {r.status.upper():4}  {r.name:<36} {r.dtype:<9} {ms}  {r.detail}")
    failed = sum(r.status == "fail" for r in results)
    print(f"{sum(r.status == 'pass' for r in results)} passed, {failed} failed, "
          f"{sum(r.status == 'skip' for r in results)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
