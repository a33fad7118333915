"""The package as users install it: a wheel built from the checkout's files, installed into a fresh venv,
run from an empty directory with no checkout on the path, through the `rlhf` command, `python -m` and the
Python API, which give the same numbers.

Offline and quick: the wheel is built without build isolation when setuptools is at hand (else pip
fetches the build backend), and the fresh venv sees this interpreter's site-packages through a .pth line
for the dependencies (torch, transformers, ...) while the package itself comes from the wheel: that
directory's own .pth files (an editable install's finder) are not run by a .pth line, and the test checks
where `rlhf` is imported from.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, SMALL_MODEL, cli_env, same_run, summary
from rlhf.__main__ import COMMANDS

pytestmark = pytest.mark.slow

# what the installed package must carry (checkout path -> the same under rlhf/assets/ in the wheel)
SHIPPED_DATA = ["data/default/sft_train.jsonl", "data/default/pairs_train.jsonl", "data/default/pairs_eval.jsonl",
                "data/default/prompts_train.jsonl", "data/default/eval_prompts.jsonl", "data/tokenizer/tokenizer.json",
                "data/tokenizer/tokenizer_config.json", "data/tokenizer/chat_template.jinja"]
SFT = ["train.max_steps=3", "train.eval_every=0", "train.save_every=0", "data.num_eval_prompts=4",
       "eval.max_new_tokens=4", *SMALL_MODEL]
GRPO = ["algorithm=grpo", "reward.sources=[judge]", "train.max_steps=2", "train.eval_every=0", "train.save_every=0",
        "data.num_eval_prompts=4", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=4",
        "rollout.mini_batch_size=8", "rollout.max_new_tokens=4", "eval.max_new_tokens=4"]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The checkout's files (tracked, or new and not ignored: no build/, outputs/ or caches of this
    checkout can leak in), as a fresh clone has them."""
    src = tmp_path_factory.mktemp("source") / "src"
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    return src


def build_wheel(src: Path, out: Path) -> Path:
    """`pip wheel` of a source tree or an sdist, as pip builds it for an install."""
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, str(src), "-w", str(out)],
                   check=True, capture_output=True, text=True, timeout=600)
    (found,) = out.glob("rlhf_pipeline-*.whl")
    return found


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
    return build_wheel(source, tmp_path_factory.mktemp("wheel"))


def test_the_sdist_builds_the_same_wheel(source, wheel, tmp_path):
    """A package index serves the sdist too: MANIFEST.in must carry what setup.py copies into the wheel."""
    sdist = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                            "print(b.build_sdist(sys.argv[1]))", str(tmp_path / "sdist")], cwd=source,
                           capture_output=True, text=True, timeout=300)
    if sdist.returncode != 0 and not importlib.util.find_spec("setuptools"):
        pytest.skip("setuptools is not installed here (pip builds in isolation): no sdist without it")
    assert sdist.returncode == 0, sdist.stderr[-3000:]
    via_sdist = build_wheel(tmp_path / "sdist" / sdist.stdout.strip().splitlines()[-1], tmp_path / "dist")
    assert sorted(zipfile.ZipFile(via_sdist).namelist()) == sorted(zipfile.ZipFile(wheel).namelist())


