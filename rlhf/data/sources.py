"""Data sources: a local .jsonl / .json / .parquet file, a local directory, or a `datasets` hub name.

    load_rows("data/default/sft.jsonl")         # read here, line by line; origin "…/sft.jsonl:17"
    load_rows("rows.json")                      # a list of objects, or {"any_key": [objects]}
    load_rows("rows.parquet")                   # pyarrow; origin "rows.parquet row 5" (0-based)
    load_rows("some/dir", split="train")        # datasets.load_dataset(dir) — works offline
    load_rows("Dahoas/rm-static", split="test") # datasets.load_dataset(name) — needs the hub/cache

Line numbers are 1-based (as an editor shows them); row numbers are 0-based (as `ds[5]` indexes).
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf.core.errors import DataFileNotFoundError, DataFormatError
from rlhf.core.hub import FILE_LIKE_SUFFIXES, SUPPORTED_EXTENSIONS, ensure_hub
from rlhf.data.records import Row



def load_rows(source: str, split: str = "train", cache_dir: str | None = None, key: str | None = None) -> list[Row]:
    """Every record of `source` as a Row (dict + origin). `split`/`cache_dir` apply to load_dataset;
    `key` (e.g. "data.path") names the config key in errors about hub names."""
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if path.is_file():
        if suffix == ".jsonl":
            return _read_jsonl(path)
        if suffix == ".json":
            return _read_json(path)
        if suffix == ".parquet":
            return _read_parquet(path)
        raise DataFormatError(
            f"{path}: unsupported file type {suffix!r}; supported: {', '.join(SUPPORTED_EXTENSIONS)} "
            "files, a directory of them, or a datasets hub name"
        )
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file())
        kinds = sorted({f.suffix.lower() for f in files if f.suffix.lower() in SUPPORTED_EXTENSIONS})
        if not kinds:  # datasets.load_dataset(dir) would read .txt lines (or .csv rows) as rows of another shape
            names = [str(f.relative_to(path)) for f in files]
            held = f"it holds {_some(names)}" if names else "it is empty"
            raise DataFormatError(f"{path}: no {', '.join(SUPPORTED_EXTENSIONS[:-1])} or {SUPPORTED_EXTENSIONS[-1]} "
                                  f"file in this directory ({held}): name a data file, or a directory of them")
        if len(kinds) > 1:  # datasets.load_dataset(dir) would read one kind and silently drop the others
            raise DataFormatError(f"{path}: a directory of mixed formats ({', '.join(kinds)}): keep one kind of "
                                  "file in it, or name a single file")
    if not path.exists():
        if suffix in SUPPORTED_EXTENSIONS:
            raise DataFileNotFoundError(f"data file not found: {path}")
        if suffix in FILE_LIKE_SUFFIXES:
            raise DataFormatError(
                f"{path}: unsupported file type {suffix!r} (and no such file); supported: "
                f"{', '.join(SUPPORTED_EXTENSIONS)} files, a directory of them, or a datasets hub name"
            )
        if source.startswith(("/", "./", "../", "~")):
            raise DataFileNotFoundError(f"data path not found: {path}")
    return _load_dataset(source, split, cache_dir, key)


def write_rows(path: str, rows: Sequence[Row]) -> str:
    """`rows` as a .jsonl file that `load_rows` reads back as the same records (atomically: temp file +
    rename); a value JSON has no type for is written as its string. Returns `path`."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r.data, ensure_ascii=False, default=str) + "\n" for r in rows)
    os.replace(tmp, path)
    return path


def _some(names: list[str], n: int = 8) -> str:
    """"a, b and 3 more": the first `n` names."""
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _read_jsonl(path: Path) -> list[Row]:
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            origin = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataFormatError(f"{origin}: not UTF-8 text (byte {raw[e.start:e.start + 1]!r} at column "
                                      f"{e.start + 1}); re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{origin}: invalid JSON: {e}") from None
            if not isinstance(obj, dict):
                raise DataFormatError(f"{origin}: expected a JSON object per line, got {type(obj).__name__}")
            rows.append(Row(obj, origin))
    return rows


def _read_json(path: Path) -> list[Row]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataFormatError(f"{path}: invalid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise DataFormatError(f"{path}: not UTF-8 text (byte {e.start}); re-encode the file as UTF-8") from None
    if isinstance(obj, dict) and len(obj) == 1 and isinstance(next(iter(obj.values())), list):
        obj = next(iter(obj.values()))  # {"data": [...]}
    if not isinstance(obj, list):
        raise DataFormatError(f"{path}: expected a list of objects, or an object with a single list value")
    rows = []
    for i, item in enumerate(obj):
        if not isinstance(item, dict):
            raise DataFormatError(f"{path} row {i}: expected an object, got {type(item).__name__}")
        rows.append(Row(item, f"{path} row {i}"))
    return rows


def _read_parquet(path: Path) -> list[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataFormatError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    return [Row(d, f"{path} row {i}") for i, d in enumerate(table.to_pylist())]


def _load_dataset(source: str, split: str, cache_dir: str | None, key: str | None = None) -> list[Row]:

    what = f"{key}={source!r}" if key else f"data source {source!r}"
    ensure_hub(source, key or "data source", "dataset", cache_dir)  # no reachable hub: fails in seconds
    import datasets

    try:
        ds: Any = datasets.load_dataset(source, split=split, cache_dir=cache_dir)
    except OSError as e:  # ConnectionError, a hub name that does not exist, or not in the cache offline
        msg = " ".join(str(e).split())
        raise DataFormatError(
            f"{what} (split {split!r}): datasets.load_dataset failed: {type(e).__name__}: {msg}") from None
    except Exception as e:
        e.add_note(f"while loading data source {source!r} (split {split!r}) with datasets.load_dataset")
        raise
    return [Row(d, f"dataset {source} row {i}") for i, d in enumerate(ds.to_list())]
