"""`python -m <module> args...` without paying the imports each time: a Python that has imported the
heavy libraries once (torch, transformers and its model classes, datasets, peft, hydra, matplotlib)
forks a child per command, and the child runs the module as `python -m` does.

A stage run of a few steps spends about half its wall time importing (~8 s of ~14 s on 2 cores); the
suite launches hundreds of them. What a child sees is what a fresh process sees:

- the same interpreter, flags and environment (one server per environment: a library reads some
  variables when it is imported), the command's working directory, `sys.argv` and `sys.path[0]` as
  `-m` sets them, a fresh `__main__` module, `runpy._run_module_as_main` (what `-m` calls);
- the caller's own stdin/stdout/stderr: the client passes its file descriptors over the server's UNIX
  socket (SCM_RIGHTS) and the child installs them as 0, 1, 2, so C-level output lands where it would;
  what the server's imports printed (import-time warnings) is written there first;
- the exit status a fresh process has (a `sys.exit`, an uncaught exception's traceback and 1, a
  signal's -N), and the interpreter's normal shutdown (atexit handlers, non-daemon threads joined);
- a collector that leaves the preloaded objects alone (`gc.freeze()`, as the gc module's documentation
  advises before a fork: otherwise a child's exit spends ~3 s copying the pages the collector touches).
  Those objects are still alive when the child's interpreter ends, so triton's bindings (nanobind) print
  a "leaked" report a fresh process does not: `run()` drops that report from the end of stderr;
- freshly seeded `random` and `numpy.random` (the generators a fork would otherwise share); torch's
  default generator is untouched by the imports, so it starts from its fixed default as in a new process.

The server refuses to start (callers then run plain processes) if its imports started a thread: forking
a process with threads is not safe. It refuses a command whose environment differs from its own in a
variable a preloaded library might read at import; the variables in VARIES (read only by code the server
does not preload, or at startup: PYTHONPATH, which the child redoes) may differ, and the child sets them.

Two clients: `run()`, which the tests call as they would call subprocess.run, and `shim_env()`, an
environment whose `python` on PATH is a small script sending `python -m <module> ...` to the server
and running anything else with the real interpreter (for scripts/run_all.sh, which launches each stage
with `python -m`). `RLHF_TESTS_FORKSERVER=0`: plain processes everywhere.
"""
from __future__ import annotations

import atexit
import json
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import tempfile

PRELOAD = (
    "torch", "numpy", "transformers", "transformers.models.llama.modeling_llama",
    "transformers.models.opt.modeling_opt", "transformers.models.qwen2.modeling_qwen2", "datasets", "peft",
    "hydra", "omegaconf", "tqdm", "matplotlib", "matplotlib.figure", "safetensors.torch",
)

# Read by none of the preloaded libraries: ours, wandb/trackio/mlflow (imported by the child), pytest's,
# run_all.sh's knobs, what bash adds, and PYTHONPATH (redone by the child as the interpreter's startup).
VARIES = ("PYTHONPATH", "ENGINE_KILL_AT", "PWD", "OLDPWD", "SHLVL", "_", "PS1", "OUTPUT_DIR", "PRESET", "SEEDS", "ALGO",
          "PIPELINE", "TASK", "TOOL", "RM_ENSEMBLE", "FORCE", "LAUNCH")
VARIES_PREFIX = ("WANDB_", "TRACKIO_", "MLFLOW_", "RLHF_", "PYTEST_")
SOCKET_ENV = "RLHF_TESTS_FORKSERVER_SOCKET"


def _key(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k not in VARIES and not k.startswith(VARIES_PREFIX)))


class _Run(BaseException):
    """Raised in a forked child to leave the server's loop: the module then runs at the top level."""

    def __init__(self, module: str):
        self.module = module


# ----------------------------------------------------------------------------- the server


def _pythonpath(env) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _set_env(env: dict[str, str]) -> None:
    """The request's environment; sys.path's PYTHONPATH part (after sys.path[0]) redone from it."""
    rest = sys.path[1:]
    for p in _pythonpath(os.environ):  # startup put them right after sys.path[0], in order
        if rest and rest[0] == p:
            rest.pop(0)
    os.environ.clear()
    os.environ.update(env)
    sys.path[1:] = [*_pythonpath(env), *rest]
    import importlib

    importlib.invalidate_caches()


