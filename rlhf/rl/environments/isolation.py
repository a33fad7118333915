"""The OS limits a process can put on itself before it runs an environment's code: resource limits
(setrlimit) and Linux namespaces (unshare), for the pool's workers (pool.py) and the Python tool's
child interpreter (python_tool.py). Everything here is best effort where the OS refuses, and says so:
`isolate` returns what it could not do instead of raising.

RLIMIT_NPROC counts every process of the user and the kernel does not enforce it for root (measured
here: root, with or without a new user namespace, forks past it). So for root, `nproc` also puts the
process in a pids cgroup of its own (`pids.max`; cgroup v1 /sys/fs/cgroup/pids or v2 /sys/fs/cgroup),
removed by `release_cgroup` once the process is gone; where neither works, a fork bomb is still ended by
the call's timeout, which kills the worker's whole process group. No network: a new network namespace
(inside a new user namespace, so no root is needed), with no interface but a down loopback.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import signal
from typing import Any

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
MIB = 1 << 20

# the limits a ProcessRunner / PythonTool accepts, with what each sets
LIMITS = {
    "memory_mb": "RLIMIT_AS: address space a worker may add to what it has after start, MiB (past it: MemoryError)",
    "nproc": "RLIMIT_NPROC: processes a worker may have at once, itself included (a fork bomb gets EAGAIN)",
    "cpu_s": "RLIMIT_CPU: CPU seconds of a worker's whole life (past it the kernel kills it: SIGXCPU/SIGKILL)",
    "network": "False: the worker gets its own empty network namespace (no interface, no route)",
}


def check_limits(limits: dict[str, Any], key: str = "limits") -> dict[str, Any]:
    """The limits as given, checked: known names, positive numbers, network a bool; ValueError naming
    the bad one (the caller turns it into its ConfigError)."""
    unknown = sorted(set(limits) - set(LIMITS))
    if unknown:
        raise ValueError(f"{key}: unknown limit(s) {unknown}; known: {sorted(LIMITS)}")
    out = {k: v for k, v in limits.items() if v is not None}   # None = that limit off (network: on)
    for name in ("memory_mb", "nproc", "cpu_s"):
        value = out.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"{key}.{name} must be a positive number or None, got {value!r}")
    if "network" in out and not isinstance(out["network"], bool):
        raise ValueError(f"{key}.network must be true or false, got {out['network']!r}")
    return out


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (PR_SET_PDEATHSIG), even if it is stuck in an
    environment's call; exit now if the parent is already gone."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)


def unshare(flags: int) -> str | None:
    """unshare(2) on this process (it must be single-threaded for a user namespace); None, or why not."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    if libc.unshare(ctypes.c_int(flags)) != 0:
        err = ctypes.get_errno()
        return f"unshare({flags:#x}) failed: {os.strerror(err)}"
    return None


def cgroup_dir(pid: int) -> str | None:
    """The pids cgroup a process `pid` would get (None: no writable pids hierarchy here)."""
    for root in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
        pids = root.endswith("/pids") or "pids" in _read(f"{root}/cgroup.controllers").split()
        if pids and os.path.exists(f"{root}/cgroup.procs") and os.access(root, os.W_OK):
            return f"{root}/rlhf-env-{pid}"
    return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def join_pids_cgroup(nproc: int) -> str | None:
    """Put this process in a new pids cgroup with pids.max = nproc; None, or why not."""
    path = cgroup_dir(os.getpid())
    if path is None:
        return "no writable pids cgroup (RLIMIT_NPROC alone does not bind root)"
    try:
        os.makedirs(path, exist_ok=True)
        with open(f"{path}/pids.max", "w") as f:
            f.write(str(nproc))
        with open(f"{path}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:
        return f"pids cgroup {path}: {e}"
    return None


def release_cgroup(pid: int) -> None:
    """Remove the pids cgroup of a process that is gone (nothing when it had none)."""
    path = cgroup_dir(pid)
    if path and os.path.isdir(path):
        try:
            os.rmdir(path)
        except OSError:
            pass


def release_stale_cgroups() -> None:
    """Remove the pids cgroups of workers that are gone without their pool's cleanup (a trainer killed
    with -9: its workers die with it, their empty cgroups stay). A non-empty one is left alone (rmdir fails)."""
    path = cgroup_dir(0)
    if path is None:
        return
    root = os.path.dirname(path)
    for name in os.listdir(root):
        pid = name.removeprefix("rlhf-env-")
        if name.startswith("rlhf-env-") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            release_cgroup(int(pid))


def vm_size() -> int:
    """This process's address space now, bytes (VmSize), 0 where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:")), 0)
    except OSError:
        return 0


def isolate(memory_mb: float | None = None, nproc: int | None = None, cpu_s: float | None = None,
            network: bool = True) -> list[str]:
    """Apply the limits to this process (and what it starts); returns what could not be applied, one
    line each (empty = all applied). Call it before the process starts threads."""
    failed = []
    if nproc is not None and os.geteuid() == 0:
        why = join_pids_cgroup(int(nproc))
        if why:
            failed.append(why)
    if not network:  # a network namespace needs CAP_SYS_ADMIN: the new user namespace gives it
        why = unshare(CLONE_NEWUSER | CLONE_NEWNET)
        if why:
            failed.append(why)
    base = {"RLIMIT_AS": vm_size(), "RLIMIT_NPROC": 0, "RLIMIT_CPU": 0}
    for name, value, scale in (("RLIMIT_AS", memory_mb, MIB), ("RLIMIT_NPROC", nproc, 1), ("RLIMIT_CPU", cpu_s, 1)):
        if value is None:
            continue
        limit = base[name] + int(value * scale)
        try:
            hard = resource.getrlimit(getattr(resource, name))[1]
            if hard != resource.RLIM_INFINITY:
                limit = min(limit, hard)
            # RLIMIT_CPU: the soft limit sends SIGXCPU (default: terminate), the hard one SIGKILL a second later
            resource.setrlimit(getattr(resource, name), (limit, limit + (1 if name == "RLIMIT_CPU" else 0)))
        except (ValueError, OSError) as e:
            failed.append(f"setrlimit({name}, {limit}) failed: {e}")
    return failed
