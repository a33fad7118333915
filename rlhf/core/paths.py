"""Where the project checkout's own folders are: conf/ (Hydra configs), data/ (the embedded default)."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the project checkout: conf/, data/, scripts/
CONF_DIR = str(ROOT / "conf")


def root_path(sub: str = "") -> str:
    """`sub` inside the checkout as an absolute path (the checkout itself for "")."""
    return str(ROOT / sub) if sub else str(ROOT)


def is_root_file(path: str | None, sub: str) -> bool:
    """Whether `path` (absolute, or relative to the working directory) names the checkout's file `sub`."""
    if not path:
        return False
    return os.path.realpath(os.path.expanduser(path)) == os.path.realpath(root_path(sub))
