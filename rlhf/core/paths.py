"""Where conf/ (the Hydra configs) and data/ (the embedded default) are: `ROOT`.

Installed from a wheel or an sdist, the package carries them as rlhf/assets/conf and rlhf/assets/data
(setup.py copies them in at build time); in a checkout (an editable install, or `python -m rlhf.<stage>`
run in it) they are the checkout's own top-level conf/ and data/, which the build copied from. The
package is looked at first, so an installed run never reads a checkout it happens to sit beside.
`${root:...}` in conf/ resolves against ROOT; a user's relative paths resolve against their working
directory, as any path on a command line does.
"""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE_ASSETS = Path(__file__).resolve().parents[1] / "assets"  # the installed package's copy (setup.py)
CHECKOUT = Path(__file__).resolve().parents[2]  # the project checkout: conf/, data/, scripts/
ROOT = PACKAGE_ASSETS if (PACKAGE_ASSETS / "conf").is_dir() else CHECKOUT
CONF_DIR = str(ROOT / "conf")


def root_path(sub: str = "") -> str:
    """`sub` under ROOT (the package's assets, or the checkout) as an absolute path (ROOT itself for "")."""
    return str(ROOT / sub) if sub else str(ROOT)


def is_root_file(path: str | None, sub: str) -> bool:
    """Whether `path` (absolute, or relative to the working directory) names ROOT's file `sub`."""
    if not path:
        return False
    return os.path.realpath(os.path.expanduser(path)) == os.path.realpath(root_path(sub))
