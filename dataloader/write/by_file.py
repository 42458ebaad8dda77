"""Conversion file by file, in forked worker processes (`ckpt-data convert --workers N`).

File i's samples become partitions ``i * 1,000,000 + k`` (k = 0, 1, ...; each of
`partition_rows` samples, the file's last one shorter), so the dataset depends only on the
files and options, never on the number of processes: `--workers 1` runs the same partitions
in this process. The fields and rows per block are decided once, from the first samples of
the whole source (as `write_dataset` does). Each process reads and parses its own files and
writes their partitions, so parsing scales with processes, not only encoding and I/O. Only
JSON crosses the pipes (receipts, error text): nothing is pickled. POSIX (fork) only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..format.index import DatasetIndex
from ..sources.base import Source
from .forked import run_forked
from .partitions import commit_dataset, write_partition
from .samples import choose_rows_per_chunk, probe_samples

STRIDE = 1_000_000  # partitions per file, at most


def _file_partitions(uri: str, source: Source, i: int, per_part: int, opts: dict[str, Any]
                     ) -> Iterator[dict[str, Any]]:
    assert source.file_samples is not None
    part: list[Any] = []
    k = 0
    for sample in source.file_samples(i):
        part.append(sample)
        if len(part) == per_part:
            yield write_partition(uri, i * STRIDE + k, part, **opts)
            part, k = [], k + 1
            if k >= STRIDE:
                raise ValueError(f"{source.files[i]}: over {STRIDE:,} partitions in one file")
    if part:
        yield write_partition(uri, i * STRIDE + k, part, **opts)


def convert_by_file(
    uri: str, source: Source, workers: int, *, schema: dict[str, str],
    rows_per_chunk: int | None, compression: str | None, store_options: dict[str, Any],
    metadata: dict[str, Any], on_samples: Callable[[int], None] = lambda n: None,
) -> DatasetIndex:
    """Write `source` (which must offer `file_samples`) file by file and commit it."""
    probe, specs, rows, final = probe_samples(source.samples(), schema)
    del probe
    if not specs:
        raise ValueError(f"{source.files[0]}: no samples (a dataset needs at least one)")
    R = rows_per_chunk or choose_rows_per_chunk(specs, rows, 4 << 20, final)
    del rows
    opts = {"schema": {k: s.kind for k, s in specs.items()}, "rows_per_chunk": R,
            "compression": compression, "store_options": store_options}
    per_part = 4 * R
    receipts: list[dict[str, Any]] = []
    if workers <= 1 or len(source.files) == 1:
        for i in range(len(source.files)):
            for r in _file_partitions(uri, source, i, per_part, opts):
                receipts.append(r)
                on_samples(int(r["num_samples"]))
    else:
        receipts = _forked(uri, source, min(workers, len(source.files)), per_part, opts,
                           on_samples)
    return commit_dataset(uri, receipts, metadata, store_options=store_options)


def _forked(uri: str, source: Source, workers: int, per_part: int, opts: dict[str, Any],
            on_samples: Callable[[int], None]) -> list[dict[str, Any]]:
    count = len(source.files)

    def convert_every_kth(c: int) -> Iterator[dict[str, Any]]:
        for i in range(c, count, workers):
            yield from _file_partitions(uri, source, i, per_part, opts)

    return run_forked(workers, convert_every_kth, what="converter",
                      error=lambda kind, msg: ValueError(msg),
                      on_result=lambda r: on_samples(int(r["num_samples"])))
