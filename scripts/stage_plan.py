"""Should run_all.sh skip, resume or run a stage? One line on stdout: `<action> <reason>`.

    python scripts/stage_plan.py ppo outputs/ppo output_dir=outputs/ppo ppo.kl_coef=0.3 ...

action is `skip`, `resume` or `run`. The overrides are the ones run_all.sh passes the stage (without
train.resume). "The saved config matches" means: the config this invocation would run, composed by
Hydra from conf/<stage>.yaml with these overrides and converted to the stage's dataclass exactly as
the stage does (`to_config`, then `as_yaml`, which is what it writes as config.yaml), equals
<out>/config.yaml key by key, `train.resume` and `train.overwrite` excepted (how a run starts). Paths
compare as written (`outputs/sft` and its absolute form differ) and `${root:...}` data paths as
absolute paths into this checkout. Not compared: the contents of data files, the code, LAUNCH.

    skip    summary.json exists and the saved config matches
    resume  no summary.json, the saved config matches, and checkpoints/ holds a complete checkpoint
    run     anything else (no config.yaml, a changed config, nothing to resume from)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

STAGES = {"sft": "SFTConfig", "reward": "RewardConfig", "dpo": "DPOConfig", "ppo": "PPOConfig"}
IGNORED = ("train.resume", "train.overwrite")  # how a run starts, not what it computes


def composed_config(stage: str, overrides: list[str]) -> dict:
    """The stage's typed config for these overrides, as the plain dict that its config.yaml holds."""
    from omegaconf import OmegaConf

    from rlhf import config as C  # the schema; no torch import (engine/config.py), so a check takes ~1 s

    cfg = C.to_config(C.compose(stage, overrides), getattr(C, STAGES[stage]))
    return OmegaConf.to_container(OmegaConf.create(C.as_yaml(cfg)))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def config_diff(saved: dict, wanted: dict) -> list[str]:
    """'key: saved -> wanted' for each key that differs (IGNORED keys excepted), sorted."""
    a, b = _flat(saved), _flat(wanted)
    return [f"{k}: {a.get(k, '<absent>')} -> {b.get(k, '<absent>')}"
            for k in sorted(set(a) | set(b)) if k not in IGNORED and a.get(k, object()) != b.get(k, object())]


def has_checkpoint(out_dir: str) -> bool:
    """A complete checkpoint under checkpoints/ (engine.checkpoint.list_checkpoints' rule: a meta.json and
    no `.tmp-` in the name), checked here without importing torch so that the check stays fast."""
    root = os.path.join(out_dir, "checkpoints")
    return os.path.isdir(root) and any(
        ".tmp-" not in name and os.path.isfile(os.path.join(root, name, "meta.json")) for name in os.listdir(root))


def plan(stage: str, out_dir: str, overrides: list[str]) -> tuple[str, str]:
    from omegaconf import OmegaConf

    saved_path = os.path.join(out_dir, "config.yaml")
    if not os.path.exists(saved_path):
        return "run", f"no {saved_path}"
    try:
        wanted = composed_config(stage, overrides)
    except Exception as e:  # the stage itself will report the error properly
        return "run", f"could not compose the config here ({type(e).__name__}: {str(e).splitlines()[0]})"
    diff = config_diff(OmegaConf.to_container(OmegaConf.load(saved_path)), wanted)
    if diff:
        more = f" (+{len(diff) - 3} more)" if len(diff) > 3 else ""
        return "run", "config changed: " + "; ".join(diff[:3]) + more
    if os.path.exists(os.path.join(out_dir, "summary.json")):
        return "skip", "summary.json exists and config.yaml matches"
    if has_checkpoint(out_dir):
        return "resume", "config.yaml matches, no summary.json, checkpoints/ has a complete checkpoint"
    return "run", "config.yaml matches but there is no summary.json and no complete checkpoint to resume from"


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in STAGES:
        raise SystemExit(f"usage: {sys.argv[0]} {{{'|'.join(STAGES)}}} OUT_DIR [overrides...]")
    action, reason = plan(sys.argv[1], sys.argv[2], sys.argv[3:])
    print(f"{action} {reason}")


if __name__ == "__main__":
    main()