def test_the_wheel_carries_the_configs_tokenizer_and_default_data_and_nothing_else(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    conf = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "conf").rglob("*.yaml"))
    assert len(conf) >= 30
    for rel in conf + SHIPPED_DATA:
        assert f"rlhf/assets/{rel}" in names, rel
    with zipfile.ZipFile(wheel) as z:  # byte for byte the checkout's
        assert z.read("rlhf/assets/data/default/sft_train.jsonl") == (ROOT / "data/default/sft_train.jsonl").read_bytes()
        entry = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "rlhf = rlhf.__main__:main" in entry
    code = sorted(p.relative_to(ROOT).as_posix() for d in ("rlhf", "engine", "kernels") for p in (ROOT / d).rglob("*.py")
                  if "__pycache__" not in p.parts)
    assert set(code) <= set(names), set(code) - set(names)
    assets = [n for n in names if n.startswith("rlhf/assets/")]
    assert len(assets) == len(conf) + len(SHIPPED_DATA)  # only those: no pairs_train_2/3, no data/tools
    top = {n.split("/")[0] for n in names}
    assert top == {"rlhf", "engine", "kernels", wheel.name.split("-py3")[0] + ".dist-info"}, top  # no tests/, scripts/
    for bad in ("__pycache__", ".pyc", "outputs/", "runs/", ".egg-info", "wandb/", ".pytest_cache"):
        assert not [n for n in names if bad in n], bad
    assert wheel.stat().st_size < 4 * 2**20  # MB, compressed: the default data is ~2 MB of it


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv holding the wheel; this interpreter's site-packages visible for the dependencies."""
    v = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(v)], check=True, timeout=120)
    python = v / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(purelib, "_rlhf_test_dependencies.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, text=True, timeout=300)
    return v


def user_env() -> dict[str, str]:
    env = cli_env()
    env.pop("PYTHONPATH", None)  # no checkout on the path
    return env


def run(argv: list, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, f"{argv}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


API = """
from rlhf import api
sft = api.run("sft", "output_dir=api/sft", *{sft!r})
grpo = api.run("ppo", "actor.model=api/sft", "output_dir=api/grpo", *{grpo!r})
print(sft["steps"], grpo["steps"])
"""


def test_installed_from_an_empty_directory_the_command_and_the_api_give_the_same_run(venv, tmp_path):
    python, assets = venv / "bin" / "python", None
    where = run([python, "-c", "import rlhf, rlhf.core.paths as p; print(rlhf.__file__); print(p.ROOT)"], tmp_path)
    module_file, root = where.stdout.split()
    assert Path(module_file).is_relative_to(venv) and Path(root).is_relative_to(venv), where.stdout  # the wheel's
    assets = Path(root)
    assert assets.name == "assets" and (assets / "conf" / "sft.yaml").is_file()
    # the command line: `rlhf sft`, then `python -m rlhf.ppo algorithm=grpo` on its output
    run([venv / "bin" / "rlhf", "sft", "output_dir=cli/sft", *SFT], tmp_path)
    run([python, "-m", "rlhf.ppo", "actor.model=cli/sft", "output_dir=cli/grpo", *GRPO], tmp_path)
    # the Python API, the same stages and overrides
    api = run([python, "-c", textwrap.dedent(API.format(sft=SFT, grpo=GRPO))], tmp_path)
    assert api.stdout.strip().splitlines()[-1] == "3 2"
    for stage in ("sft", "grpo"):
        same_run(tmp_path / "cli" / stage, tmp_path / "api" / stage)
    s, g = summary(tmp_path / "cli" / "sft"), summary(tmp_path / "cli" / "grpo")
    assert s["eval_source"].startswith(f"data.path={assets / 'data/default/sft_train.jsonl'} ")  # ${root:...}
    assert s["eval_prompts_source"] == f"data.eval_prompts_path={assets / 'data/default/eval_prompts.jsonl'}"
    assert (s["version"], s["commit"]) == (g["version"], g["commit"]) == ("0.1.0", None)  # installed: no commit
    assert g["steps"] == 2 and g["reward_sources"] == ["judge"]
    assert sorted(os.listdir(tmp_path)) == ["api", "cli"]  # nothing written beside the runs' own directories
    # what the installed command says about itself, and its one-line refusal
    env = run([venv / "bin" / "rlhf", "env"], tmp_path)
    assert env.stdout.splitlines()[0] == f"rlhf-pipeline 0.1.0 (installed, data in {assets})"
    assert run([venv / "bin" / "rlhf", "--version"], tmp_path).stdout == "rlhf-pipeline 0.1.0 (no checkout)\n"
    wrong = run([venv / "bin" / "rlhf", "pipeline"], tmp_path, check=False)
    assert wrong.returncode == 2 and wrong.stderr.strip().splitlines() == [
        f"rlhf: unknown command 'pipeline' (commands: {', '.join(COMMANDS)}; "
        "rlhf --help; the whole pipeline is bash scripts/run_all.sh in a checkout)"]
    # a user's relative path resolves against their working directory, as in the checkout
    rows = (assets / "data/default/sft_train.jsonl").read_text().splitlines(keepends=True)[:200]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "sft.jsonl").write_text("".join(rows))
    run([venv / "bin" / "rlhf", "sft", "data.path=mine/sft.jsonl", "output_dir=cli/mine", *SFT[:1], *SMALL_MODEL], tmp_path)
    mine = summary(tmp_path / "cli" / "mine")
    assert mine["eval_source"].startswith("data.path=mine/sft.jsonl ") and mine["eval_rows"] == 4  # 2% of 200
    missing = run([venv / "bin" / "rlhf", "sft", "data.path=nope.jsonl"], tmp_path, check=False)
    assert (missing.returncode, missing.stderr) == (2, "error (configuration/data): data file not found: nope.jsonl\n")
