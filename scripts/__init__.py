"""The project's scripts (run as `python scripts/<name>.py` or `bash scripts/run_all.sh`); a package only so
that the import-linter contract in pyproject.toml can check that they sit above rlhf/, engine/ and kernels/."""
