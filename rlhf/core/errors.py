"""The errors a user can cause: each ends a run with one clear line and exit code 2 (rlhf/run/app.py).

They live here, below every other package, so that a module raising one imports nothing else."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key."""


class DataFormatError(ValueError):
    """A data source or row that does not fit any accepted shape; the message names where."""


class DataFileNotFoundError(DataFormatError, FileNotFoundError):
    """A local data file that does not exist (catchable as either parent)."""


class TrainingError(RuntimeError):
    """A run that cannot go on (e.g. non-finite losses step after step); the message says why."""
