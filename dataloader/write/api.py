"""`write_dataset`: the one entry point of the write path, for any kind of input.

It reads what it is given as samples (a Hugging Face dataset, a source path, a
`dataloader.sources.Source`, or any iterable of sample dicts), then writes them as one stream
(`DatasetWriter`, a v1 dataset) or, with `workers`, as partitions written in parallel and
committed once (`write_dataset_parallel`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from ckptstore.stores import Store

from ..format.index import DatasetIndex
from .dataset_writer import DatasetWriter
from .parallel import write_dataset_parallel

__all__ = ["as_samples", "write_dataset"]


def as_samples(samples: Any) -> Any:
    """`samples` as an iterable of sample dicts: a Hugging Face dataset object, a source path
    or a Source is read through dataloader.sources; anything else is returned as it is."""
    from ..sources import Source, open_source
    from ..sources.hf import dataset_samples, is_hf_dataset

    if is_hf_dataset(samples):
        return dataset_samples(samples)
    if isinstance(samples, os.PathLike):
        return open_source(os.fspath(samples)).samples()
    if isinstance(samples, Source):
        return samples.samples()
    return samples


def write_dataset(
    uri: str | Store,
    samples: Iterable[Mapping[str, Any]] | os.PathLike[str] | Any,
    *,
    workers: int | None = None,
    partition_rows: int | None = None,
    **options: Any,
) -> DatasetIndex:
    """Write `samples` as a dataset at `uri` and return its index. See DatasetWriter for
    options (schema, rows_per_chunk, chunk_bytes, shard_bytes, compression, metadata,
    overwrite, store_options).

    `workers`: None writes one stream (a v1 dataset, arrays at the root). An int (0: the
    number of cores) encodes and writes partitions of `partition_rows` samples on that many
    threads and commits them (a partitioned dataset, see partitions.py); the result is the
    same, byte for byte, for every number of workers. `executor="processes"` uses forked
    processes instead of threads (see parallel.write_dataset_parallel).

    `samples` may also be a Hugging Face ``datasets.Dataset`` / ``IterableDataset`` (its
    rows, read as Arrow batches), a path (``pathlib.Path``) of any source `ckpt-data convert`
    reads (format detected), or a `dataloader.sources.Source` (``open_source(path, ...)``)."""
    samples = as_samples(samples)
    if workers is not None or partition_rows is not None or "executor" in options:
        return write_dataset_parallel(
            uri, samples, workers=workers or None, partition_rows=partition_rows, **options
        )
    with DatasetWriter(uri, **options) as writer:
        for sample in samples:
            writer.add(sample)
        return writer.close()
