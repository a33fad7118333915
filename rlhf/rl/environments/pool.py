"""The process pool that runs environments beside the step (`rollout.env_workers > 0`): `workers`
processes, each holding the environment instances of the episodes assigned to it, every call limited to
`timeout_s` of wall time, every fault turned into a `Reply` with `error` set (base.py's ERROR_* kinds).

Timeline of one `step(episodes, texts)` call:

    parent: group the episodes by the worker that holds them -> one message per worker (pickled list)
    worker: for each (episode, text): write (index, start time) to its shared progress slot, run
            env.step through an InlineRunner (the same code as rollout.env_workers=0), collect the Reply
    worker: one message back with the list of Replies
    parent: waits on every busy worker's pipe and process sentinel at once; a worker whose current call
            has run past timeout_s (read from its progress slot) is killed with its process group

What each fault gives (the other workers' episodes are untouched; the step always goes on):

    env raises                 -> ERROR_RAISED for that episode (the worker lives on)
    env returns a non-Step     -> ERROR_GARBAGE (as_reply, in the worker; an unpicklable info is garbage too)
    a call runs past timeout_s -> ERROR_TIMEOUT for it; its worker is killed and replaced
    the worker dies (kill -9, os._exit, segfault, RLIMIT_CPU, the OOM killer) -> ERROR_WORKER_DIED for the
                                  episode whose call was running, and the worker is replaced
    in both last cases the other episodes of that worker are lost with it: ERROR_WORKER_DIED for them, in
    this call if they were in it, else on their next step (never a hang). More workers = fewer episodes
    lost per fault.

Workers are fresh interpreters (`python -c ...serve()`, started by fork+exec): forking a parent that has
torch's OpenMP / CUDA threads is unsafe, and multiprocessing's spawn / forkserver would re-import the
trainer's `__main__` (torch included) in every worker. A worker imports only this package and the
environment's module, by its `module:Class` spec (so the class must live in an importable module, not
`__main__`), with the parent's sys.path. Measured (scripts/bench_env.py --compare-start, a main module
importing torch, loaded 2-core machine): a worker starts in 1.1 s this way, 27 s with spawn, 22 s with
forkserver.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
import weakref
from collections import defaultdict
from multiprocessing.connection import Connection, wait
from typing import Any, Self

from rlhf.core.errors import ConfigError
from rlhf.rl.environments.base import (
    ERROR_GARBAGE,
    ERROR_RAISED,
    ERROR_TIMEOUT,
    ERROR_WORKER_DIED,
    Environment,
    InlineRunner,
    Reply,
    load_environment,
)
from rlhf.rl.environments.isolation import (
    check_limits,
    die_with_parent,
    isolate,
    release_cgroup,
    release_stale_cgroups,
)

START_TIMEOUT_S = 60.0   # a new worker has this long to import the environment before it counts as dead
PROGRESS = struct.Struct("dd")
REPLY_FIELDS = tuple(f.name for f in dataclasses.fields(Reply))   # a Reply travels as a tuple in this order


def env_spec(env: type[Environment] | str) -> str:
    """An environment class or `module:Class` spec -> the spec a worker imports (checked here, in the
    parent: a ConfigError now rather than workers dying at start)."""
    if isinstance(env, str):
        load_environment(env)
        return env
    spec = f"{env.__module__}:{env.__qualname__}"
    if env.__module__ == "__main__" or "<locals>" in env.__qualname__:
        raise ConfigError(f"rollout.env: {env.__qualname__} is defined in {env.__module__} (a script, a notebook or "
                          f"a function); the pool's workers import it by name: move it to an importable module, or "
                          f"rollout.env_workers=0 runs it in this process (no per-call timeout)")
    if load_environment(spec) is not env:
        raise ConfigError(f"rollout.env: importing {spec!r} does not give back {env!r}")
    return spec


def serve(fd: int, progress_fd: int, parent: int) -> None:
    """A worker (`python -c ...serve(fd, progress_fd, parent)`): read its setup, isolate itself, import
    the environment, then serve batches until told to exit or the parent goes away."""
    os.setsid()  # its own process group: the parent kills what it forked along with it
    die_with_parent(parent)  # a trainer killed with -9 leaves no worker behind, even one stuck in a call
    conn = Connection(fd)
    progress = memoryview(mmap.mmap(progress_fd, PROGRESS.size)).cast("d")  # [index of the running call, start]
    path, spec, limits = pickle.loads(conn.recv_bytes())
    sys.path[:] = path
    failed = isolate(**limits)
    envs = InlineRunner(load_environment(spec))
    conn.send_bytes(pickle.dumps(("ready", (failed, time.monotonic()))))
    while True:
        try:
            method, items = pickle.loads(conn.recv_bytes())
        except EOFError:  # the parent went away
            method, items = "exit", []
        if method == "exit":  # the open episodes' close() (a scratch dir, a subprocess), then out
            envs.close()
            return
        replies: list[Any] = []
        for i, (episode, arg) in enumerate(items):
            progress[1] = time.monotonic()  # start first, then the index: a torn read only delays a timeout
            progress[0] = i
            if method == "close":
                envs.close([episode])
                replies.append(None)
            else:
                replies.append((envs.reset if method == "reset" else envs.step)([episode], [arg])[0])
        progress[0] = -1
        if method != "close":  # as tuples: a third of a dataclass's pickling time (64 replies: 0.9 vs 2.2 ms)
            replies = [tuple(getattr(r, name) for name in REPLY_FIELDS) for r in replies]
        try:
            data = pickle.dumps(("replies", replies))
        except Exception:  # noqa: BLE001 - an info / reward that cannot be pickled: that reply is garbage, the others stand
            for i, reply in enumerate(replies):
                try:
                    pickle.dumps(reply)
                except Exception as e:  # noqa: BLE001 - whatever its __reduce__ raises
                    envs.close([items[i][0]])
                    garbage = Reply(done=True, error=ERROR_GARBAGE, seconds=reply[REPLY_FIELDS.index("seconds")],
                                    message=f"the reply cannot be sent to the trainer ({type(e).__name__}: "
                                            f"{str(e)[:120]})")
                    replies[i] = tuple(getattr(garbage, name) for name in REPLY_FIELDS)
            data = pickle.dumps(("replies", replies))
        conn.send_bytes(data)


class _Worker:
    """One worker process (a fresh interpreter: fork+exec, safe beside torch's threads), its socket, a
    pidfd that becomes readable when it exits, and its progress slot (shared memory, two doubles)."""

    def __init__(self, spec: str, limits: dict[str, Any]):
        ours, theirs = socket.socketpair()
        fd = os.memfd_create("env-worker-progress")
        os.ftruncate(fd, PROGRESS.size)
        self.progress = memoryview(mmap.mmap(fd, PROGRESS.size)).cast("d")
        self.progress[0] = -1.0
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from rlhf.rl.environments.pool import serve; serve({theirs.fileno()}, {fd}, {os.getpid()})"],
            pass_fds=(theirs.fileno(), fd), stdin=subprocess.DEVNULL)
        theirs.close()
        os.close(fd)
        self.conn = Connection(ours.detach())
        self.conn.send_bytes(pickle.dumps((list(sys.path), spec, limits)))
        self.sentinel = os.pidfd_open(self.process.pid)
        self.started = time.monotonic()
        self.ready, self.ready_at = False, 0.0   # its handshake read; when it was sent
        self.failed: list[str] = []

    def alive(self) -> bool:
        return self.process.poll() is None

    def read(self) -> Any:
        """The next message that is not the start handshake (None when only the handshake was there)."""
        while self.conn.poll():
            kind, body = pickle.loads(self.conn.recv_bytes())
            if kind == "ready":
                self.ready, (self.failed, self.ready_at) = True, body
                continue
            return body
        return None

    def kill(self) -> None:
        if self.sentinel < 0:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the worker and whatever it forked
        except (ProcessLookupError, PermissionError):
            pass
        self.process.kill()
        self.process.wait(timeout=5)
        release_cgroup(self.process.pid)
        self.conn.close()
        os.close(self.sentinel)
        self.sentinel = -1


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        if w.alive():
            try:
                w.conn.send_bytes(pickle.dumps(("exit", [])))
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + 2.0
    for w in workers:
        try:
            w.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        w.kill()


class ProcessRunner:
    """`workers` processes running `env` (a class or `module:Class`), each call limited to `timeout_s`;
    `limits` (isolation.LIMITS: memory_mb, nproc, cpu_s, network) apply to every worker. Same methods
    as InlineRunner; a fault is a Reply with `error` set, never an exception."""

    def __init__(self, env: type[Environment] | str, workers: int, timeout_s: float, **limits: Any):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ConfigError(f"rollout.env_workers must be an integer >= 1 for the process pool, got {workers!r}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ConfigError(f"rollout.env_timeout_s must be > 0, got {timeout_s!r}")
        try:
            self.limits = check_limits(limits, "rollout.env_limits")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.spec = env_spec(env)
        self.timeout_s = float(timeout_s)
        if self.limits.get("nproc") is not None:
            release_stale_cgroups()
        self.where: dict[int, tuple[int, _Worker]] = {}   # episode -> (slot, the worker holding its env)
        self.lost: dict[int, str] = {}                     # episode -> why its env is gone (told on its next call)
        self.stats = {"timeouts": 0, "worker_deaths": 0, "replaced": 0, "lost_episodes": 0}
        self.workers = [_Worker(self.spec, self.limits) for _ in range(workers)]
        self._finalizer = weakref.finalize(self, _shutdown, self.workers)
        self._await_ready(self.workers)

    # ---------------------------------------------------------------- the runner contract
    def reset(self, episodes: list[int], rows: list[dict[str, Any]]) -> list[Reply]:
        """Start episodes on rows; a new episode goes to the worker holding the fewest open ones."""
        if len(episodes) != len(rows):
            raise ValueError(f"reset: {len(episodes)} episodes for {len(rows)} rows")
        load = [0] * len(self.workers)
        for slot, w in self.where.values():
            load[slot] += w is self.workers[slot]
        for e in episodes:
            self.lost.pop(e, None)
            held = self.where.get(e)
            if held is None or held[1] is not self.workers[held[0]]:
                slot = min(range(len(load)), key=load.__getitem__)
                load[slot] += 1
                self.where[e] = (slot, self.workers[slot])
        return self._call("reset", episodes, rows)

    def step(self, episodes: list[int], texts: list[str]) -> list[Reply]:
        if len(episodes) != len(texts):
            raise ValueError(f"step: {len(episodes)} episodes for {len(texts)} texts")
        return self._call("step", episodes, texts)

    def close(self, episodes: list[int] | None = None) -> None:
        """End episodes (all when None); an environment's close() that hangs costs its worker, nothing else."""
        episodes = list(self.where) if episodes is None else episodes
        open_ = [e for e in episodes if e in self.where]
        self._call("close", open_, [None] * len(open_))
        for e in episodes:
            self.where.pop(e, None)
            self.lost.pop(e, None)

    def shutdown(self) -> None:
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- dispatch and faults
    def _call(self, method: str, episodes: list[int], args: list[Any]) -> list[Reply | None]:
        out: list[Reply | None] = [None] * len(episodes)
        batches: dict[int, list[int]] = defaultdict(list)   # slot -> indices into episodes, in call order
        for i, e in enumerate(episodes):
            held = self.where.get(e)
            if held is not None and held[1] is self.workers[held[0]]:
                batches[held[0]].append(i)
            elif method != "close":
                why = self.lost.pop(e, None)  # lost with a worker, or never opened / already done (as inline)
                out[i] = Reply(done=True, error=ERROR_WORKER_DIED if why else ERROR_RAISED,
                               message=why or f"{method}: episode {e} is not open (not reset, or already done)")
                self.where.pop(e, None)
        busy: dict[int, tuple[_Worker, list[int], float]] = {}
        for slot, idx in batches.items():
            w = self.workers[slot]
            try:
                w.conn.send_bytes(pickle.dumps((method, [(episodes[i], args[i]) for i in idx])))
            except (OSError, ValueError):  # its pipe is broken: the worker is dead; the wait below sees it
                pass
            busy[slot] = (w, idx, time.monotonic())
        while busy:
            ready = wait([x for w, _, _ in busy.values() for x in (w.conn, w.sentinel)],
                         timeout=max(0.0, min(self._deadline(w, sent)[0] for w, _, sent in busy.values())
                                     - time.monotonic()))
            for slot, (w, idx, sent) in list(busy.items()):
                if w.conn not in ready and w.sentinel not in ready:
                    continue
                try:
                    msg = w.read()
                except (EOFError, OSError):
                    msg = None
                if msg is not None:
                    for i, reply in zip(idx, msg, strict=True):
                        if method == "close":
                            continue
                        out[i] = reply = Reply(*reply)
                        if reply.done:
                            self.where.pop(episodes[i], None)
                    del busy[slot]
                elif not w.alive():
                    current = int(w.progress[0])
                    culprit = idx[current] if 0 <= current < len(idx) and w.progress[1] >= sent else idx[0]
                    self._fail(slot, method, episodes, idx, culprit, out, timeout=False)
                    del busy[slot]
            for slot, (w, idx, sent) in list(busy.items()):
                deadline, current = self._deadline(w, sent)
                if time.monotonic() >= deadline and not w.conn.poll():   # a reply already there is taken, late or not
                    self._fail(slot, method, episodes, idx, idx[current], out, timeout=w.ready)
                    del busy[slot]
        return out

    def _deadline(self, w: _Worker, sent: float) -> tuple[float, int]:
        """When the worker's batch (sent at `sent`) is late, and the index of the call to blame then."""
        current, started = int(w.progress[0]), w.progress[1]
        if not w.ready:            # still starting: its start does not count against the calls' timeout
            return w.started + START_TIMEOUT_S, 0
        if started < sent:         # its first call not begun yet: pipe latency, unpickling, or the worker was
            return max(sent, w.ready_at) + self.timeout_s, 0   # still starting when the batch was sent
        # a call running (current >= 0), or the last one done and its replies being pickled (current -1)
        return started + self.timeout_s, current if current >= 0 else -1

    def _fail(self, slot: int, method: str, episodes: list[int], idx: list[int], culprit: int,
              out: list[Reply | None], *, timeout: bool) -> None:
        """The worker in `slot` hung or died while running episodes[culprit]'s call: replies for its batch,
        the lost mark on its other open episodes, a replacement in its slot."""
        w = self.workers[slot]
        w.kill()
        code = w.process.returncode
        e = episodes[culprit]
        if timeout:
            self.stats["timeouts"] += 1
            why = f"{method} ran past rollout.env_timeout_s={self.timeout_s:g}s; its worker was killed and replaced"
            cause = f"its worker was killed after episode {e}'s {method} timed out"
        else:
            self.stats["worker_deaths"] += 1
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            why = f"the worker died during {method} ({how}: killed, a segfault, os._exit, a CPU or memory limit)"
            cause = f"its worker died ({how}) during episode {e}'s {method}"
        seconds = time.monotonic() - w.progress[1] if w.progress[1] else 0.0
        for i in idx:
            if method == "close":
                continue
            if i == culprit:
                out[i] = Reply(done=True, error=ERROR_TIMEOUT if timeout else ERROR_WORKER_DIED, message=why,
                               seconds=seconds)
            else:
                out[i] = Reply(done=True, error=ERROR_WORKER_DIED, message=f"lost: {cause}")
                self.stats["lost_episodes"] += 1
        in_batch = {episodes[i] for i in idx}
        for other, (s, holder) in list(self.where.items()):
            if holder is w:
                del self.where[other]
                if other not in in_batch:
                    self.lost[other] = f"lost: {cause}"
                    self.stats["lost_episodes"] += 1
        self.workers[slot] = _Worker(self.spec, self.limits)  # the finalizer holds this same list
        self.stats["replaced"] += 1

    def _await_ready(self, workers: list[_Worker]) -> None:
        """Wait for the first workers' handshake: a limit the OS refuses is a ConfigError now, not a
        silently weaker sandbox."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for w in workers:
            while not w.ready:
                left = deadline - time.monotonic()
                if left <= 0 or not wait([w.conn, w.sentinel], timeout=left) or \
                        (not w.conn.poll() and not w.alive()):
                    self.shutdown()
                    raise ConfigError(f"rollout.env={self.spec!r}: a pool worker did not start "
                                      f"(exit code {w.process.poll()}); run with rollout.env_workers=0 to see why")
                try:
                    w.read()
                except (EOFError, OSError):
                    pass
            if w.failed:
                self.shutdown()
                raise ConfigError(f"rollout.env_limits {self.limits}: the OS refused: {'; '.join(w.failed)}")


def make_runner(env: type[Environment] | str, workers: int, timeout_s: float, **limits: Any):
    """The runner the rollout loop uses: InlineRunner when workers == 0 (no timeout, no limits: for
    debugging an environment), else the process pool of `workers` processes, each call limited to
    `timeout_s`, `limits` on each worker."""
    if workers == 0:
        return InlineRunner(load_environment(env) if isinstance(env, str) else env)
    return ProcessRunner(env, workers, timeout_s, **limits)
