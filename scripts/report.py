"""Write <root>/report.md and <root>/pipeline.png from a run_all.sh run (the three stages' outputs).

    python scripts/report.py outputs [--total-s 812]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rlhf.runlog import plot_series, read_metrics, series  # noqa: E402

STAGES = ("sft", "reward", "ppo")
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


def alarm_lines(rows: list[dict], summary: dict) -> list[str]:
    """The reward-hacking alarms (rlhf/alarms.py) of the RL run: one line per alarm that fired (its first
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
    return lines


def fmt(v) -> str:
    if v is None:
        return "–"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root")
    ap.add_argument("--total-s", type=float, default=None, help="wall time of the whole pipeline")
    args = ap.parse_args()
    root = args.root
    s = {stage: load_summary(root, stage) for stage in STAGES}

    # gold score across the pipeline: untrained -> SFT -> PPO (held-out prompts, greedy)
    gold = [("untrained", s["sft"].get("gold_score_before")), ("after SFT", s["sft"].get("gold_score_after")),
            ("after PPO", s["ppo"].get("gold_score_after"))]
    plot_series(os.path.join(root, "pipeline.png"), "Pipeline: SFT -> reward model -> PPO", pipeline_panels(root),
                ncols=3, sharex=False)

    total = args.total_s if args.total_s is not None else sum(s[k]["time_s"] for k in STAGES)
    lines = [
        "# RLHF pipeline report",
        "",
        f"Output root: `{os.path.abspath(root)}`. Total time: {total:.0f} s "
        f"(SFT {s['sft']['time_s']:.0f} s, reward {s['reward']['time_s']:.0f} s, PPO {s['ppo']['time_s']:.0f} s).",
        "",
        "## Held-out gold score (greedy, % exact)",
        "",
        "| model | gold score (%) |",
        "|---|---|",
        *[f"| {name} | {fmt(v)} |" for name, v in gold],
    ]
    if gold[1][1] is not None and gold[2][1] is not None:
        lines += ["", f"PPO changed the gold score by **{gold[2][1] - gold[1][1]:+.1f} points** (percentage points) "
                      f"with {kl_sentence(s['ppo'].get('kl'), kl_estimator(root))}."]
    tasks = sorted({k.split("/")[1].rsplit("_", 1)[0] for k in s["ppo"] if k.startswith("gold_score/")})
    if tasks:
        lines += ["", "| task | after SFT (%) | after PPO (%) |", "|---|---|---|"]
        lines += [f"| {t} | {fmt(s['ppo'].get(f'gold_score/{t}_before'))} | {fmt(s['ppo'].get(f'gold_score/{t}_after'))} |"
                  for t in tasks]
    r = s["reward"]
    per_task = [f"{k.split('/')[1]} {fmt(v)}" for k, v in r.items() if k.startswith("eval_accuracy/")]
    lines += [
        "", "## Reward model", "",
        f"Held-out pair accuracy {fmt(r.get('eval_accuracy'))}; mean chosen score {fmt(r.get('eval_chosen_score'))}, "
        f"rejected {fmt(r.get('eval_rejected_score'))}; agreement with the gold judge {fmt(r.get('gold_agreement'))}, "
        f"AUC of scores for correct vs incorrect responses {fmt(r.get('gold_auc'))}."
        + (" Per task: " + ", ".join(per_task) + "." if per_task else ""),
        "", "## PPO", "",
        f"{s['ppo']['steps']} steps; reward (held-out, sampled) {fmt(s['ppo'].get('reward_before'))} -> "
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
    print("\n".join(lines[:20]))
    print(f"report: {os.path.join(root, 'report.md')}")


if __name__ == "__main__":
    main()
