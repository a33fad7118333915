"""scripts/cuda_peak.py's replay of the CUDA allocator's history (the GPU run itself needs a device): the peak, the
blocks live at it, and the table's grouping, on a hand-made trace."""
from scripts.cuda_peak import replay, table, where


def ev(action, addr, size, name="f", path="/x/rlhf/rl/update.py", line=1):
    return {"action": action, "addr": addr, "size": size,
            "frames": [{"filename": "/t/torch/nn/functional.py", "line": 9, "name": "linear"},
                       {"filename": path, "line": line, "name": name}]}


def test_the_peak_and_what_was_live_at_it():
    events = [ev("alloc", 1, 100), ev("alloc", 2, 50, line=2), ev("free_requested", 1, 100),
              ev("free_completed", 1, 100), ev("alloc", 3, 120, name="g", path="/x/engine/optim.py", line=7),
              ev("alloc", 4, 10), ev("free_completed", 3, 120), ev("alloc", 5, 5)]
    peak, at, live = replay(events)
    assert (peak, at) == (180, 5)  # 50 + 120 + 10: block 1 was freed (completed) before 3 came
    assert sorted(live) == [2, 3, 4]
    text = table(peak, live)
    assert "| 0.0 | 0.667 | 1 | engine/optim.py:7 g <- linear |" in text  # 120 of 180
    assert text.splitlines()[0].startswith("peak 0.0 MiB in 3 blocks")


def test_a_block_freed_but_not_completed_still_counts():
    events = [ev("alloc", 1, 100), ev("free_requested", 1, 100), ev("alloc", 2, 30)]
    assert replay(events)[0] == 130


def test_where_falls_back_to_the_innermost_frame_outside_our_code():
    frames = [{"filename": "/t/torch/optim/adamw.py", "line": 3, "name": "_multi_tensor_adamw"}]
    assert where(frames) == "/t/torch/optim/adamw.py:3 _multi_tensor_adamw <- _multi_tensor_adamw"
    assert where([]) == "(no frames)"
