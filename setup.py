"""The one thing the build does beyond pyproject.toml: the package carries what it reads.

The Hydra configs (conf/) and the embedded default's tokenizer and data (data/) live at the top of the
checkout, where the docs, scripts/run_all.sh and the tests name them. A wheel holds packages only, so
build_py copies them into the built package as rlhf/assets/conf and rlhf/assets/data; rlhf/core/paths.py
reads them there when installed and from the checkout otherwise (an editable install, `python -m` in the
checkout). Only what a run reads by default ships: the configs, data/tokenizer and data/default's files
named by conf/ (`${root:...}`, `${shipped_eval:...}`). The extra reward-model pair samples
(pairs_train_2/3.jsonl), data/tools/ and data/long/ serve scripts/run_all.sh, which runs from a checkout.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
ASSETS = "rlhf/assets"  # inside the built package; rlhf/core/paths.py names the same folder
# (checkout folder, the files of it that ship); MANIFEST.in lists the same for the sdist
SHIPPED = (
    ("conf", ("*.yaml", "*/*.yaml")),
    ("data/tokenizer", ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")),
    ("data/default", ("sft_train.jsonl", "pairs_train.jsonl", "pairs_eval.jsonl", "prompts_train.jsonl",
                      "eval_prompts.jsonl")),
)


def shipped_files() -> list[str]:
    """The checkout-relative paths of every shipped file (a pattern that matches nothing is an error:
    a renamed file must not drop silently out of the wheel)."""
    out = []
    for folder, patterns in SHIPPED:
        for pattern in patterns:
            found = sorted(p.relative_to(HERE).as_posix() for p in (HERE / folder).glob(pattern) if p.is_file())
            if not found:
                raise FileNotFoundError(f"setup.py: {folder}/{pattern} matches no file: the wheel would lack it")
            out += found
    return out


class BuildWithAssets(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads the checkout's own conf/ and data/
            return
        for rel in shipped_files():
            target = Path(self.build_lib) / ASSETS / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(HERE / rel, target)


setup(cmdclass={"build_py": BuildWithAssets})
