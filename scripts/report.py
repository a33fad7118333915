"""Write <root>/report.md, <root>/report.json and <root>/pipeline.png from a run_all.sh run (the
stages' outputs); with --sweep, <root>/sweep.md and <root>/sweep.json from the runs of a seed sweep
(SEEDS="1 2 3" bash scripts/run_all.sh: one run per seed under <root>/seed_<s>/).

    python scripts/report.py outputs [--total-s 812]                 # SFT -> reward -> PPO
    python scripts/report.py outputs --pipeline dpo                  # SFT -> DPO (PIPELINE=dpo)
    python scripts/report.py outputs --pipeline tools                # SFT -> RL with the calculator (TASK=tools)
    python scripts/report.py outputs --sweep 1 2 3
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rlhf.run.runlog import plot_series, read_metrics, series

STAGES = ("sft", "reward", "ppo")
PIPELINES = {"ppo": STAGES, "dpo": ("sft", "dpo"), "tools": ("sft", "ppo")}
GOLD = "gold score (% exact)"
# What each estimator of KL(policy || reference) is, for the report (rlhf/ppo_math.kl_estimate).
KL_ESTIMATORS = {
    "k1": "k1 = log p - log p_ref summed over the sampled response: unbiased, but a single sample per prompt "
          "can be negative, so a mean over few responses can come out below zero although the true KL is >= 0",
    "k2": "k2 = (log p - log p_ref)^2 / 2 per token: never negative, biased upwards",
    "k3": "k3 = p_ref/p - 1 - log(p_ref/p) per token: unbiased and never negative",
}


def load_summary(root: str, stage: str) -> dict:
    path = os.path.join(root, stage, "summary.json")
    if not os.path.exists(path):
        raise SystemExit(f"report.py: {path} is missing (did the {stage} stage finish?)")
    with open(path) as f:
        return json.load(f)


def kl_estimator(root: str) -> str | None:
    """ppo.kl_estimator from the PPO stage's saved config.yaml (None if it cannot be read)."""
    from omegaconf import OmegaConf

    path = os.path.join(root, "ppo", "config.yaml")
    if not os.path.exists(path):
        return None
    return OmegaConf.select(OmegaConf.load(path), "ppo.kl_estimator")


def kl_sentence(kl: float | None, estimator: str | None) -> str:
    """The PPO KL as measured, with the estimator named and a negative value explained."""
    if kl is None:
        return "no held-out KL was measured"
    how = KL_ESTIMATORS.get(estimator or "", f"estimator {estimator!r} (see ppo.kl_estimator)" if estimator
                            else "an unknown estimator (no ppo/config.yaml)")
    text = (f"a mean KL to the reference of {kl:.4f} nats per response, a sampled estimate (one sampled response "
            f"per held-out prompt, ppo.kl_estimator={estimator}: {how})")
    if kl < 0:
        text += ("; the value is negative only through sampling noise (the true KL is never negative): read it as "
                 "a KL too small for this many samples to resolve, not as a divergence below zero")
    return text


def pipeline_panels(root: str) -> list:
    """The whole pipeline side by side: each stage's key curve against its own steps."""
    sft_t, sft_e = read_metrics(os.path.join(root, "sft"), "train"), read_metrics(os.path.join(root, "sft"), "eval")
    rm_t, rm_e = read_metrics(os.path.join(root, "reward"), "train"), read_metrics(os.path.join(root, "reward"), "eval")
    ppo_e = read_metrics(os.path.join(root, "ppo"), "eval")
    return [
        ("SFT loss", [("train", *series(sft_t, "loss")), ("held-out", *series(sft_e, "loss"))], "SFT step"),
        ("reward-model pair accuracy", [("train", *series(rm_t, "accuracy")), ("held-out", *series(rm_e, "accuracy"))],
         "reward step"),
        (f"PPO {GOLD}", [("held-out (greedy)", *series(ppo_e, "gold_score"))], "PPO step"),
    ]


