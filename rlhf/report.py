"""`python -m rlhf.report`: the run explorer, one self-contained HTML page over runs (rlhf/run/explorer.py).

    python -m rlhf.report outputs                          # a pipeline's stages (outputs/report.html)
    python -m rlhf.report outputs/seed_1/ppo outputs/seed_2/ppo --out ppo_seeds.html
    python -m rlhf.report sweep_root                       # every run under it (SEEDS=... run_all.sh)

Each path is a run (a stage's output_dir, holding metrics.jsonl) or a directory with runs under it.
The page opens without a network (plotly.min.js and the data are inside it): the runs' curves
overlaid, each run's config diff against the first, its summary.json and fired alarms, and a
samples browser over samples.jsonl. Default output: report.html in the first path. Exit code 2 for a
path that holds no run, or an --out that cannot be written (a directory, a path under a file).
"""
from __future__ import annotations

import argparse
import os
import sys

from rlhf.run.explorer import write_explorer


def check_out(out: str) -> None:
    """ValueError naming --out when the page cannot go there: a directory, or a path under a file."""
    if os.path.isdir(out):
        raise ValueError(f"--out {out} is a directory: name the HTML file to write (e.g. {out}/report.html)")
    above = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise ValueError(f"--out {out}: {above} is a file, not a directory: choose another path for the page")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rlhf.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="run directories, or directories with runs under them")
    ap.add_argument("--out", default=None, help="the HTML file to write (default: <first path>/report.html)")
    args = ap.parse_args(argv)
    out = args.out or os.path.join(args.paths[0], "report.html")
    try:
        check_out(out)
        path, runs = write_explorer(args.paths, out)
    except (ValueError, OSError) as e:  # no run there, or a page that cannot be written: one line, exit 2
        why = e if isinstance(e, ValueError) else f"--out {out}: cannot write it ({e.strerror}: {e.filename})"
        print(f"rlhf.report: {why}", file=sys.stderr)
        sys.exit(2)
    print(f"run explorer: {path} ({len(runs)} run(s): {', '.join(r.name for r in runs)}; "
          f"{os.path.getsize(path) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
