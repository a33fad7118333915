"""The cost of engine.deterministic per step on the embedded default, off and on in one run.

    PYTHONPATH=. python scripts/bench_determinism.py                      # SFT and PPO steps, CPU
    PYTHONPATH=. python scripts/bench_determinism.py --reps 5 --steps 6 --out /tmp/bench_det
    PYTHONPATH=. python scripts/bench_determinism.py --sft-steps 20 --threads 1 --clock cpu   # a busy machine
    PYTHONPATH=. python scripts/bench_determinism.py --ppo engine.generation=injected --on engine.deterministic_rows=16

The stages run in this process (their `run(config)`, what `python -m rlhf.<stage>` calls after parsing its
command line) on the default configuration, `--steps` steps each, no evaluation in between, with
engine.deterministic=false and =true in turn (interleaved, `--reps` rounds, medians reported, so machine
load hits both alike):
    sft   the SFT train step: metrics.jsonl's tokens_per_s (every step logged; the first left out)
    ppo   the PPO step as the stage reports it (summary.json): generation, scoring, training, and their sum
The PPO runs start from an SFT model trained here for `--sft-steps` steps (so that responses end at EOS as
in the pipeline) and a reward model trained from it for a few steps. Between runs torch's deterministic
flag is reset, so each "off" run really runs without it. The last column is on / off.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from rlhf import ppo, reward, sft  # noqa: E402
from rlhf.run import stage  # noqa: E402
from rlhf.config import compose, to_config  # noqa: E402
from rlhf.config.schema import SCHEMAS  # noqa: E402

APPS = {"sft": sft, "reward": reward, "ppo": ppo}
QUIET = ["train.eval_every=0", "train.save_every=0", "train.overwrite=true"]
PPO_PARTS = ("step_generation_s", "step_scoring_s", "step_training_s")


class CpuClock:
    """`time` with `time()` reading this process's CPU time: what `--clock cpu` puts in the stages' modules,
    so that their step times (PPO) and tokens/s (SFT) count this process's work only, which other jobs on
    the machine barely move."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    @staticmethod
    def time() -> float:
        return time.process_time()


def run(app: str, overrides: list[str]) -> None:
    APPS[app].run(to_config(compose(app, overrides), SCHEMAS[app]))
    torch.use_deterministic_algorithms(False)  # set_deterministic is process-wide: the next run starts clean
    torch.backends.cudnn.deterministic = False


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def sft_rate(out: str) -> float:
    """Median tokens/s of an SFT run's train records but the first (warm-up). Both modes train on the same
    batches (same seed and data order), so the ratio of rates is the ratio of step times."""
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return statistics.median([r["tokens_per_s"] for r in rows if r["kind"] == "train"][1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="interleaved rounds (median reported)")
    ap.add_argument("--steps", type=int, default=4, help="steps per measured run")
    ap.add_argument("--sft-steps", type=int, default=150, help="steps of the SFT model the PPO runs start from")
    ap.add_argument("--out", default="outputs/bench_determinism", help="where the runs write")
    ap.add_argument("--ppo", nargs="*", default=[], help="overrides of both modes' PPO runs (engine.generation=injected)")
    ap.add_argument("--on", nargs="*", default=[], help="overrides of the deterministic runs (engine.deterministic_rows=16)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: step times in CPU-seconds of this process (use with --threads 1 on a busy machine)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        ppo.time = stage.time = CpuClock()
    out = args.out
    eval_few = ["data.num_eval_prompts=8"]
    run("sft", [f"output_dir={out}/sft", f"train.max_steps={args.sft_steps}", *QUIET, *eval_few])
    run("reward", [f"output_dir={out}/reward", f"model.name_or_path={out}/sft/model", "model.fallback_to_config=false",
                   "train.max_steps=10", *QUIET])
    times: dict[str, dict[bool, list[float]]] = {k: {False: [], True: []} for k in (*PPO_PARTS, "ppo step")}
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.reps):
        for det in (False, True):
            flag = f"engine.deterministic={str(det).lower()}"
            on = args.on if det else []
            d = f"{out}/sft_{det}"
            run("sft", [f"output_dir={d}", f"train.max_steps={args.steps + 1}", "train.log_every=1", *QUIET, *eval_few,
                        flag])
            rates[det].append(sft_rate(d))
            d = f"{out}/ppo_{det}"
            run("ppo", [f"output_dir={d}", f"actor.model={out}/sft/model", f"critic.model={out}/reward/model",
                        f"train.max_steps={args.steps}", *QUIET, *eval_few, *args.ppo, flag, *on])
            s = read_json(os.path.join(d, "summary.json"))
            for k in PPO_PARTS:
                times[k][det].append(s[k])
            times["ppo step"][det].append(sum(s[k] for k in PPO_PARTS))
    print(f"\nengine.deterministic off vs on, embedded default, {args.reps} interleaved rounds of {args.steps} steps "
          f"(medians; threads {torch.get_num_threads()}, {args.clock} clock{'; PPO: ' + ' '.join(args.ppo) if args.ppo else ''}"
          f"{'; on: ' + ' '.join(args.on) if args.on else ''})")
    print("| per step | off | on | on / off (time) |\n|---|---|---|---|")
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"| SFT step (tokens/s) | {off:,.0f} | {on:,.0f} | {off / on:.2f}x |")
    for k, v in times.items():
        off, on = statistics.median(v[False]), statistics.median(v[True])
        name = "whole step" if k == "ppo step" else k.removeprefix("step_").removesuffix("_s")
        print(f"| PPO {name} (s) | {off:.3f} | {on:.3f} | {on / off:.2f}x |")


if __name__ == "__main__":
    main()
