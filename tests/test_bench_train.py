"""scripts/bench_train.py: the token positions it reports for each layout (the pair steps' shared-prompt
layout counts each pair's prompt once), and its smoke form on the pair steps."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, cli_env
from rlhf.data import collate_pairs, collate_shared_pairs
from scripts.bench_train import computed_slots, real_computed

FEATS = [{"chosen_ids": [1, 5, 6, 7, 2], "rejected_ids": [1, 5, 6, 8, 9, 2], "prompt_len": 3},
         {"chosen_ids": [1, 4, 3, 2], "rejected_ids": [1, 4, 2], "prompt_len": 2}]


def test_positions_of_each_layout_by_hand():
    padded = collate_pairs(FEATS, 0)  # 4 rows x 6
    assert computed_slots(padded) == 24 and real_computed(padded) == 5 + 4 + 6 + 3
    shared = collate_shared_pairs(FEATS, 0)  # prompts [2, 3] once (P = 3), responses of 4 rows (R = 3)
    assert computed_slots(shared) == 2 * 3 + 4 * 3
    assert real_computed(shared) == (3 + 2) + (2 + 2 + 3 + 1)  # each prompt once, every response token


@pytest.mark.slow
def test_smoke_run_reports_the_pair_layouts():
    argv = [sys.executable, "scripts/bench_train.py", "--models", "tiny", "--compile", "off", "--steps", "reward,dpo",
            "--reps", "1", "--batches", "1", "--pack-lengths", "none", "--threads", "1"]
    proc = subprocess.run(argv, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| tiny"):
            rows[(cells[1], cells[2])] = cells
    assert set(rows) == {(s, lay) for s in ("reward", "dpo") for lay in ("padded", "shared prompts")}
    for step in ("reward", "dpo"):
        # fewer positions through the model: less saved for backward (a count of bytes, not a timing)
        assert float(rows[(step, "shared prompts")][6]) < 0.85 * float(rows[(step, "padded")][6])
        assert rows[(step, "padded")][7] == "1.00x"
