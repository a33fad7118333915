"""Weight streaming: a trainer sends the actor's weights, already in the generation layout, to the
generation ranks of a split job (engine.distributed.split_world) in a few large flat buckets.

    sender = WeightSender(placement.stream_group, src=0, bucket_bytes=256 << 20)   # on trainer 0
    stats = sender.send(engine.generation_weights(), version=step + 1)    # async: returns once queued
    receiver = WeightReceiver(placement.stream_group, src=0)                # on each generator
    stats = receiver.receive(dict(model.named_parameters()))              # copies, then checks

Protocol of one transfer over `group` (every member in the same order; the first one also carries the
manifest, `[(name, shape, dtype)]` in send order and the bucket size, pickled):
    header  int64 [version, n_buckets]  (version END: the stream is over)
    buckets one flat tensor each, in the layout dtype, tensors packed back to back in manifest order;
            a bucket closes when the next tensor would make it larger than `bucket_bytes` (a tensor
            larger than that is a bucket of its own)
    check   float64 [n_tensors, 3]: the sender's fingerprint of each packed tensor (engine/weight_check.py)
The sender copies (casts) each tensor into its bucket as the iterator yields it and queues a bucket as soon
as it is full (`async_op`): the wire carries bucket k while k+1 is packed, and the trainer goes on with its
next step while the last ones travel; several transfers may be in flight (each its own buffers: a
generator several versions behind never blocks the trainer). The receiver's tensors become views of its
bucket buffers on the first transfer, so a bucket is received straight into the generation layout (no
copy after the wire); then it fingerprints what it holds and compares: a difference is a
WeightCheckError naming the tensor (the weight check of engine.check_weights, run on the receiving
side). Stats: bytes, seconds (on the receiver: header to last bucket, the sender's packing included;
the check apart, `check_s`), GB/s.

Why buckets rather than one message per tensor: one collective per parameter pays its latency per
tensor (open-instruct #1535, one RPC per parameter); a few large buckets run at the wire's rate
(scripts/bench_weight_stream.py compares it with a single broadcast of one flat buffer of the same size).
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import WeightCheckError
from .generation import BatchInvariantGenerator, HFGenerator
from .parallelize import TORCH_DTYPES
from .vllm_backend import ExpectedWeights, VLLMGenerator, VLLMRollout
from .weight_check import agree, describe, fingerprint

DEFAULT_BUCKET_BYTES = 256 << 20
END = -1  # the header version that ends a stream (WeightSender.close)


@dataclass(slots=True)
class TransferStats:
    version: int
    bytes: int
    seconds: float
    tensors: int
    buckets: int
    check_s: float = 0.0  # after `seconds`: the sender's fingerprints awaited, the receiver's taken and compared

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9

    def as_metrics(self, prefix: str = "weights_") -> dict[str, float]:
        return {f"{prefix}bytes": self.bytes, f"{prefix}s": self.seconds, f"{prefix}gb_per_s": self.gb_per_s,
                f"{prefix}buckets": self.buckets, f"{prefix}version": self.version, f"{prefix}check_s": self.check_s}


def plan_buckets(numels: list[int], itemsize: int, bucket_bytes: int) -> list[list[int]]:
    """Tensor indices per bucket, in order: consecutive tensors while their bytes fit `bucket_bytes`
    (a tensor larger than that alone). The sender and every receiver compute the same plan."""
    buckets: list[list[int]] = []
    size = 0
    for i, n in enumerate(numels):
        b = n * itemsize
        if not buckets or (size + b > bucket_bytes and size > 0):
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += b
    return buckets


def _src_rank(group, src: int) -> int:
    """`src` is a rank inside `group`; torch's collectives take the global rank."""
    return dist.get_global_rank(group, src) if group is not None else src


