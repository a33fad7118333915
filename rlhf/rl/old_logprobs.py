"""Where each RL step's old log-probs come from (`ppo.old_logprobs`): the actor's scoring forward, or the
sampler's own log-probs of the tokens it drew (`Rollout.logp_gen`), which skip that forward.

    src = OldLogprobs(cfg.ppo, cfg.rollout)
    recompute = src.recompute(step)              # before scoring: this step's choice (0-based step)
    scored = models.score(rollout, old_from_sampler=not recompute)
    ...
    src.after_step(step, rec)                    # a recomputed step: its gen_logprob_gap decides the next ones

The two are one distribution when the sampler draws from the trainer's (logits / temperature, top-k and
top-p off: rollout.top_k=0, rollout.top_p=1); the gap is then rounding (fp32 on CPU: ~1e-7 nats per
token, tests/test_sampler_gap.py), and the sampler's log-probs are the trainer's. With top-k/top-p on, the
sampler's are of the truncated, renormalised distribution the tokens were drawn from, higher than the
trainer's by -log(kept mass): reused as old log-probs, the PPO ratio would start below 1 on every token
(the update's ratio against the behaviour policy, not against the trainer's own). The measured gap
(rec["gen_logprob_gap"], rlhf/rl/metrics.py sampler_gap) decides:

    recompute  the actor's scoring forward on every step
    sampler    the sampler's on every step but the checks (the first step and every
               `old_logprobs_check_every`-th, recomputed and measured); a check over
               `old_logprobs_max_gap` falls back to recompute for the rest of the run (one WARN line)
    auto       recompute on the first FIRST_CHECKS steps and every `old_logprobs_check_every`-th;
               the sampler's on the others while the last check stayed under `old_logprobs_max_gap`
               (each switch one INFO line); with ppo.is_correction tis|mis it recomputes every step
               (the correction weighs exp(logp_old - logp_gen), which needs both)

A step that reuses the sampler's has no gap to report (gen_logprob_gap and gen_kl are left out of its
metrics, and the gen alarm skips it); `old_logprobs_sampler` (0/1) in metrics.jsonl says which it was.
The state (fallen back, reusing) is checkpointed with the run (`state_dict`), so a resumed run decides as
the uninterrupted one does.
"""
from __future__ import annotations

import logging
import math
from typing import Any

from rlhf.config import PPOAlgoConfig, RolloutConfig

logger = logging.getLogger("rlhf.ppo")

FIRST_CHECKS = 2  # auto: the first steps recomputed, each gap measured, before any reuse


class OldLogprobs:
    """The per-step choice of `ppo.old_logprobs` (module docstring), from the gaps measured so far."""

    def __init__(self, p: PPOAlgoConfig, r: RolloutConfig):
        self.mode = p.old_logprobs
        if self.mode == "auto" and r.mode == "async" and r.max_staleness > 0:
            logger.info("ppo.old_logprobs=auto: recomputing on every step (rollout.mode=async samples with weights up "
                        "to rollout.max_staleness=%d steps old: the old log-probs are the version trained's)",
                        r.max_staleness)
            self.mode = "recompute"
        self.max_gap, self.every = p.old_logprobs_max_gap, p.old_logprobs_check_every
        if self.mode == "auto" and p.is_correction != "none":
            logger.info("ppo.old_logprobs=auto: recomputing on every step (ppo.is_correction=%s weighs the trainer's "
                        "log-probs against the sampler's, so it needs both)", p.is_correction)
            self.mode = "recompute"
        if self.mode == "sampler" and (r.top_k or r.top_p < 1):
            logger.warning("ppo.old_logprobs=sampler with rollout.top_k=%d / top_p=%g: the sampler's log-probs are "
                           "of the truncated distribution, not the trainer's; the first step's gap check decides "
                           "(above ppo.old_logprobs_max_gap=%g: recompute)", r.top_k, r.top_p, self.max_gap)
        self.reusing = False     # auto: the last check was under the threshold
        self.fell_back = False   # sampler: a check went over it (for good)
        self.last_gap: float | None = None

    def recompute(self, step: int) -> bool:
        """Whether step `step` (0-based) runs the actor's scoring forward (True) or reuses the sampler's."""
        if self.mode == "recompute" or self.fell_back:
            return True
        check = step % self.every == 0
        if self.mode == "sampler":
            return check or self.last_gap is None  # the first step of a run (or of a resumed one without a gap)
        return check or step < FIRST_CHECKS or not self.reusing

    def after_step(self, step: int, rec: dict[str, Any]) -> None:
        """Read a recomputed step's measured gap (rec["gen_logprob_gap"], the same on every rank) and switch.
        A step without one (reused, or a rollout without sampler log-probs) changes nothing."""
        gap = rec.get("gen_logprob_gap")
        if self.mode == "recompute" or self.fell_back or gap is None:
            return
        self.last_gap = gap
        over = not (math.isfinite(gap) and gap <= self.max_gap)
        if self.mode == "sampler":
            if over:
                self.fell_back = True
                logger.warning("step %d: ppo.old_logprobs=sampler falls back to recompute for the rest of the run: "
                               "the sampler's log-probs are %.3g nats/token from the trainer's (gen_logprob_gap), over "
                               "ppo.old_logprobs_max_gap=%g", step + 1, gap, self.max_gap)
            return
        reuse = not over and step + 1 >= FIRST_CHECKS
        if reuse != self.reusing:
            logger.info("step %d: ppo.old_logprobs=auto %s (gen_logprob_gap %.3g %s ppo.old_logprobs_max_gap=%g)",
                        step + 1, "reuses the sampler's log-probs" if reuse else "recomputes the old log-probs",
                        gap, "<=" if not over else ">", self.max_gap)
        self.reusing = reuse

    def state_dict(self) -> dict:
        return {"reusing": self.reusing, "fell_back": self.fell_back, "last_gap": self.last_gap}

    def load_state_dict(self, state: dict) -> None:
        self.reusing, self.fell_back, self.last_gap = bool(state["reusing"]), bool(state["fell_back"]), state["last_gap"]
