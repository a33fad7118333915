"""Where the project checkout's own folders are: conf/ (Hydra configs), data/ (the embedded default)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the project checkout: conf/, data/, scripts/
CONF_DIR = str(ROOT / "conf")


def root_path(sub: str = "") -> str:
    """`sub` inside the checkout as an absolute path (the checkout itself for "")."""
    return str(ROOT / sub) if sub else str(ROOT)