def dpo_panels(root: str) -> list:
    """SFT -> DPO side by side: SFT's loss, DPO's preference accuracy, and the gold score through DPO."""
    sft_t, sft_e = read_metrics(os.path.join(root, "sft"), "train"), read_metrics(os.path.join(root, "sft"), "eval")
    dpo_t, dpo_e = read_metrics(os.path.join(root, "dpo"), "train"), read_metrics(os.path.join(root, "dpo"), "eval")
    return [
        ("SFT loss", [("train", *series(sft_t, "loss")), ("held-out", *series(sft_e, "loss"))], "SFT step"),
        ("DPO preference accuracy", [("train", *series(dpo_t, "accuracy")), ("held-out", *series(dpo_e, "accuracy"))],
         "DPO step"),
        (f"DPO {GOLD}", [("held-out (greedy)", *series(dpo_e, "gold_score"))], "DPO step"),
    ]


def dpo_lines(d: dict) -> list[str]:
    """report.md's DPO section from dpo/summary.json."""
    return [
        "", "## DPO", "",
        f"{d['steps']} steps, dpo.loss_type={d.get('loss_type')}, reference {d.get('reference')}; held-out pairs: "
        f"loss {fmt(d.get('eval_loss_before'))} -> {fmt(d.get('eval_loss_after'))}, preference accuracy "
        f"{fmt(d.get('eval_accuracy_before'))} -> {fmt(d.get('eval_accuracy_after'))}, implicit reward margin "
        f"{fmt(d.get('eval_margin_before'))} -> {fmt(d.get('eval_margin_after'))} (chosen "
        f"{fmt(d.get('eval_reward_chosen_after'))}, rejected {fmt(d.get('eval_reward_rejected_after'))}); "
        f"peak RSS {fmt(d.get('peak_rss_mb'))} MB.",
        "", "## Plots", "", "![SFT](sft/sft.png)", "", "![DPO](dpo/dpo.png)", "", "![Pipeline](pipeline.png)", "",
    ]


