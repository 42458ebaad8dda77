"""JSON Lines: one JSON object per line = one sample. Numbers, strings and bools stay
scalars; lists of numbers (or of bools) become 1-d arrays (int64, float64 or bool)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .base import Sample, Source, files_with


def json_value(v: Any, where: str) -> Any:
    """A JSON value as a sample value; TypeError naming `where` for anything else."""
    if isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, list):
        if not v:
            return np.zeros(0, dtype=np.int64)
        if all(isinstance(x, bool) for x in v):
            return np.asarray(v, dtype=np.bool_)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            try:
                return np.asarray(v, dtype=np.int64)
            except OverflowError:
                raise ValueError(f"{where}: an integer does not fit in int64") from None
        if all(isinstance(x, int | float) and not isinstance(x, bool) for x in v):
            return np.asarray(v, dtype=np.float64)
        raise TypeError(f"{where}: lists must hold only numbers (or only bools)")
    raise TypeError(
        f"{where}: unsupported JSON value {type(v).__name__} (use numbers, str, lists of numbers)"
    )


def iter_jsonl(files: Sequence[Path]) -> Iterator[Sample]:
    for path in files:
        with open(path, encoding="utf-8") as fh:
            lineno = 0
            while True:
                try:
                    line = fh.readline()
                except UnicodeDecodeError as exc:
                    where = f"{path}:{lineno + 1}"
                    raise ValueError(f"{where}: not UTF-8 text ({exc.reason})") from None
                if not line:
                    break
                lineno += 1
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{where}: invalid JSON ({exc})") from None
                if not isinstance(obj, dict):
                    raise TypeError(f"{where}: each line must be a JSON object")
                yield {k: json_value(v, f"{where}, field {k!r}") for k, v in obj.items()}


def jsonl_source(src: Path) -> Source:
    files = files_with(src, (".jsonl", ".ndjson"), "JSON Lines")
    return Source("jsonl", files, lambda: iter_jsonl(files),
                  file_samples=lambda i: iter_jsonl(files[i : i + 1]))
