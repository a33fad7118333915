"""The engine's errors a user can cause and fix (no torch import: the apps catch them early)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed as asked: incomplete, foreign, or saved by a layout
    (ZeRO-1 optimizer shards, per-rank state) that this run cannot read."""


class WeightCheckError(RuntimeError):
    """The generation layout (the injected model's fused slots, or the gathered module that
    `transformers` generate uses) does not hold the training parameters it was built from
    (`engine.check_weights`): a stale, corrupted or unmerged weight. Raised on every rank before a
    token is sampled."""


class LaunchError(ValueError):
    """A launch that does not fit the machine: more processes on a node than it has GPUs, say."""
