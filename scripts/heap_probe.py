"""Where a CPU run's resident memory is, at each switch between generation and training: runs a Python script in this
process with engine.memory.trim_host_heap wrapped, and after each trim (engine.cpu_trim_heap) writes one JSON line:
the resident memory by kind of mapping (/proc/self/smaps: the heap, anonymous mappings, files) and glibc's own
counts (mallinfo2: bytes in use, free in the heap, mapped apart). Bytes in use that grow from step to step are
allocations something keeps (a cache); free bytes that grow are the heap's holes.

    python scripts/heap_probe.py --out /tmp/heap.jsonl -- scripts/bench_rl.py --worker --tree . --result /tmp/r.json -- output_dir=/tmp/run algorithm=grpo

glibc and Linux only. scripts/bench_length.py --heap runs its runs under it.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import re
import runpy
import sys

HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]


def smaps_rss(lines) -> dict[str, int]:
    """Resident bytes by kind of mapping from /proc/<pid>/smaps lines: heap ([heap]), anon (no name, [anon...]),
    file (the rest: libraries, [stack], ...)."""
    out = {"heap": 0, "anon": 0, "file": 0}
    kind = None
    for line in lines:
        if HEADER.match(line):
            parts = line.split(maxsplit=5)
            name = parts[5].strip() if len(parts) > 5 else ""
            kind = "heap" if name == "[heap]" else "anon" if name == "" or name.startswith("[anon") else "file"
        elif line.startswith("Rss:") and kind:
            out[kind] += int(line.split()[1]) * 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="a JSON-lines file, one line per trim")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py args...")
    a = ap.parse_args()
    script = a.script[1:] if a.script[:1] == ["--"] else a.script
    if not script:
        ap.error("name the script to run after --")
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    import engine.memory as em
    import engine.train_engine as te

    trim = em.trim_host_heap
    out = open(a.out, "w")

    def probed() -> bool:
        done = trim()
        m = libc.mallinfo2()
        with open("/proc/self/smaps") as f:
            rss = smaps_rss(f)
        out.write(json.dumps({f"{k}_rss": v for k, v in rss.items()} | {
            "in_use": m.uordblks, "free_in_heap": m.fordblks, "mapped": m.hblkhd, "trimmed": done}) + "\n")
        out.flush()
        return done

    em.trim_host_heap = te.trim_host_heap = probed
    sys.argv = script
    runpy.run_path(script[0], run_name="__main__")


if __name__ == "__main__":
    main()
