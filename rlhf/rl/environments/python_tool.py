"""The built-in Python tool (`rollout.env=rlhf.rl.environments.python_tool:PythonTool`): the model writes
code in a `<python>...</python>` block; the tool runs it in a fresh interpreter and inserts what it
printed (stdout and stderr interleaved, cut to `max_output_chars`) as `<output>...</output>`. A turn
with no block ends the episode, as does the `max_calls`-th block.

Each run is a child `python -I` (isolated mode: no PYTHONPATH, no user site, an empty environment but
PATH/LANG, so no tokens leak to the model's code) whose bootstrap (BOOTSTRAP below), before the code:

    1. unshares a user + network namespace: no interface, so no network (OS-enforced); where the
       kernel refuses, the audit hook below still refuses creating a socket
    2. sets RLIMIT_AS (memory_mb beyond its start), RLIMIT_CPU, RLIMIT_FSIZE (no file, the output
       included, grows past max_output_bytes), RLIMIT_NPROC
    3. chdirs to the episode's scratch dir and installs an audit hook (PEP 578) that refuses opening a
       file for writing outside it, removing/renaming/linking/chmod-ing/mkdir-ing outside it, any new
       process (fork, exec, spawn, system, subprocess), sockets, and importing ctypes / _posixsubprocess / gc; its state lives in a closure, not in a module

and the parent kills the child's process group at `timeout_s` of wall time.

What is and is not guaranteed: the network namespace and the rlimits are the kernel's, a determined
program cannot undo them. The write and process rules are an audit hook inside the same interpreter as
the code: it stops ordinary code and mistakes (open('/x', 'w'), os.remove, subprocess), not an adversary
who finds a way around the hook (e.g. a C extension already in site-packages that writes files, or
corrupting the interpreter's memory). Reading files is not restricted. For untrusted code facing real
attackers, run the pool inside a container or VM; this tool is a guard for a policy's tool calls.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from rlhf.rl.environments.base import Environment, Step

TAG = re.compile(r"<python>(.*?)</python>", re.DOTALL)

# Runs in the child before the model's code; self-contained (no rlhf import under -I). argv: scratch dir,
# the limits as JSON. The code comes on stdin.
BOOTSTRAP = r'''
def sandbox():
    import ctypes, json, os, resource, signal, sys, traceback
    scratch, limits, status_fd = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    code = sys.stdin.read()
    network = "audit hook"
    if ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000) == 0:   # CLONE_NEWUSER | CLONE_NEWNET
        network = "namespace"
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # a write past RLIMIT_FSIZE fails (EFBIG), not the process
    for name, value in (("RLIMIT_AS", vm + limits["memory_mb"] * 2**20), ("RLIMIT_CPU", limits["cpu_s"]),
                        ("RLIMIT_FSIZE", limits["max_output_bytes"]), ("RLIMIT_NPROC", limits["nproc"])):
        hard = resource.getrlimit(getattr(resource, name))[1]   # inside a limited pool worker: stay under its
        value = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
        resource.setrlimit(getattr(resource, name), (value, value))
    os.chdir(scratch)
    # the hook's state is in this closure, not in a module the code can reach through sys.modules
    root, realpath, fsdecode = os.path.realpath(scratch) + os.sep, os.path.realpath, os.fsdecode
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    path_events = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1, "os.utime": 1,
                   "os.truncate": 1, "os.rename": 2, "os.link": 2, "os.symlink": 2, "shutil.rmtree": 1}
    refused = frozenset({"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                         "subprocess.Popen", "os.kill", "os.killpg", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
                         "socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo",
                         "os.chroot", "sys.addaudithook"})
    modules = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "gc"})

    def inside(path):
        if isinstance(path, int):
            return True                               # an fd already open: its opening was checked
        try:
            return (realpath(fsdecode(path)) + "/").startswith(root)
        except TypeError:
            return False

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in mode for c in "wax+")) or (flags or 0) & write_flags
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the scratch dir is refused")
        elif event in path_events:
            for path in args[:path_events[event]]:
                if not inside(path):
                    raise PermissionError(f"sandbox: {event} on {path!r} outside the scratch dir is refused")
        elif event in refused:
            raise PermissionError(f"sandbox: {event} is refused (network: {network})")
        elif event == "import" and args[0] in modules:
            raise ImportError(f"sandbox: importing {args[0]} is refused")

    with open(status_fd, "w") as f:
        f.write(json.dumps({"network": network}))
    for name in ("ctypes", "_ctypes", "gc"):
        sys.modules.pop(name, None)
    print_exception = traceback.print_exception
    sys.addaudithook(hook)
    return code, print_exception


code, print_exception = sandbox()
del sandbox
try:
    exec(compile(code, "<python>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:                            # the model's traceback, without the bootstrap's frame
    print_exception(type(e), e, e.__traceback__.tb_next)
    raise SystemExit(1)
'''


class PythonTool(Environment):
    """Runs the model's `<python>` blocks in a sandboxed child interpreter (see the module docstring);
    subclass it to change the limits (class attributes)."""

    timeout_s = 5.0             # wall clock per block; the child's process group is killed past it
    memory_mb = 256             # address space the code may add to the interpreter's
    max_output_chars = 2000     # the observation's output is cut to this many characters
    max_output_bytes = 1 << 20  # RLIMIT_FSIZE: the output file (and any file the code writes) stops here
    nproc = 64                  # RLIMIT_NPROC (processes are refused by the audit hook anyway)
    max_calls = 4               # blocks per episode; the next turn after the last ends the episode

    def reset(self, row) -> None:   # no first observation: the prompt asks the question
        self.scratch = tempfile.mkdtemp(prefix="rlhf-python-tool-")
        self.calls = 0

    def step(self, text: str) -> Step:
        match = TAG.search(text)
        if match is None or self.calls >= self.max_calls:
            return Step(None, info={"calls": self.calls})
        self.calls += 1
        output, info = self.run(match.group(1))
        return Step(f"<output>\n{output}</output>", info={"calls": self.calls, **info})

    def run(self, code: str) -> tuple[str, dict]:
        """Run `code` in the sandbox -> (its output, cut; info: exit code, timed_out, network isolation)."""
        limits = {"memory_mb": self.memory_mb, "cpu_s": max(1, int(self.timeout_s) + 1),
                  "max_output_bytes": self.max_output_bytes, "nproc": self.nproc}
        start = time.monotonic()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as status:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-u", "-c", BOOTSTRAP, self.scratch, json.dumps(limits), str(status.fileno())],
                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, cwd=self.scratch,
                env={"PATH": os.defpath, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"},
                pass_fds=(status.fileno(),), start_new_session=True)
            timed_out = False
            try:
                proc.communicate(code.encode(), timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            out.seek(0)
            raw = out.read(4 * self.max_output_chars + 4)
            status.seek(0)
            try:   # the bootstrap's one line, written (and its fd closed) before the code ran
                network = json.loads(status.read())["network"]
            except (ValueError, KeyError, TypeError):
                network = "not started"
        text = raw.decode("utf-8", errors="replace")
        if len(text) > self.max_output_chars:
            text = text[:self.max_output_chars] + f"\n[output cut at {self.max_output_chars} characters]"
        if timed_out:
            text += f"\n[timed out after {self.timeout_s:g}s]"
        return text, {"exit_code": proc.returncode, "timed_out": timed_out, "network": network,
                      "seconds": round(time.monotonic() - start, 4)}

    def close(self) -> None:
        if getattr(self, "scratch", None):
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
