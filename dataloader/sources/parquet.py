"""Parquet files (or a folder of them, sorted by path): one row = one sample, read in record
batches with pyarrow (the ``parquet`` extra). Column types as in arrow_rows."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .arrow_rows import file_samples, require_pyarrow
from .base import Sample, Source, files_with

_BATCH_ROWS = 4096


def _open(path: Path) -> Any:
    require_pyarrow("Parquet files")
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not a readable Parquet file ({exc})") from None


def iter_parquet(files: Sequence[Path]) -> Iterator[Sample]:
    for path in files:
        pf = _open(path)
        yield from file_samples(path, pf.schema_arrow, pf.iter_batches(batch_size=_BATCH_ROWS))


def parquet_source(src: Path) -> Source:
    files = files_with(src, (".parquet",), "Parquet")
    count = sum(_open(p).metadata.num_rows for p in files)
    return Source("parquet", files, lambda: iter_parquet(files), count,
                  file_samples=lambda i: iter_parquet(files[i : i + 1]))
