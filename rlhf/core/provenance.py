"""Which code made a run: the installed package's version and, from a checkout, its git commit.

`python -m rlhf.env` prints them, every summary.json records them (`version`, `commit`), and every
checkpoint keeps them, so that a run resumed by other code says so (rlhf/run/stage.py).
"""
from __future__ import annotations

import functools
import importlib.metadata
import subprocess

from rlhf.core.paths import CHECKOUT, ROOT

DISTRIBUTION = "rlhf-pipeline"  # pyproject.toml's [project] name


@functools.cache
def package_version() -> str:
    """The installed distribution's version (an editable install: pyproject.toml's at install time)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # the checkout on sys.path, never installed
        return "not installed"


@functools.cache
def git_commit() -> str | None:
    """HEAD of the checkout this code runs from, `+dirty` when tracked files differ from it; None for an
    installed package (it reads no checkout) or when git cannot tell (no git, not a repository)."""
    if ROOT != CHECKOUT or not (CHECKOUT / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(CHECKOUT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(CHECKOUT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def provenance() -> dict[str, str | None]:
    """{"version": ..., "commit": ...}: what summary.json and each checkpoint record."""
    return {"version": package_version(), "commit": git_commit()}


def describe(record: dict) -> str:
    """A provenance record as words: "0.1.0 (commit 32dab02)", "0.1.0 (no checkout)"."""
    commit = record.get("commit")
    return f"{record.get('version', 'unknown')} ({f'commit {commit[:7]}{commit[40:]}' if commit else 'no checkout'})"
