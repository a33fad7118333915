"""The fork server (tests/forkserver.py) runs a command as a fresh `python -m` process would: the same
exit code, output, environment, sys.argv/sys.path, a timeout's TimeoutExpired, a kill's -9."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import forkserver
from conftest import cli_env

PROBE = '''
import json, os, random, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "main": __name__,
                  "spec": __spec__.name, "var": os.environ.get("PROBE_VAR"), "rlhf": os.environ.get("RLHF_X"),
                  "here": [p for p in sys.path if p.endswith("extra")], "random": random.random(),
                  "preloaded": "torch" in sys.modules}))
print("to stderr", file=sys.stderr)
import atexit
atexit.register(lambda: print("atexit ran", file=sys.stderr))
mode = sys.argv[1]
if mode == "exit3":
    sys.exit(3)
if mode == "raise":
    raise ValueError("boom")
if mode == "text":
    sys.exit("a message")
if mode == "c-level":
    os.write(1, b"raw fd 1\\n")
if mode == "sleep":
    import time
    time.sleep(60)
if mode == "kill":
    import signal
    os.kill(os.getpid(), signal.SIGKILL)
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    d = tmp_path_factory.mktemp("fs")
    (d / "probe_mod.py").write_text(PROBE)
    (d / "extra").mkdir()
    first = forkserver.run("probe_mod", ["ok"], cwd=d, env=_env(d, {"PROBE_VAR": "3"}), timeout=60)
    assert '"preloaded": false' in first.stdout  # an environment's first command: a plain process
    return d


def _env(probe, extra_env=None):
    return {**cli_env(), "PYTHONPATH": f"{probe}{os.pathsep}{probe / 'extra'}", **(extra_env or {})}


def _both(probe, mode, extra_env=None, timeout=60):
    env = _env(probe, extra_env)
    fresh = subprocess.run([sys.executable, "-m", "probe_mod", mode], cwd=probe, env=env, capture_output=True,
                           text=True, timeout=timeout)
    forked = forkserver.run("probe_mod", [mode], cwd=probe, env=env, timeout=timeout)
    return fresh, forked


@pytest.mark.parametrize("mode,rc", [("ok", 0), ("exit3", 3), ("raise", 1), ("text", 1), ("c-level", 0),
                                     ("kill", -9)])
def test_a_forked_run_is_a_fresh_process(probe, mode, rc):
    import json

    fresh, forked = _both(probe, mode, {"PROBE_VAR": "3", "RLHF_X": "a"})
    assert forked.returncode == fresh.returncode == rc
    a, b = (json.loads(p.stdout.splitlines()[0]) for p in (fresh, forked))
    assert a.pop("random") != b.pop("random")  # each child draws its own
    assert b.pop("preloaded") and not a.pop("preloaded")
    assert a == b
    assert a["argv"] == [str(probe / "probe_mod.py"), mode] and a["path0"] == str(probe) and a["var"] == "3"
    assert a["main"] == "__main__" and a["spec"] == "probe_mod" and a["here"] == [str(probe / "extra")]
    assert fresh.stdout.splitlines()[1:] == forked.stdout.splitlines()[1:]  # raw fd writes included
    assert ("raw fd 1" in forked.stdout) == (mode == "c-level")
    assert forked.stderr == fresh.stderr  # a traceback included
    assert ("ValueError: boom" in forked.stderr) == (mode == "raise")
    assert ("atexit ran" in forked.stderr) == (mode != "kill")


def test_variables_read_at_import_get_their_own_server_and_the_others_are_set_per_run(probe):
    import json

    env = {**cli_env(), "PYTHONPATH": str(probe), "PROBE_SERVER": "t2"}  # an environment no other test uses
    runs = [forkserver.run("probe_mod", ["ok"], cwd=probe, env={**env, **extra}, timeout=60)
            for extra in ({"RLHF_X": "1"}, {"RLHF_X": "2"}, {"RLHF_X": "3", "PROBE_VAR": "4"})]
    seen = [json.loads(r.stdout.splitlines()[0]) for r in runs]
    assert [s["rlhf"] for s in seen] == ["1", "2", "3"] and [s["var"] for s in seen] == [None, None, "4"]
    # RLHF_X varies within one server (started at the environment's second command); PROBE_VAR, which a
    # preloaded library might read, makes another environment (its first command: a plain process)
    assert [s["preloaded"] for s in seen] == [False, True, False]
    keys = [dict(k) for k in forkserver._servers if dict(k).get("PROBE_SERVER") == "t2"]
    assert len(keys) == 1 and "RLHF_X" not in keys[0] and "PROBE_VAR" not in keys[0]


def test_a_timeout_kills_the_child_and_raises_as_subprocess_does(probe):
    env = _env(probe, {"PROBE_VAR": "3"})
    with pytest.raises(subprocess.TimeoutExpired) as e:
        forkserver.run("probe_mod", ["sleep"], cwd=probe, env=env, timeout=3)
    assert e.value.timeout == 3 and '"argv"' in e.value.output
    again = forkserver.run("probe_mod", ["exit3"], cwd=probe, env=env, timeout=60)  # the server still serves
    assert again.returncode == 3


def test_the_python_shim_sends_modules_to_the_server_and_the_rest_to_python(probe):
    """shim_env (how the tests run scripts/run_all.sh): `python -m` through the server, with the exit
    statuses a shell sees from a fresh process; `python -c` the real interpreter."""
    import json

    script = ("python -m probe_mod ok; echo rc=$?; python -m probe_mod exit3; echo rc=$?; "
              "python -m probe_mod kill; echo rc=$?; python -c 'import sys; print(\"plain\", \"torch\" in sys.modules)'")
    env = _env(probe, {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]})
    runs = [subprocess.run(["bash", "-c", script], cwd=probe, env=e, capture_output=True, text=True, timeout=120)
            for e in (env, forkserver.shim_env(env))]
    for proc, preloaded in zip(runs, (False, True)):
        lines = proc.stdout.splitlines()
        probes = [json.loads(line) for line in lines if line.startswith("{")]
        assert len(probes) == 3 and all(p["preloaded"] == preloaded for p in probes)
        assert [line for line in lines if not line.startswith("{")] == ["rc=0", "rc=3", "rc=137", "plain False"]
        assert proc.stderr.count("to stderr") == 3 and proc.stderr.count("atexit ran") == 2


def test_a_killed_server_leaves_plain_processes(probe):
    """A server that dies (killed here) is not waited on: its environment's commands run as plain
    processes, with the same results."""
    import json

    env = _env(probe, {"PROBE_SERVER": "killed"})
    first, second = (forkserver.run("probe_mod", ["exit3"], cwd=probe, env=env, timeout=60) for _ in range(2))
    assert [json.loads(p.stdout.splitlines()[0])["preloaded"] for p in (first, second)] == [False, True]
    server = forkserver._servers[forkserver._key(env)]
    server.proc.kill()
    server.proc.wait()
    after = forkserver.run("probe_mod", ["exit3"], cwd=probe, env=env, timeout=60)
    assert after.returncode == 3 and '"preloaded": false' in after.stdout and "to stderr" in after.stderr
    assert forkserver._server(env) is None
