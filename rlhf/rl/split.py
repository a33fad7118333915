"""The RL protocol of a split placement (engine.placement=split): generation ranks sample the rollouts
with a policy version at most `rollout.max_staleness` steps old while the training ranks score and train.

    placement = split_world(cfg.engine.generation_ranks)       # engine/distributed.py: who trains, who generates
    # a generation rank:
    generator_loop(replica, placement, plan, make_rollout)      # until the trainers close the stream
    # a training rank:
    side = TrainerSide(models.actor, placement, cfg)
    side.send_weights(run.start)                                 # version S: the weights the run starts from
    for step in ...: rollout, meta = side.receive(step); ...train...; side.after_step(step, total)
    discarded = side.stop()

Versions: version v = the actor's weights after v optimizer steps of the run (PPO steps); the rollout of
step s is sampled with version max(S, s - k), k = 0 for rollout.mode=sync, rollout.max_staleness for
async, S the step the run started (or resumed) at. The generator takes exactly that version (as verl's
one-step-off for k = 1), not the newest it could: its staleness is k at steady state, so a run repeats
(and k = 0 is the synchronous run: same prompts, same row seeds, same weights, same tokens).
Each rollout carries its version; the trainer recomputes the old log-probs with the version it trains
(ppo.old_logprobs: auto recomputes on every async step), so ppo.is_correction (tis|mis) weighs each token
by exp(logp_trained - logp_sampled): the importance correction against the version trained.

Order of messages (no deadlock: each side blocks only on what the other has already queued):
    trainer 0 -> generators   weights v (async broadcast, engine/weight_stream.py), after step v-1
                              (only versions some later step will sample with), END when stopping
    generator -> its trainers the rollout of step s with its metadata (send_object_list, the default group)
    generator -> its trainers "done" after reading END (the trainer counts what it discards until then)
Trainer t is served by generator t mod G (G = engine.generation_ranks), which samples trainer t's rows.

A generation rank samples with transformers generate on its copy of the actor, or (engine.generation=vllm) with
a vLLM engine in a child process of its own, fed from that copy after each transfer (engine/weight_stream.py
GenerationReplica); its rollouts then carry the vLLM sync's figures and the path's name to the trainers.

Scoring (reference, critic, reward model, the old log-probs) runs on the training ranks: those models
are sharded with the actor's ZeRO group there, and a generation rank's time is its decode; giving it the
scorers would need their whole copies on it.

Failure: every blocking exchange runs inside `phase(...)`: an exception (a peer that died closes its
sockets; a hung one lets the wait pass engine.timeout_s, the process group's timeout) becomes a
TrainingError naming this rank, its role, the phase and the peer; the rank exits non-zero and torchrun
ends the others.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from engine.checkpoint import kill_point
from engine.distributed import Placement
from engine.parallelize import TORCH_DTYPES
from engine.weight_stream import WeightSender
from rlhf.core.errors import TrainingError

logger = logging.getLogger("rlhf.ppo")


def staleness_bound(r) -> int:
    """k: rollout.mode=sync -> 0, async -> rollout.max_staleness."""
    return 0 if r.mode == "sync" else r.max_staleness


def version_for(step: int, start: int, k: int) -> int:
    """The policy version the rollout of `step` is sampled with (module doc)."""
    return max(start, step - k)


def last_needed_version(total: int, start: int, k: int) -> int:
    """The newest version any step of [start, total) samples with: later ones are never sent."""
    return version_for(total - 1, start, k) if total > start else start


def served_by(trainer: int, placement: Placement) -> int:
    """The generator (world rank) that samples trainer `trainer`'s (index among trainers) rows."""
    g = placement.generator_ranks
    return g[trainer % len(g)]


def trainers_of(generator: int, placement: Placement) -> list[int]:
    """Trainer indices a generator (world rank) serves."""
    return [t for t in range(len(placement.trainer_ranks)) if served_by(t, placement) == generator]