class WeightSender:
    """Trainer side: streams `(name, tensor)` pairs (the generation layout, e.g. a TrainEngine's
    `generation_weights()`) to every other member of `group` in buckets. `dtype`: the layout's dtype
    (each tensor is cast into the bucket)."""

    def __init__(self, group, *, src: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.group, self.src, self.bucket_bytes, self.dtype = group, _src_rank(group, src), bucket_bytes, dtype
        self.device = device or torch.device("cpu")
        self._manifest: list[tuple[str, tuple[int, ...]]] | None = None
        # transfers in flight: (their work handles, the buffers those read); several may be (module doc)
        self._inflight: list[tuple[list, list[torch.Tensor], bool]] = []  # (works, buffers, a bucket set to reuse)
        self._free: list[list[torch.Tensor]] = []  # bucket sets of transfers that have left, reused (no page faults)
        self.sent = 0

    def _queue(self, tensors: list[torch.Tensor]) -> list:
        works = [dist.broadcast(t, src=self.src, group=self.group, async_op=True) for t in tensors]
        self._inflight.append((works, tensors, False))
        return works

    def _reap(self) -> None:
        """Transfers that have left: their bucket sets back to the pool."""
        still = []
        for works, tensors, pooled in self._inflight:
            if all(w.is_completed() for w in works):
                if pooled:
                    self._free.append(tensors)
            else:
                still.append((works, tensors, pooled))
        self._inflight = still

    def wait(self) -> None:
        """Until every queued transfer has left (their buffers back to the pool)."""
        for works, _, _ in self._inflight:
            for work in works:
                work.wait()
        self._reap()

    def close(self) -> None:
        """End of the stream: a header with version END (the receivers' `receive` returns None), then
        wait until everything queued has left."""
        self._queue([torch.tensor([END, 0, 0], dtype=torch.int64)])
        self.wait()

    def send(self, named: Iterable[tuple[str, torch.Tensor]], version: int, *, blocking: bool = False,
             check: bool = True) -> TransferStats:
        """Packs and queues one transfer of `named`: each item is copied (cast) at once into its slot of the
        current bucket (a gathered tensor may be valid only until the next one), and a bucket is queued as
        soon as it is full, so the wire works while the next one is packed. Earlier transfers may still be
        in flight: the receivers take them in order. Returns the bytes and the sender's seconds (packing and
        queuing; `blocking`: until sent)."""
        start = time.perf_counter()
        self._reap()
        if self._manifest is None:  # the first transfer: the tensors' names and shapes first
            items = [(n, t.detach().to(self.device, self.dtype, copy=True)) for n, t in named]
            self._manifest = [(n, tuple(t.shape)) for n, t in items]
            box = [{"tensors": [(n, s, str(self.dtype)) for n, s in self._manifest], "bucket_bytes": self.bucket_bytes}]
            dist.broadcast_object_list(box, src=self.src, group=self.group)
            named = items
        numels = [math.prod(s) for _, s in self._manifest]
        plan = plan_buckets(numels, self.dtype.itemsize, self.bucket_bytes)
        self._queue([torch.tensor([version, len(plan), int(check)], dtype=torch.int64)])
        works = []
        bucket_of = {i: (k, off) for k, idx in enumerate(plan) for i, off in zip(idx, _offsets([numels[j] for j in idx]))}
        buckets = self._free.pop() if self._free else [
            torch.empty(sum(numels[i] for i in idx), dtype=self.dtype, device=self.device) for idx in plan]
        sent: list[torch.Tensor] = []  # this transfer's buckets, kept together for the pool
        fps: list[torch.Tensor] = []
        filled = [0] * len(plan)
        names = []
        with torch.no_grad():
            for i, (name, t) in enumerate(named):
                if i >= len(numels) or name != self._manifest[i][0] or tuple(t.shape) != self._manifest[i][1]:
                    raise ValueError(f"weight stream: tensor {i} is {name} {tuple(t.shape)}, the first transfer's was "
                                     f"{self._manifest[i] if i < len(numels) else 'nothing'}: the tensors sent must not change")
                names.append(name)
                k, off = bucket_of[i]
                slot = buckets[k][off : off + numels[i]]
                slot.copy_(t.detach().reshape(-1))
                filled[k] += 1
                if filled[k] == len(plan[k]):  # full: on the wire, and its fingerprints while it travels
                    works += [dist.broadcast(buckets[k], src=self.src, group=self.group, async_op=True)]
                    sent.append(buckets[k])
                    if check:
                        fps += [fingerprint(buckets[k][o : o + numels[j]]) for j, o in
                                zip(plan[k], _offsets([numels[j] for j in plan[k]]))]
        if len(names) != len(numels):
            raise ValueError(f"weight stream: {len(names)} tensors sent, the first transfer had {len(numels)}")
        self._inflight.append((works, sent, True))
        if check:
            self._queue([torch.stack(fps).cpu() if fps else torch.zeros(0, 3, dtype=torch.float64)])
        if blocking:
            self.wait()
        self.sent += 1
        return TransferStats(version=version, bytes=sum(b.numel() * b.element_size() for b in buckets),
                             seconds=time.perf_counter() - start, tensors=len(names), buckets=len(plan))


def _offsets(numels: list[int]) -> list[int]:
    out, off = [], 0
    for n in numels:
        out.append(off)
        off += n
    return out


def received_mismatches(names: list[str], targets: dict[str, torch.Tensor], sent: torch.Tensor,
                        dtype: torch.dtype) -> list[str]:
    """One line per tensor whose fingerprint (in `dtype`) differs from the sender's (`sent`, [n, 3] float64,
    row i for names[i]): the receiving side's weight check."""
    bad = []
    for name, want in zip(names, sent.tolist()):
        got = fingerprint(targets[name], dtype).cpu().tolist()
        if not agree(got, want):
            bad.append(f"{name}: received {describe(got)} != sent {describe(want)}")
    return bad


class WeightReceiver:
    """Generator side: receives each transfer of a `WeightSender` into `targets` ({name: tensor}, the
    generation layout: e.g. a module's parameters), then checks every tensor's fingerprint against the
    sender's. A target the stream does not cover, or a stream tensor with no target of its shape, is an
    error naming it."""

    def __init__(self, group, *, src: int = 0, device: torch.device | None = None):
        self.group, self.src = group, _src_rank(group, src)
        self.device = device or torch.device("cpu")
        self._manifest: list[tuple[str, tuple[int, ...], str]] | None = None
        self.bucket_bytes = 0  # the sender's, learnt with the manifest
        self._buckets: list[torch.Tensor] | None = None  # the flat buffers the targets are views of
        self.version = -1
        self.received = 0

    def _bind(self, targets: dict[str, torch.Tensor], plan: list[list[int]], numels: list[int],
              dtype: torch.dtype) -> list[torch.Tensor]:
        """One flat buffer per bucket, each target re-pointed (`.data`) at its slice, its values kept: the
        buckets arrive straight in the generation layout, no copy after the wire. A tied weight is one
        Parameter, so every module holding it sees the new storage."""
        buckets = []
        with torch.no_grad():
            for idx in plan:
                flat = torch.empty(sum(numels[i] for i in idx), dtype=dtype, device=self.device)
                for i, off in zip(idx, _offsets([numels[j] for j in idx])):
                    name, shape, _ = self._manifest[i]
                    view = flat[off : off + numels[i]].view(shape)
                    if targets[name].dtype != dtype:
                        raise WeightCheckError(f"weight stream: {name} is {targets[name].dtype} in the generation layout, "
                                               f"the stream sends {dtype}")
                    view.copy_(targets[name])
                    targets[name].data = view
                buckets.append(flat)
        return buckets

    def receive(self, targets: dict[str, torch.Tensor], *, check: bool = True) -> TransferStats | None:
        """One transfer into `targets` (blocking), checked; None at the end of the stream."""
        if self._manifest is None:
            box = [None]
            dist.broadcast_object_list(box, src=self.src, group=self.group)
            self._manifest, self.bucket_bytes = box[0]["tensors"], box[0]["bucket_bytes"]
            missing = sorted(set(targets) - {n for n, _, _ in self._manifest})
            unknown = [n for n, s, _ in self._manifest if n not in targets or tuple(targets[n].shape) != tuple(s)]
            if missing or unknown:
                raise WeightCheckError(
                    "weight stream: the generation layout and the streamed tensors differ: "
                    + (f"not streamed: {missing[:5]}; " if missing else "")
                    + (f"no target of that name and shape: {unknown[:5]}" if unknown else ""))
        manifest = self._manifest
        dtype = getattr(torch, manifest[0][2].removeprefix("torch.")) if manifest else torch.float32
        header = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(header, src=self.src, group=self.group)
        start = time.perf_counter()
        version, n_buckets, checked = int(header[0]), int(header[1]), bool(header[2])
        if version == END:
            return None
        numels = [math.prod(s) for _, s, _ in manifest]
        plan = plan_buckets(numels, dtype.itemsize, self.bucket_bytes)
        if len(plan) != n_buckets:
            raise WeightCheckError(f"weight stream: the sender announced {n_buckets} buckets, the manifest plans {len(plan)}")
        if self._buckets is None:  # once: the targets become views of the buckets, received into in place
            self._buckets = self._bind(targets, plan, numels, dtype)
        total = 0
        with torch.no_grad():
            for flat in self._buckets:
                dist.broadcast(flat, src=self.src, group=self.group)
                total += flat.numel() * flat.element_size()
        seconds = time.perf_counter() - start  # the weights are in place: the check's own time is apart
        t_check = time.perf_counter()
        fps = torch.zeros(len(manifest), 3, dtype=torch.float64)  # the sender's, computed while the buckets travel
        if checked:  # the sender sends them unless its own check is off
            dist.broadcast(fps, src=self.src, group=self.group)
        if check and checked:
            bad = received_mismatches([n for n, _, _ in manifest], targets, fps, dtype)
            if bad:
                raise WeightCheckError(f"weight stream (version {version}): {len(bad)} tensors of the generation layout "
                                       "differ from what the trainer sent:\n  " + "\n  ".join(bad[:8]))
        self.version = version
        self.received += 1
        return TransferStats(version=version, bytes=total, seconds=seconds, tensors=len(manifest), buckets=len(plan),
                             check_s=time.perf_counter() - t_check)


class GenerationReplica:
    """A generation rank's copy of the model (engine.placement=split): the whole transformers module on
    this rank's device, eval mode, in the layout dtype, refreshed by a `WeightReceiver`; `generation()`
    yields the same generator as `TrainEngine.generation()`'s transformers path (with
    `engine.deterministic`, the batch-invariant one), so a rollout sampled here with the trainer's weights
    and row seeds is the one the trainer would sample. Runs no collective but the stream's."""

    def __init__(self, model: torch.nn.Module, cfg, info, receiver: WeightReceiver):
        self.cfg, self.info, self.receiver = cfg, info, receiver
        self.dtype = TORCH_DTYPES[cfg.precision]
        self.model = model.to(info.device, self.dtype).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.targets = dict(self.model.named_parameters())  # tied weights appear once, as in the sender's stream
        self.last: TransferStats | None = None
        self._vllm = None  # engine.generation=vllm: this rank's VLLMRollout (engine/vllm_backend.py)
        self.vllm_sync = None  # its last SyncStats

    @property
    def version(self) -> int:
        return self.receiver.version

    def refresh(self) -> TransferStats | None:
        """Receive one transfer into the module (blocking) and check it (fingerprints); None at the end
        of the stream. With `engine.generation=vllm`, the module's weights then go into this rank's vLLM
        engine (built on the first transfer, in a process of its own) and are checked there."""
        stats = self.receiver.receive(self.targets, check=self.cfg.check_weights != "never")
        self.last = stats or self.last
        if stats is not None and self.generation_path == "vllm":
            self._sync_vllm(check=self.cfg.check_weights == "every" or (self.cfg.check_weights == "first"
                                                                          and self.vllm_sync is None))
        return stats

    def _sync_vllm(self, check: bool) -> None:
        if self._vllm is None:
            # in a process of its own: in this one, vLLM would create process groups over the whole job
            self._vllm = VLLMRollout(self.model.config, dtype=self.dtype, settings=self.cfg.vllm, seed=0,
                                     device=self.info.device, own_process=True)
        expected = ExpectedWeights(self.dtype) if check else None
        self.vllm_sync = stats = self._vllm.load(self.model.named_parameters(), expected)
        if stats.mismatched:
            raise WeightCheckError(f"the vLLM engine of this generation rank holds weights other than the ones it "
                                   f"received (version {self.version}): " + "; ".join(stats.mismatched[:5]))

    def close(self) -> None:
        """Stop this rank's vLLM engine, if it has one (its own process)."""
        if self._vllm is not None:
            self._vllm.close()
            self._vllm = None

    @property
    def generation_path(self) -> str:
        return "vllm" if self.cfg.generation == "vllm" else "hf"

    @contextlib.contextmanager
    def generation(self):
        if self.generation_path == "vllm":
            yield VLLMGenerator(self._vllm)
            return
        gen = HFGenerator(self.model)
        yield BatchInvariantGenerator(gen, self.cfg.deterministic_rows) if self.cfg.deterministic else gen
