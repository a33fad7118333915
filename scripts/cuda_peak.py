"""What was live on the GPU at a run's peak: runs a Python script in this process with the CUDA caching allocator's
history recorded (torch.cuda.memory._record_memory_history), then replays the history and prints the allocations
live at the moment `torch.cuda.max_memory_allocated` was reached, grouped by the line of our code (rlhf/, engine/,
kernels/) that asked for them. Where a memory plan and a measured peak disagree, this names the term.

    python scripts/cuda_peak.py --out outputs/cuda_peak -- scripts/bench_rl.py --worker --tree . --result /tmp/r.json -- output_dir=/tmp/run algorithm=grpo

(GPU only: the allocator's history exists on CUDA alone.) Writes `--out`/peak.txt (the table) and, with --pickle, the
snapshot (torch's format: https://pytorch.org/memory_viz reads it).
"""
from __future__ import annotations

import argparse
import atexit
import os
import pickle
import runpy
import sys
from collections import defaultdict

OURS = ("/rlhf/", "/engine/", "/kernels/", "/scripts/")


def replay(events: list[dict]) -> tuple[int, int, dict[int, dict]]:
    """(peak bytes, index of the event that reached it, {addr: event} live then) of one device's trace: 'alloc'
    adds a block, 'free_completed' removes it (a block freed but not yet completed on its stream still counts, as
    the allocator counts it). Blocks allocated before the history began are not in it (start recording first)."""
    cur = peak = 0
    at = -1
    live: dict[int, dict] = {}
    for i, ev in enumerate(events):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > peak:
                peak, at = cur, i
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]
    live = {}
    for ev in events[: at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    return peak, at, live


def where(frames: list[dict]) -> str:
    """The innermost frame of our code (else the innermost frame) as 'path:line name', and the innermost frame's
    function (the torch call that allocated)."""
    mine = next((f for f in frames if any(s in f["filename"] for s in OURS)), frames[0] if frames else None)
    if mine is None:
        return "(no frames)"
    path = mine["filename"]
    for s in OURS:
        if s in path:
            path = s.strip("/") + "/" + path.split(s, 1)[1]
            break
    inner = frames[0]["name"] if frames else "?"
    return f"{path}:{mine['line']} {mine['name']} <- {inner}"


def table(peak: int, live: dict[int, dict], top: int = 30) -> str:
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for ev in live.values():
        g = groups[where(ev.get("frames") or [])]
        g[0] += ev["size"]
        g[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    lines = [f"peak {peak / 2**20:.1f} MiB in {len(live)} blocks; by the line that allocated them:",
             "| MiB | share | blocks | where |", "|---|---|---|---|"]
    lines += [f"| {b / 2**20:.1f} | {b / max(peak, 1):.3f} | {n} | {k} |" for k, (b, n) in rows[:top]]
    rest = sum(b for _, (b, _) in rows[top:])
    if rest:
        lines.append(f"| {rest / 2**20:.1f} | {rest / max(peak, 1):.3f} | {sum(n for _, (_, n) in rows[top:])} | "
                     f"(the rest) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="outputs/cuda_peak")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--pickle", action="store_true", help="also write the snapshot (can be large)")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py args...")
    a = ap.parse_args()
    script = a.script[1:] if a.script[:1] == ["--"] else a.script
    if not script:
        ap.error("name the script to run after --")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("cuda_peak.py: no CUDA device (the allocator's history exists on CUDA alone)")
    os.makedirs(a.out, exist_ok=True)
    done = []

    def finish() -> None:  # also from atexit: a stage that used a process group ends with os._exit after those
        if done:
            return
        done.append(1)
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        events = snap["device_traces"][torch.cuda.current_device()]
        peak, at, live = replay(events)
        text = table(peak, live, a.top) + (f"\n(events {len(events)}, the peak at event {at}; the last phase's "
                                           f"torch.cuda.max_memory_allocated: "
                                           f"{torch.cuda.max_memory_allocated() / 2**20:.1f} MiB)")
        print(text, flush=True)
        with open(os.path.join(a.out, "peak.txt"), "w") as f:
            f.write(text + "\n")
        if a.pickle:
            with open(os.path.join(a.out, "snapshot.pickle"), "wb") as f:
                pickle.dump(snap, f)

    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=4_000_000)
    atexit.register(finish)
    sys.argv = script
    try:
        runpy.run_path(script[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    finish()

if __name__ == "__main__":
    main()
