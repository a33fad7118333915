"""The engine's errors a user can cause and fix (no torch import: the apps catch them early)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed as asked: incomplete, foreign, or saved by a layout
    (ZeRO-1 optimizer shards, per-rank state) that this run cannot read."""
