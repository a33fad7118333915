"""run: the stage skeleton (stage.py: Run), the entry point and user errors (app.py), the run log
(runlog.py) and the memory planner behind `python -m rlhf.plan` (plan.py). Imports every layer below;
the commands (rlhf/sft.py, reward.py, ...) are built on it."""
