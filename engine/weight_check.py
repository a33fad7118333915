"""The weight check on every switch to generation (`engine.check_weights`).

The generation layout (the injected model's fused slots, LoRA merged; or, on the transformers path,
the gathered module `generate` runs) must hold exactly the training parameters it was built from. On
entering generation mode each of its tensors gets a fingerprint, compared with the fingerprint of the
training tensor it came from cast to the layout's dtype (the copy into the layout casts, e.g. fp32
master weights into bf16 slots; comparing after the same cast makes equality exact up to the
summation order). A mismatch is a `WeightCheckError` naming the tensor and both fingerprints.

Fingerprint of a tensor x (flattened, n elements, cast to the layout dtype), in float64:
    [ sum_i x_i,  sum_i p(o + i) x_i,  sum_i |x_i| ]
    p(j) = w(j mod C) * v(j div C),  w(i) = frac(i * phi) + 0.5,  v(k) = 1 + frac(k * sqrt 2)
with o the flat offset of x in the whole tensor (a shard's fingerprints add up to the whole's), C =
CHUNK, phi the golden ratio (a low-discrepancy sequence: no two positions share a weight, so a permutation,
a transposition or a stale row changes the weighted sum even where the plain sum stays). Two
fingerprints agree when every component is within RTOL * sum|x| (float64 sums of the same values in
another order differ by ~1e-16 relative; a one-ulp change of a bf16 element of magnitude m moves the
sums by ~m/256, caught while m/256 > RTOL * sum|x|, e.g. m > 2.6e-5 for a 1e8-element tensor of mean
magnitude 0.01). Cost: a few passes over each tensor (measured in docs/engine.md).
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator

import torch

from .errors import WeightCheckError
from .lora import LoraLayer, LoraMerger

PHI = (math.sqrt(5.0) - 1.0) / 2.0
SQRT2 = math.sqrt(2.0)
RTOL = 1e-12
CHUNK = 1 << 20  # elements per float64 pass: the check's extra memory stays ~20 MiB
PEFT_PREFIX = "base_model.model."  # stripped from names, as the injected model's load_weights does
_WEIGHTS: dict[torch.device, torch.Tensor] = {}  # per device: [2, CHUNK] float64, rows 1 and w(i) = frac(i * phi) + 0.5
CACHED_BYTES = 2 * CHUNK * 8  # what _WEIGHTS keeps per device for the process's life once a check ran there (16 MiB)


def _chunk_weights(device: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None:
        w = torch.arange(CHUNK, dtype=torch.float64, device=device) * PHI
        w = _WEIGHTS[device] = torch.stack([torch.ones_like(w), w - w.floor() + 0.5])
    return w


def position_weight(j: int) -> float:
    """The weight of flat position j (what `fingerprint` uses, for tests and readers)."""
    k, i = divmod(j, CHUNK)
    return ((i * PHI) % 1.0 + 0.5) * (1.0 + (k * SQRT2) % 1.0)


def fingerprint(t: torch.Tensor, dtype: torch.dtype | None = None, offset: int = 0) -> torch.Tensor:
    """[3] float64 on t's device: sum, position-weighted sum and absolute sum of `t` cast to `dtype`
    (None: as it is), its first element being element `offset` of the whole tensor (a shard).

    Position j = k * CHUNK + i weighs w(i) * v(k), w(i) = frac(i * phi) + 0.5, v(k) = 1 + frac(k * sqrt 2):
    one cached [2, CHUNK] matrix serves every tensor, shard and chunk: per chunk a cast, one
    matrix-vector product (both sums) and one 1-norm, as few kernels as we could (the check's cost is
    mostly launches on a model of small tensors)."""
    x = t.detach().reshape(-1)
    w = _chunk_weights(x.device)
    parts = []
    start, n = 0, x.numel()
    while start < n:
        k, i = divmod(offset + start, CHUNK)
        stop = min(n, start + CHUNK - i)  # to the end of global chunk k
        c = x[start:stop]
        c = (c if dtype is None else c.to(dtype)).double()
        sums = torch.mv(w[:, i : i + c.numel()], c)  # [sum c, sum w c]
        if k:
            sums = sums * sums.new_tensor([1.0, 1.0 + (k * SQRT2) % 1.0])
        parts.append(torch.cat([sums, torch.linalg.vector_norm(c, 1)[None]]))
        start = stop
    if not parts:
        return torch.zeros(3, dtype=torch.float64, device=x.device)
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)


def agree(got: list[float], want: list[float], rtol: float = RTOL) -> bool:
    """Whether two fingerprints (as lists) describe the same tensor (NaN matches NaN: a diverged
    weight is not a copy error)."""
    tol = rtol * max(abs(got[2]), abs(want[2]))
    return all((math.isnan(g) and math.isnan(w)) or abs(g - w) <= tol for g, w in zip(got, want))


def describe(fp: list[float]) -> str:
    return f"(sum {fp[0]:.17g}, weighted {fp[1]:.17g}, abs {fp[2]:.17g})"


def hf_name(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX)


def expected_tap(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, layers: dict[str, LoraLayer] | None,
                 out: dict[str, torch.Tensor], spent: list[float] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields `named` unchanged, recording into `out` {HF name: fingerprint in `dtype`} of what each
    generation tensor must hold: the parameter itself, or for a LoRA layer W + scale * B @ A
    (its own merge, independent of the stream that feeds the layout). Each fingerprint is taken
    before the item is passed on (a gathered tensor is valid only until the next item). `spent[0]`
    accumulates the seconds spent here."""
    merger = LoraMerger(layers or {})
    for name, tensor in named:
        start = time.perf_counter()
        for hf, value in merger.push(name, tensor):
            out[hf_name(hf)] = fingerprint(value, dtype)
        if spent is not None:
            spent[0] += time.perf_counter() - start
        yield name, tensor
    merger.finish()