def read_samples_of(root: str) -> list[dict]:
    path = os.path.join(root, "samples.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tools_lines(root: str, s: dict) -> list[str]:
    """The tool task (TASK=tools): gold with and without the tool, turns and tool calls per episode, the
    environment's faults, and sample transcripts of the last evaluation."""
    p = s["ppo"]
    train = read_metrics(os.path.join(root, "ppo"), "train")
    last = train[-1] if train else {}
    samples = read_samples_of(os.path.join(root, "ppo"))
    final = [x for x in samples if x.get("step") == max((y["step"] for y in samples), default=None)]
    if p.get("gold_score_tool_after") is None:  # the control arm (TOOL=off): trained and judged without the tool
        return ["", "## Without the tool (the control arm: TOOL=off, held-out sums, greedy)", "",
                "| model | gold (%) |", "|---|---|",
                f"| after SFT (direct answers) | {fmt(p.get('gold_score_before'))} |",
                f"| after RL (no tool) | {fmt(p.get('gold_score_after'))} |", "",
                "The same sums, demonstrated and rewarded as one direct answer: what the model reaches in its head. "
                "`TASK=tools` (the tool arm) gives the gold with the calculator beside it."]
    lines = [
        "", "## With the calculator tool (held-out sums, greedy)", "",
        "| model | without the tool (%) | with the tool (%) |", "|---|---|---|",
        f"| after SFT | {fmt(p.get('gold_score_before'))} | {fmt(p.get('gold_score_tool_before'))} |",
        f"| after RL | {fmt(p.get('gold_score_after'))} | {fmt(p.get('gold_score_tool_after'))} |",
        "", "Without the tool: one greedy response, judged as is (a model taught to call the tool answers with the call). "
        "With it: greedy episodes with rollout.env, the last model turn judged.", "",
        f"Per held-out episode after RL: {fmt(p.get('turns_eval_after'))} model turns, "
        f"{fmt(p.get('tool_calls_eval_after'))} tool calls. Training, last step: {fmt(last.get('turns'))} turns, "
        f"{fmt(last.get('tool_calls'))} tool calls, {fmt(last.get('obs_tokens'))} observation tokens per episode; "
        f"environment {fmt(last.get('env_s'))} s per step. Environment faults over the run: "
        f"{p.get('env_errors', 0)} errors, {p.get('env_timeouts', 0)} timeouts; chat-template mismatches: "
        f"{p.get('template_mismatch', 0)}.", "", "### Sample transcripts (after RL, greedy, with the tool)", "",
    ]
    for x in final[:5]:
        lines += [f"- `{x['prompt']!r}` -> `{x.get('tool_transcript')!r}` (gold {x.get('tool_gold')}, "
                  f"{x.get('tool_turns')} turns, {x.get('tool_calls')} calls"
                  + (f", error {x['tool_error']}" if x.get("tool_error") else "") + ")"]
    return lines


def alarm_lines(rows: list[dict], summary: dict) -> list[str]:
    """The reward-hacking alarms (rlhf/rl/alarms.py) of the RL run: one line per alarm that fired (its first
    step, how many records had it, the figures then), or that none did; and an early stop."""
    fired: dict[str, list[dict]] = {}
    checked = set()
    for r in rows:
        for key, v in r.items():
            name = key[len("alarm_"):]
            if key.startswith("alarm_") and "_" not in name:
                checked.add(name)
                if v == 1:
                    fired.setdefault(name, []).append(r)
    lines = []
    for name, hits in sorted(fired.items(), key=lambda x: x[1][0]["step"]):
        first = hits[0]
        figures = ", ".join(f"{k[len('alarm_' + name + '_'):]} {fmt(v)}" for k, v in first.items()
                            if k.startswith(f"alarm_{name}_"))
        lines.append(f"- **{name}** fired at step {first['step']} ({len(hits)} record(s) in all): {figures}")
    if not lines:
        lines.append(f"No alarm fired ({', '.join(sorted(checked)) or 'none computed'}).")
    if summary.get("stopped_early"):
        lines.append(f"\nThe run stopped early after step {summary['steps']}: {summary['stopped_early']}.")
    last = summary.get("last_step_eval")
    if last is not None and summary.get("exported_step") not in (None, summary.get("steps")):
        # train.export_best / train.kl_budget: model/ is not the last step's actor, and the figures above are its
        def num(v, spec):
            return "–" if v is None else format(v, spec)
        lines.append(f"\nThe exported actor is step {summary['exported_step']}'s ({summary.get('exported_by')}): gold "
                     f"{num(summary.get('gold_score_after'), '.1f')} at KL {num(summary.get('kl'), '.3f')}; the last "
                     f"step's (step {summary['steps']}): gold {num(last.get('gold_score'), '.1f')} at KL "
                     f"{num(last.get('kl'), '.3f')}.")
    return lines


def figures(s: dict[str, dict], total_s: float) -> dict[str, float | None]:
    """One run's headline figures (a row of the sweep table) from its three summaries."""
    sft, ppo = s["sft"].get("gold_score_after"), s["ppo"].get("gold_score_after")
    return {
        "sft_gold": sft, "sft_loss": s["sft"].get("eval_loss_after"), "rm_accuracy": s["reward"].get("eval_accuracy"),
        "rm_gold_auc": s["reward"].get("gold_auc"),
        "ppo_gold": ppo, "gold_gain": None if sft is None or ppo is None else ppo - sft, "kl": s["ppo"].get("kl"),
        "sft_s": s["sft"]["time_s"], "reward_s": s["reward"]["time_s"], "ppo_s": s["ppo"]["time_s"], "total_s": total_s,
        # the SFT start continued (sft:starts.n > 1: the seed of the start with the lowest held-out loss): a label
        **({"sft_start": str(s["sft"]["start_seed"])} if "start_seed" in s["sft"] else {}),
    }


def aggregate(rows: list[dict[str, float | None]]) -> dict[str, dict[str, float | None]]:
    """Per figure over the runs that have it: mean, std (sample, n - 1; None below 2 runs), min, max, n (labels,
    such as the tool task's "task": "tools", are not figures)."""
    out = {}
    for key in rows[0] if rows else ():
        if any(isinstance(r.get(key), str) for r in rows):
            continue
        vals = [r[key] for r in rows if r.get(key) is not None]
        out[key] = {"mean": statistics.fmean(vals) if vals else None,
                    "std": statistics.stdev(vals) if len(vals) > 1 else None,
                    "min": min(vals, default=None), "max": max(vals, default=None), "n": len(vals)}
    return out


# The sweep table's columns: (figure, header, format of one value). The SFT model's held-out loss (on the
# demonstrations held out of training: no judge needed) flags a seed whose SFT run learnt less: on the embedded
# default at the default learning rate, the SFT models that miscopy sort digits (which PPO does not repair)
# ended at 0.107-0.138, those that copy them at 0.092-0.103 (docs/results-log.md)
SWEEP_COLUMNS = [
    ("sft_gold", "SFT gold (%)", "{:.1f}"), ("sft_loss", "SFT held-out loss", "{:.3f}"),
    ("rm_accuracy", "RM held-out accuracy", "{:.3f}"),
    ("rm_gold_auc", "RM gold AUC", "{:.3f}"), ("ppo_gold", "PPO gold (%)", "{:.1f}"),
    ("gold_gain", "PPO gain (points)", "{:+.1f}"), ("kl", "KL (nats)", "{:.3f}"), ("sft_s", "SFT (s)", "{:.0f}"),
    ("reward_s", "reward (s)", "{:.0f}"), ("ppo_s", "PPO (s)", "{:.0f}"), ("total_s", "total (s)", "{:.0f}"),
]


# The tool task's sweep (TASK=tools: report.json has "task": "tools"): its columns, headline figure first
TOOL_SWEEP_COLUMNS = [
    ("rl_gold_tool", "RL gold with the tool (%)", "{:.1f}"), ("sft_gold_tool", "SFT gold with the tool (%)", "{:.1f}"),
    ("sft_gold", "SFT gold without (%)", "{:.1f}"), ("rl_gold", "RL gold without (%)", "{:.1f}"),
    ("tool_calls", "tool calls / episode", "{:.2f}"), ("env_errors", "env errors", "{:.0f}"),
    ("sft_s", "SFT (s)", "{:.0f}"), ("rl_s", "RL (s)", "{:.0f}"), ("total_s", "total (s)", "{:.0f}"),
]


TOOL_OFF_COLUMNS = ("sft_gold", "rl_gold", "sft_s", "rl_s", "total_s")


def headline(rows: list[dict]) -> str:
    """The figure a sweep ranks seeds by: PPO gold; for the tool task its gold with the tool (the control arm,
    TOOL=off: its gold without)."""
    if rows and rows[0].get("task") == "tools":
        return "rl_gold_tool" if rows[0].get("tool") == "on" else "rl_gold"
    return "ppo_gold"


def worst_first(seeds: list[int], rows: list[dict]) -> list[tuple[int, dict]]:
    """(seed, figures) ordered worst first: the lowest headline gold (`headline`: PPO gold; a run without one
    first), then the highest KL, then the seed."""
    gold_key = headline(rows)

    def key(pair: tuple[int, dict]) -> tuple:
        seed, r = pair
        gold, kl = r.get(gold_key), r.get("kl")
        return (-math.inf if gold is None else gold, -(kl if kl is not None else -math.inf), seed)

    return sorted(zip(seeds, rows), key=key)


def sweep_table(seeds: list[int], rows: list[dict], agg: dict) -> list[str]:
    """Markdown: one row per seed, worst first (`worst_first`), then mean ± std, min and max of every column."""
    def cell(fmt_: str, v) -> str:
        return "–" if v is None else fmt_.format(v)

    columns = SWEEP_COLUMNS
    if any("sft_start" in r for r in rows):  # several SFT starts: which one each seed continued
        columns = [("sft_start", "SFT start (seed)", "{}"), *columns]
    if rows and rows[0].get("task") == "tools":  # the control arm (tool off) has no figures with the tool
        columns = [c for c in TOOL_SWEEP_COLUMNS if rows[0].get("tool") == "on" or c[0] in TOOL_OFF_COLUMNS]
    lines = ["| seed | " + " | ".join(h for _, h, _ in columns) + " |", "|---|" + "---|" * len(columns)]
    lines += [f"| {seed} | " + " | ".join(cell(f, r.get(k)) for k, _, f in columns) + " |"
              for seed, r in worst_first(seeds, rows)]
    none = {"mean": None, "std": None, "min": None, "max": None}  # a label column (not aggregated)
    lines.append("| mean ± std | " + " | ".join(
        cell(f, agg.get(k, none)["mean"]) + ("" if agg.get(k, none)["std"] is None
                                              else " ± " + cell(f, agg[k]["std"]).lstrip("+"))
        for k, _, f in columns) + " |")
    for stat in ("min", "max"):
        lines.append(f"| {stat} | " + " | ".join(cell(f, agg.get(k, none)[stat]) for k, _, f in columns) + " |")
    return lines


def sweep(root: str, seeds: list[int]) -> list[str]:
    """Write <root>/sweep.md and sweep.json from <root>/seed_<s>/report.json; returns sweep.md's lines."""
    rows = []
    for seed in seeds:
        path = os.path.join(root, f"seed_{seed}", "report.json")
        if not os.path.exists(path):
            raise SystemExit(f"report.py: {path} is missing (did the pipeline for seed {seed} finish?)")
        with open(path) as f:
            rows.append(json.load(f))
    agg = aggregate(rows)

    def spread(a: dict, f: str) -> str:
        return "–" if a["mean"] is None else (f.format(a["mean"]) + ("" if a["std"] is None else " ± " + f.format(a["std"]).lstrip("+"))
                                              + f" (min {f.format(a['min'])})")

    tools = rows[0].get("task") == "tools"
    ranked = {"ppo_gold": "PPO gold", "rl_gold_tool": "RL gold with the tool", "rl_gold": "RL gold without the tool"}
    if tools and rows[0].get("tool") == "off":
        closing = (f"The control arm (no tool): gold after SFT {spread(agg['sft_gold'], '{:.1f}')}, after RL "
                   f"{spread(agg['rl_gold'], '{:.1f}')}; slowest pipeline {fmt(agg['total_s']['max'])} s.")
    elif tools:
        closing = (f"RL gold with the tool {spread(agg['rl_gold_tool'], '{:.1f}')}; without it, after SFT "
                   f"{spread(agg['sft_gold'], '{:.1f}')}, after RL {spread(agg['rl_gold'], '{:.1f}')}; slowest "
                   f"pipeline {fmt(agg['total_s']['max'])} s.")
    else:
        closing = (f"Reward-model held-out pair accuracy {spread(agg['rm_accuracy'], '{:.3f}')}; PPO gold gain "
                   f"{spread(agg['gold_gain'], '{:+.1f}')} points; slowest pipeline {fmt(agg['total_s']['max'])} s.")
    lines = [
        "# RLHF pipeline: seed sweep" + (" (the tool task)" if tools else ""), "",
        f"Output root: `{os.path.abspath(root)}`. {len(seeds)} seeds ({', '.join(map(str, seeds))}), each a whole "
        "pipeline under `seed_<s>/` (`seed=<s>` in every stage: initialisation, data order, sampling; the same data) "
        "with its own report.md. Std is the sample standard deviation (n - 1). Rows: the worst seed first "
        f"(lowest {ranked[headline(rows)]}, then highest KL).", "",
        worst_line(seeds, rows), "",
        *sweep_table(seeds, rows, agg), "",
        closing, "",
    ]
    with open(os.path.join(root, "sweep.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(root, "sweep.json"), "w") as f:
        json.dump({"seeds": seeds, "runs": rows, "aggregate": agg}, f, indent=1)
    return lines


def worst_line(seeds: list[int], rows: list[dict]) -> str:
    seed, r = worst_first(seeds, rows)[0]
    if r.get("task") == "tools" and r.get("tool") == "off":
        return f"Worst seed: {seed} (the control arm, no tool: SFT gold {fmt(r.get('sft_gold'))}, RL gold {fmt(r.get('rl_gold'))})."
    if r.get("task") == "tools":
        return (f"Worst seed: {seed} (RL gold with the tool {fmt(r.get('rl_gold_tool'))}, without it "
                f"{fmt(r.get('rl_gold'))}; tool calls per episode {fmt(r.get('tool_calls'))}).")
    return (f"Worst seed: {seed} (PPO gold {fmt(r.get('ppo_gold'))} at KL {fmt(r.get('kl'))}, reward-model accuracy "
            f"{fmt(r.get('rm_accuracy'))}).")


def fmt(v) -> str:
    if v is None:
        return "–"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root")
    ap.add_argument("--total-s", type=float, default=None, help="wall time of the whole pipeline")
    ap.add_argument("--pipeline", choices=sorted(PIPELINES), default=None,
                    help="ppo (SFT -> reward -> PPO) or dpo (SFT -> DPO); default: dpo when only dpo/ finished")
    ap.add_argument("--sweep", type=int, nargs="+", metavar="SEED", help="the seeds of a sweep under root/seed_<s>/")
    args = ap.parse_args()
    root = args.root
    if args.sweep:
        print("\n".join(sweep(root, args.sweep)))
        print(f"sweep report: {os.path.join(root, 'sweep.md')}")
        return
    pipeline = args.pipeline or ("dpo" if os.path.exists(os.path.join(root, "dpo", "summary.json"))
                                 and not os.path.exists(os.path.join(root, "ppo", "summary.json")) else "ppo")
    stages = PIPELINES[pipeline]
    last = stages[-1]  # the stage whose model is the pipeline's result
    name = "RL" if pipeline == "tools" else last.upper()
    s = {stage: load_summary(root, stage) for stage in stages}

    # gold score across the pipeline: untrained -> SFT -> PPO or DPO (held-out prompts, greedy)
    gold = [("untrained", s["sft"].get("gold_score_before")), ("after SFT", s["sft"].get("gold_score_after")),
            (f"after {name}", s[last].get("gold_score_after"))]
    if pipeline == "dpo":
        plot_series(os.path.join(root, "pipeline.png"), "Pipeline: SFT -> DPO", dpo_panels(root), ncols=3, sharex=False)
    elif pipeline == "tools":
        pass  # the RL stage's own plot (ppo/ppo.png); no reward model
    else:
        plot_series(os.path.join(root, "pipeline.png"), "Pipeline: SFT -> reward model -> PPO", pipeline_panels(root),
                    ncols=3, sharex=False)

    total = args.total_s if args.total_s is not None else sum(s[k]["time_s"] for k in stages)
    titles = {"sft": "SFT", "reward": "reward", "ppo": "RL" if pipeline == "tools" else "PPO", "dpo": "DPO"}
    times = ", ".join(f"{titles[k]} {s[k]['time_s']:.0f} s" for k in stages)
    lines = [
        "# RLHF pipeline report",
        "",
        f"Output root: `{os.path.abspath(root)}`. Total time: {total:.0f} s "
        f"({times}).",
        "",
        "## Held-out gold score (greedy, % exact)",
        "",
        "| model | gold score (%) |",
        "|---|---|",
        *[f"| {label} | {fmt(v)} |" for label, v in gold],
    ]
    if gold[1][1] is not None and gold[2][1] is not None:
        how = (f"with {kl_sentence(s['ppo'].get('kl'), kl_estimator(root))}" if pipeline in ("ppo", "tools") else
               "learning from the preference pairs directly (no reward model, no generation while training)")
        lines += ["", f"{name} changed the gold score by **{gold[2][1] - gold[1][1]:+.1f} points** (percentage points) "
                      f"{how}."]
    tasks = sorted({k.split("/")[1].rsplit("_", 1)[0] for k in s[last] if k.startswith("gold_score/")})
    if tasks:
        lines += ["", f"| task | after SFT (%) | after {name} (%) |", "|---|---|---|"]
        lines += [f"| {t} | {fmt(s[last].get(f'gold_score/{t}_before'))} | {fmt(s[last].get(f'gold_score/{t}_after'))} |"
                  for t in tasks]
    if pipeline == "tools":
        lines += tools_lines(root, s) + ["", "## Reward-hacking alarms", "",
                                         *alarm_lines(read_metrics(os.path.join(root, "ppo")), s["ppo"]),
                                         "", "## Summaries", "", "```json", json.dumps(s, indent=1), "```", ""]
        with open(os.path.join(root, "report.md"), "w") as f:
            f.write("\n".join(lines))
        with open(os.path.join(root, "report.json"), "w") as f:  # the headline figures
            json.dump({"task": "tools", "tool": "on" if s["ppo"].get("gold_score_tool_after") is not None else "off",
                       "sft_gold": s["sft"].get("gold_score_after"), "rl_gold": s["ppo"].get("gold_score_after"),
                       "sft_gold_tool": s["ppo"].get("gold_score_tool_before"),
                       "rl_gold_tool": s["ppo"].get("gold_score_tool_after"),
                       "tool_calls": s["ppo"].get("tool_calls_eval_after"), "turns": s["ppo"].get("turns_eval_after"),
                       "env_errors": s["ppo"].get("env_errors"), "sft_s": s["sft"].get("time_s"),
                       "rl_s": s["ppo"].get("time_s"), "total_s": total}, f, indent=1)
        print("\n".join(lines[:40]))
        print(f"report: {os.path.join(root, 'report.md')}")
        return
    if pipeline == "dpo":
        lines += dpo_lines(s["dpo"]) + ["## Summaries", "", "```json", json.dumps(s, indent=1), "```", ""]
        with open(os.path.join(root, "report.md"), "w") as f:
            f.write("\n".join(lines))
        print("\n".join(lines[:20]))
        print(f"report: {os.path.join(root, 'report.md')}")
        return
    r = s["reward"]
    per_task = [f"{k.split('/')[1]} {fmt(v)}" for k, v in r.items() if k.startswith("eval_accuracy/")]
    lines += [
        "", "## Reward model", "",
        f"Held-out pair accuracy {fmt(r.get('eval_accuracy'))}; mean chosen score {fmt(r.get('eval_chosen_score'))}, "
        f"rejected {fmt(r.get('eval_rejected_score'))}; agreement with the gold judge {fmt(r.get('gold_agreement'))}, "
        f"AUC of scores for correct vs incorrect responses {fmt(r.get('gold_auc'))}."
        + (" Per task: " + ", ".join(per_task) + "." if per_task else ""),
        "", "## PPO", "",
        f"{s['ppo']['steps']} steps (advantage estimator {s['ppo'].get('advantage_estimator', 'gae')}); "
        f"reward (held-out, sampled) {fmt(s['ppo'].get('reward_before'))} -> "
        f"{fmt(s['ppo'].get('reward_after'))}; final KL coefficient {fmt(s['ppo'].get('kl_coef_final'))}; "
        f"empty responses dropped: {s['ppo'].get('empty_responses', 0)}.",
        "",
        "Time per PPO step: generation {:.3f} s, scoring {:.3f} s, training {:.3f} s.".format(
            s["ppo"]["step_generation_s"], s["ppo"]["step_scoring_s"], s["ppo"]["step_training_s"]),
        "", "## Reward-hacking alarms", "",
        *alarm_lines(read_metrics(os.path.join(root, "ppo")), s["ppo"]),
        "", "## Plots", "",
        "![SFT](sft/sft.png)", "", "![Reward model](reward/reward.png)", "", "![PPO](ppo/ppo.png)", "",
        "![Pipeline](pipeline.png)", "",
        "## Summaries", "", "```json", json.dumps(s, indent=1), "```", "",
    ]
    with open(os.path.join(root, "report.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(root, "report.json"), "w") as f:  # the headline figures, for a seed sweep's table
        json.dump(figures(s, total), f, indent=1)
    print("\n".join(lines[:20]))
    print(f"report: {os.path.join(root, 'report.md')}")


if __name__ == "__main__":
    main()