def _child(conn, listener, fds: list[int], req: dict, printed: list[bytes]) -> None:
    """In the forked child: the caller's fds as 0/1/2 (first what the server's imports printed), its
    directory, environment and argv."""
    conn.close()
    listener.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    for fd, text in zip((1, 2), printed):
        if text:
            os.write(fd, text)
    os.chdir(req["cwd"])
    _set_env(req["env"])
    sys.argv = ["-m", *req["args"]]
    sys.path[0] = os.getcwd()
    raise _Run(req["module"])


def serve(path: str, ready_fd: int) -> None:
    import gc
    import importlib
    import threading

    mine = _key(dict(os.environ))  # as started: the imports may set variables of their own
    printed = []  # what the imports print (import-time warnings): each child writes it first, as a fresh process would
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            for name in PRELOAD:
                try:
                    importlib.import_module(name)
                except ImportError:  # a model family this transformers lacks: the child imports it if used
                    pass
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
        for f in (out, err):
            f.seek(0)
            printed.append(f.read())
    threads = threading.active_count()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(8)
    os.write(ready_fd, (json.dumps({"ready": threads == 1, "threads": threads}) + "\n").encode())
    os.close(ready_fd)
    if threads != 1:
        return
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready:  # the owner closed our stdin: done
            return
        conn, _ = listener.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        req = json.loads(msg)
        if _key(req["env"]) != mine or len(fds) != 3:
            conn.send(json.dumps({"refused": "environment"}).encode())
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        gc.freeze()  # the preloaded objects out of the collector's reach: a child's collections (at exit
        pid = os.fork()  # above all) would otherwise touch, so copy, every page of them (3 s of a child's exit)
        if pid == 0:
            _child(conn, listener, fds, req, printed)
        for fd in fds:
            os.close(fd)
        conn.send(json.dumps({"pid": pid}).encode())
        _, status = os.waitpid(pid, 0)
        try:
            conn.send(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:  # the client went away (killed): nothing to tell
            pass
        conn.close()


def main() -> None:
    try:
        serve(sys.argv[1], int(sys.argv[2]))
        return
    except _Run as run:
        module = run.module
    # a forked child, out of the server's frames (and of the except clause: an exception of the module's
    # must not read "during handling of _Run")
    import random
    import runpy
    import types

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        runpy._run_module_as_main(module, alter_argv=True)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # the traceback `python -m` prints: from runpy's frame down, then exit code 1
        e = e.with_traceback(e.__traceback__.tb_next)  # the hook prints the exception's own traceback
        sys.excepthook(type(e), e, e.__traceback__)
        sys.exit(1)


# ----------------------------------------------------------------------------- the clients


def request(path: str, module: str, args: list[str], cwd: str, env: dict[str, str], fds: list[int]):
    """Send one command to the server at `path`; the connection (its next message: {"rc"}) and the
    child's pid, or (None, None) if the server refused it."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    socket.send_fds(conn, [json.dumps({"module": module, "args": list(args), "cwd": str(cwd),
                                       "env": env}).encode()], fds)
    reply = json.loads(conn.recv(1 << 16) or b'{"refused": "gone"}')
    if "pid" not in reply:
        conn.close()
        return None, None
    return conn, reply["pid"]


class _Server:
    def __init__(self, env: dict[str, str]):
        self.dir = tempfile.mkdtemp(prefix="forkserver-")
        self.path = os.path.join(self.dir, "socket")
        r, w = os.pipe()  # the server says on `w` whether it is ready
        self.proc = subprocess.Popen([sys.executable, __file__, self.path, str(w)], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(w,))
        os.close(w)
        with os.fdopen(r) as f:  # a server that dies says nothing (EOF); one that hangs, nothing in time
            line = f.readline() if select.select([f], [], [], 600)[0] else ""
        self.ok = bool(line) and json.loads(line)["ready"]
        if not self.ok:
            self.close()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


_servers: dict[tuple, _Server] = {}
_seen: dict[tuple, int] = {}


def _server(env: dict[str, str], now: bool = False) -> _Server | None:
    """The server for `env`, or None: for an environment's first command (starting a server costs what
    the imports cost, so an environment seen once, e.g. a test's own HF_HOME, runs a plain process)
    unless `now`, and where a server refused (threads after its imports)."""
    key = _key(env)
    _seen[key] = _seen.get(key, 0) + 1
    if key not in _servers and (now or _seen[key] >= 2):
        _servers[key] = _Server(env)
    return _servers[key] if key in _servers and _servers[key].ok else None


@atexit.register
def _close() -> None:
    for server in _servers.values():
        if server.ok:
            server.close()
    _servers.clear()


def _enabled() -> bool:
    return os.environ.get("RLHF_TESTS_FORKSERVER", "1") != "0"


_LEAK_REPORT = re.compile(r"^nanobind: leaked .*^See https://nanobind\.readthedocs\.io/en/latest/refleaks\.html\n?\Z",
                          re.S | re.M)


def run(module: str, args: list[str], *, cwd, env: dict[str, str], timeout: float,
        fresh: bool = False) -> subprocess.CompletedProcess:
    """`python -m module args` in `cwd` with `env`, as subprocess.run(..., capture_output=True, text=True,
    timeout=timeout) would run it (TimeoutExpired included), through a server when one can serve
    (`fresh`: always a plain process)."""
    cmd = [sys.executable, "-m", module, *args]
    server = _server(env) if _enabled() and not fresh else None
    conn = None
    if server is not None:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull) as null:
            try:
                conn, pid = request(server.path, module, [str(a) for a in args], str(cwd), env,
                                    [null.fileno(), out.fileno(), err.fileno()])
            except OSError:  # the server is gone (killed): plain processes for this environment from now on
                server.ok = False
                server.close()
                conn = None
            if conn is not None:
                with conn:
                    timed_out = not select.select([conn], [], [], timeout)[0]
                    if timed_out:
                        os.kill(pid, signal.SIGKILL)
                    reply = conn.recv(1 << 16)
                if not reply:
                    raise RuntimeError(f"the fork server lost {shlex.join(cmd)}")
                texts = []
                for f in (out, err):
                    f.seek(0)
                    texts.append(f.read().decode(errors="replace"))
                leak = _LEAK_REPORT.search(texts[1])
                if leak:
                    texts[1] = texts[1][:leak.start()]
                if timed_out:
                    raise subprocess.TimeoutExpired(cmd, timeout, output=texts[0], stderr=texts[1])
                return subprocess.CompletedProcess(cmd, json.loads(reply)["rc"], texts[0], texts[1])
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


SHIM = '''#!{python}
# `python` for scripts run by the tests: `python -m <module> ...` goes to the fork server
# (tests/forkserver.py), anything else to the real interpreter.
import os, sys
argv = sys.argv[1:]
path = os.environ.get("{socket_env}")
if path and len(argv) >= 2 and argv[0] == "-m":
    sys.path.insert(0, {here!r})
    import json, signal, forkserver
    conn, pid = forkserver.request(path, argv[1], argv[2:], os.getcwd(), dict(os.environ), [0, 1, 2])
    if conn is not None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # passed on to the stage
            signal.signal(sig, lambda s, f: os.kill(pid, s))
        reply = conn.recv(1 << 16)
        rc = json.loads(reply)["rc"] if reply else 1
        if rc < 0:  # the same status for the shell: killed by that signal
            if -rc not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(-rc, signal.SIG_DFL)
            os.kill(os.getpid(), -rc)
        sys.exit(rc)
os.execv({python!r}, [{python!r}, *argv])
'''


def shim_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with a `python` first on PATH that sends `python -m <module>` to a server for that
    environment (started now) and execs the real interpreter for the rest; `env` as is when disabled."""
    if not _enabled():
        return env
    shim_dir = os.path.join(tempfile.gettempdir(), f"forkserver-shim-{os.getpid()}")
    if not os.path.isfile(os.path.join(shim_dir, "python")):
        os.makedirs(shim_dir, exist_ok=True)
        with open(os.path.join(shim_dir, "python"), "w") as f:
            f.write(SHIM.format(python=sys.executable, socket_env=SOCKET_ENV, here=os.path.dirname(__file__)))
        os.chmod(os.path.join(shim_dir, "python"), 0o755)
        atexit.register(lambda: __import__("shutil").rmtree(shim_dir, ignore_errors=True))
    out = {**env, "PATH": shim_dir + os.pathsep + env.get("PATH", "")}
    server = _server(out, now=True)
    return {**out, SOCKET_ENV: server.path} if server is not None else env


if __name__ == "__main__":
    main()