def sharded_fingerprints(params: list[tuple[str, torch.Tensor]], dtypes: dict[str, torch.dtype], *, rank: int,
                         device: torch.device) -> torch.Tensor:
    """[len(params), 3] float64 on `device`, row i the fingerprint of params[i] (cast to dtypes[name])
    as a whole, all-reduced over the ranks. Collective: every rank passes the same names in the same
    order. FSDP2 shards (DTensor, Shard(0)) contribute their rows at their global offset; a replicated
    tensor (DDP) counts once, from rank 0; any other placement is gathered (`full_tensor`)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from .distributed import all_reduce_sum

    rows = []
    for name, p in params:
        p = p.detach()
        dtype = dtypes[name]
        if isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),):
            _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            fp = fingerprint(p.to_local(), dtype, offset[0] * math.prod(p.shape[1:]) if p.dim() else 0)
        elif isinstance(p, DTensor):
            full = p.full_tensor()  # collective, on every rank alike
            fp = fingerprint(full, dtype) if rank == 0 else torch.zeros(3, dtype=torch.float64)
        else:
            fp = fingerprint(p, dtype) if rank == 0 else torch.zeros(3, dtype=torch.float64)
        rows.append(fp.to(device))
    if not rows:
        return torch.zeros(0, 3, dtype=torch.float64, device=device)
    return all_reduce_sum(torch.stack(rows))


def mismatches(layout: dict[str, torch.Tensor], expected: dict[str, list[float]], required: Iterable[str]) -> tuple[list[str], int]:
    """(one line per generation tensor whose fingerprint differs from `expected`'s, tensors compared).

    `layout`: {HF name: the tensor the generator reads}; `required`: names that must have an expected
    fingerprint (a layout tensor without one is otherwise skipped: e.g. a tied LM head, which *is*
    the embedding)."""
    required = set(required)
    names = [n for n in layout if n in expected]
    bad = [f"{n}: no training parameter was streamed into it (the layout holds whatever it held before)"
           for n in sorted(required - set(expected)) if n in layout]
    if names:
        got = torch.stack([fingerprint(layout[n]).cpu() for n in names]).tolist()
        for n, g in zip(names, got):
            if not agree(g, expected[n]):
                bad.append(f"{n}: generation layout {describe(g)} != training parameter {describe(expected[n])} "
                           f"(dtype {layout[n].dtype}, tolerance {RTOL:g} x abs)")
    return bad, len(names)


def raise_on_any_rank(bad: list[str], *, rank: int, device: torch.device, where: str) -> None:
    """WeightCheckError on every rank if any rank found a mismatch (one all-reduce): each rank's own
    lines, or a pointer to the ranks that failed. Collective."""
    from .distributed import all_reduce_sum

    flags = all_reduce_sum(torch.tensor([float(len(bad))], dtype=torch.float64, device=device)).item()
    if flags == 0:
        return
    if bad:
        shown = "\n  ".join(bad[:8]) + (f"\n  ... and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise WeightCheckError(f"engine.check_weights: the generation layout ({where}) does not hold the training "
                               f"parameters on rank {rank} ({len(bad)} tensors differ):\n  {shown}")
    raise WeightCheckError(f"engine.check_weights: the generation layout ({where}) differs from the training parameters "
                           f"on another rank ({int(flags)} tensors in all; see that rank's error); this rank's matched")