@contextlib.contextmanager
def phase(me: str, what: str, peer: str, timeout_s: float) -> Iterator[None]:
    """A blocking exchange with `peer`: its failure (peer died: connection closed; hung: timeout) ends
    this rank with a TrainingError naming both and the phase."""
    try:
        yield
    except TrainingError:
        raise
    except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError/DistBackendError subclasses
        raise TrainingError(f"{me}, phase '{what}': {peer} died or hangs (no answer, or an error, within "
                            f"engine.timeout_s={timeout_s:g} s): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                            ) from e


def describe_rank(placement: Placement, rank: int | None = None) -> str:
    rank = placement.world_rank if rank is None else rank
    return f"rank {rank} ({placement.kind(rank)})"


@dataclass(slots=True)
class Stream:
    """What a trainer learnt of the weight stream and the staleness so far (for metrics and the summary)."""

    staleness: dict[int, int]  # staleness (steps) -> rollouts trained with it
    transfers: list[dict[str, float]]  # per transfer: the receiver's bytes, seconds, GB/s
    discarded: int = 0  # rollouts generated but never trained (the run stopped first)
    path: str = "hf"  # the generation ranks' path (hf | vllm), as their rollouts say


class TrainerSide:
    """A training rank's end of the protocol: sends the weights (trainer 0; the others join the gather of
    FSDP units), receives its rollouts from its generator."""

    def __init__(self, actor, placement: Placement, cfg: Any, *, start: int, total: int):
        self.actor, self.placement, self.cfg = actor, placement, cfg
        self.k, self.start, self.total = staleness_bound(cfg.rollout), start, total
        self.timeout_s = cfg.engine.timeout_s
        self.me = describe_rank(placement)
        self.peer = served_by(actor.info.rank, placement)
        self.sender = WeightSender(placement.stream_group, src=0, bucket_bytes=int(cfg.engine.weight_bucket_mb * (1 << 20)),
                                   dtype=TORCH_DTYPES[actor.cfg.precision]) if actor.info.rank == 0 else None
        self.stream = Stream(staleness={}, transfers=[])
        self.sent_s = 0.0  # the last send's seconds on this rank (packing and queuing)

    def send_weights(self, version: int) -> None:
        """Version `version` to every generator (collective over the trainers: FSDP units gathered)."""
        start = time.perf_counter()
        named = self.actor.generation_weights()
        with phase(self.me, f"sending the weights of version {version}", "a generation rank", self.timeout_s):
            if self.sender is not None:
                self.sender.send(named, version, check=self.cfg.engine.check_weights != "never")
            else:
                for _ in named:  # the gathers are collective: every trainer walks them
                    pass
        self.sent_s = time.perf_counter() - start

    def after_step(self, step: int) -> None:
        """After step `step` trained: version step + 1, if a later step samples with it."""
        kill_point("split_after_step")  # the tests' death or hang of a training rank (ENGINE_KILL_AT)
        if step + 1 <= last_needed_version(self.total, self.start, self.k):
            self.send_weights(step + 1)

    def receive(self, step: int):
        """(the rollout of `step` on this rank's device, its metadata: version, staleness, the generator's
        seconds, the last weight transfer's stats)."""
        box: list[Any] = [None]
        peer = describe_rank(self.placement, self.peer)
        with phase(self.me, f"waiting for the rollout of step {step + 1}", f"generation {peer}", self.timeout_s):
            dist.recv_object_list(box, src=self.peer)
        msg = box[0]
        if not isinstance(msg, dict) or msg.get("kind") != "rollout" or msg["step"] != step:
            raise TrainingError(f"{self.me}: expected the rollout of step {step + 1} from generation {peer}, got "
                                f"{msg.get('kind') if isinstance(msg, dict) else type(msg).__name__} "
                                f"{msg.get('step', '') if isinstance(msg, dict) else ''}")
        want = version_for(step, self.start, self.k)
        if msg["version"] != want:
            raise TrainingError(f"{self.me}: the rollout of step {step + 1} was sampled with policy version "
                                f"{msg['version']}, the protocol says {want} (rollout.max_staleness={self.k})")
        rollout = msg["rollout"]
        dev = self.actor.info.device
        for f in ("sequences", "attention_mask", "response_mask", "responses", "group", "empty", "truncated", "logp_gen"):
            t = getattr(rollout, f)
            if t is not None:
                setattr(rollout, f, t.to(dev))
        stale = step - msg["version"]
        self.stream.staleness[stale] = self.stream.staleness.get(stale, 0) + 1
        if msg.get("weights"):
            self.stream.transfers.append(msg["weights"])
        self.stream.path = msg.get("path", self.stream.path)
        meta = {"policy_version": msg["version"], "staleness": stale, "sampler_s": msg["generation_s"],
                "weights_send_s": self.sent_s, **{f"weights_{k}": v for k, v in (msg.get("weights") or {}).items()},
                **(msg.get("vllm") or {})}
        return rollout, meta

    def stop(self) -> int:
        """End the stream (trainer 0), then take what the generator still sends until its "done": the
        rollouts sampled for steps that will not be trained are discarded and counted."""
        if self.sender is not None:
            with phase(self.me, "closing the weight stream", "a generation rank", self.timeout_s):
                self.sender.close()
        peer = describe_rank(self.placement, self.peer)
        while True:
            box: list[Any] = [None]
            with phase(self.me, "draining the rollouts in flight", f"generation {peer}", self.timeout_s):
                dist.recv_object_list(box, src=self.peer)
            if box[0].get("kind") == "done":
                break
            self.stream.discarded += 1
        return self.stream.discarded

    def summary(self) -> dict[str, Any]:
        t = self.stream.transfers
        return {"generation_path": self.stream.path,  # the generation ranks' (this rank samples nothing)
                "staleness_counts": {str(k): v for k, v in sorted(self.stream.staleness.items())},
                "rollouts_discarded": self.stream.discarded,
                "weight_transfers": len(t),
                "weights_bytes": t[-1]["bytes"] if t else 0,
                "weights_gb_per_s": sum(x["gb_per_s"] for x in t) / len(t) if t else None,
                "weights_s": sum(x["s"] for x in t) / len(t) if t else None}


def generator_loop(replica, placement: Placement, cfg: Any, total: int,
                   make_rollout: Callable[[int, int], Any]) -> dict[str, int]:
    """A generation rank's whole run: for each step, the weights of its version (blocking), then the rollout
    of each trainer it serves (`make_rollout(step, trainer)` -> Rollout) sent to that trainer; at the end
    (or when the trainers stop early) the stream read to its END and "done" sent. Returns counts."""
    me, k, timeout_s = describe_rank(placement), staleness_bound(cfg.rollout), cfg.engine.timeout_s
    trainer0 = describe_rank(placement, placement.trainer_ranks[0])
    mine = trainers_of(placement.world_rank, placement)
    generated, stopped = 0, False

    def refresh(what: str):
        with phase(me, what, f"training {trainer0}", timeout_s):
            return replica.refresh()

    first = refresh("receiving the first weights")
    start = first.version if first is not None else total
    stopped = first is None
    fresh = first
    for step in range(start, total):
        if stopped:
            break
        want = version_for(step, start, k)
        while replica.version < want:
            stats = refresh(f"receiving the weights of version {want} for step {step + 1}")
            if stats is None:
                stopped = True
                break
            fresh = stats
        if stopped:
            break
        for t in mine:
            t0 = time.perf_counter()
            rollout = make_rollout(step, t)
            for f in ("sequences", "attention_mask", "response_mask", "responses", "group", "empty", "truncated", "logp_gen"):
                v = getattr(rollout, f)
                if v is not None:
                    setattr(rollout, f, v.cpu())
            msg = {"kind": "rollout", "step": step, "version": replica.version, "rollout": rollout,
                   "generation_s": time.perf_counter() - t0,
                   "weights": fresh.as_metrics(prefix="") if fresh is not None else None,
                   "path": replica.generation_path,
                   # engine.generation=vllm: the last transfer's copy into this rank's vLLM engine (bytes, s, GB/s)
                   "vllm": replica.vllm_sync.as_metrics() if fresh is not None and replica.vllm_sync else None}
            fresh = None  # a transfer's stats travel once
            dst = placement.trainer_ranks[t]
            kill_point("split_send_rollout")  # the tests' death or hang of a generation rank (ENGINE_KILL_AT)
            with phase(me, f"sending the rollout of step {step + 1}", f"training {describe_rank(placement, dst)}",
                       timeout_s):
                dist.send_object_list([msg], dst=dst)
            generated += 1
    while not stopped:  # versions the trainers sent that no step needed, then END
        stopped = refresh("reading the weight stream to its end") is None
    for t in mine:
        dst = placement.trainer_ranks[t]
        with phase(me, "telling the trainers it is done", f"training {describe_rank(placement, dst)}", timeout_s):
            dist.send_object_list([{"kind": "done", "generated": generated}], dst=dst)
    return {"generated": generated, "weights_received": replica.receiver.received}

