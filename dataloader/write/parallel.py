"""`write_dataset(..., workers=N)`: the partition API (partitions.py) driven locally, by threads
or by forked processes.

Samples are cut into partitions of `partition_rows` samples (default 16 blocks, about 64 MiB;
rows per block chosen from the first samples, as the single stream does), written by N
workers and committed in order. The result depends only on the samples and options, never on
`workers` or `executor`: same bytes, same fingerprint. Memory: at most workers + 2 partitions
of samples, and the last shards of at most 3 partitions being sealed, are held at a time.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckptstore.stores import Store

from ..format.index import DatasetIndex
from ..format.validate import check_int
from .dataset_writer import clear_target, open_target
from .forked import run_forked
from .partitions import WRITER_OPTIONS, commit_dataset, fill_partition, write_partition
from .samples import choose_rows_per_chunk, probe_samples

__all__ = ["write_dataset_parallel"]

_PARTITION_BLOCKS = 16  # default partition: each costs ~15 fsyncs and ~5 objects however small
_MAX_SEALING = 2  # filled partitions being sealed (each holds its last shards' buffers)
_SEALERS = 2  # threads writing partitions' last shards and waiting for their fsyncs


def write_dataset_parallel(
    uri: str | Store,
    samples: Iterable[Mapping[str, Any]],
    *,
    workers: int | None = None,
    partition_rows: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    executor: str = "threads",
    **options: Any,
) -> DatasetIndex:
    """`write_dataset` with `workers` threads: partitions of `partition_rows` samples (default
    16 blocks, about 64 MiB) are written concurrently and committed in order. The result
    depends only on the samples and options, never on `workers` or `executor` (same bytes,
    same fingerprint). Memory: at most workers + 2 partitions of samples, and the last shards
    of at most 3 partitions being sealed, are held at a time.

    `executor="processes"`: forked worker processes (POSIX only) each write every
    `workers`-th partition of `samples`, which must then be a sequence already in memory
    (a list): the children read it from the memory they inherit, so no sample is serialized;
    receipts come back as JSON bytes over pipes. `uri` must be a URI, not a memory store."""
    workers = check_int(workers or os.cpu_count() or 1, "workers", 1, 4096, ValueError)
    unknown = sorted(set(options) - set(WRITER_OPTIONS))
    if unknown:
        raise TypeError(f"write_dataset: unexpected option(s) {unknown}")
    if executor not in ("threads", "processes"):
        raise ValueError(f"executor must be 'threads' or 'processes', got {executor!r}")
    store_options = dict(options.pop("store_options", None) or {})
    if executor == "processes":
        if not isinstance(samples, Sequence) or isinstance(uri, Store):
            raise ValueError("executor='processes' needs a sequence of samples and a URI")
        if uri.startswith("memory://"):
            raise ValueError("executor='processes' cannot write to a memory store")
    store = open_target(uri, store_options)
    try:
        clear_target(store, overwrite)
        it = iter(samples)
        probe, specs, rows, final = probe_samples(it, dict(options.get("schema") or {}))
        R = options.get("rows_per_chunk") or (
            choose_rows_per_chunk(specs, rows, int(options.get("chunk_bytes", 4 << 20)), final)
            if specs
            else 1
        )
        del rows
        opts = {**options, "rows_per_chunk": R}
        if specs:  # every partition gets the kinds the first samples showed
            opts["schema"] = {k: s.kind for k, s in specs.items()}
        per_part = partition_rows or _PARTITION_BLOCKS * R
        per_part = check_int(per_part, "partition_rows", 1, None, ValueError)
        if executor == "processes":
            assert isinstance(samples, Sequence) and isinstance(uri, str)
            opts["store_options"] = store_options
            return commit_dataset(store, _write_forked(uri, samples, per_part, workers, opts),
                                  metadata)

        def write(p: int, part: list[Mapping[str, Any]]) -> Future[dict[str, Any]]:
            seal = fill_partition(store, p, part, p * per_part, opts)
            # the writer thread goes on to its next partition while the last shards are
            # written and made durable
            return sealer.submit(seal)

        receipts: list[dict[str, Any]] = []
        writing: deque[Future[Future[dict[str, Any]]]] = deque()
        sealing: deque[Future[dict[str, Any]]] = deque()
        with ThreadPoolExecutor(workers, thread_name_prefix="dataloader-write") as pool, \
                ThreadPoolExecutor(_SEALERS, thread_name_prefix="dataloader-seal") as sealer:
            try:
                part: list[Mapping[str, Any]] = []
                p = 0
                samples_in_order = itertools.chain(probe, it)
                del probe  # held by the chain only until it is consumed

                def settle(max_writing: int) -> None:
                    while len(writing) > max_writing:
                        sealing.append(writing.popleft().result())
                        while len(sealing) > _MAX_SEALING:
                            receipts.append(sealing.popleft().result())

                for sample in samples_in_order:
                    part.append(sample)
                    if len(part) == per_part:
                        writing.append(pool.submit(write, p, part))
                        part, p = [], p + 1
                        settle(workers)
                if part or p == 0:
                    writing.append(pool.submit(write, p, part))
                settle(0)
                receipts.extend(f.result() for f in sealing)
                sealing.clear()
            except BaseException:
                for fut in writing:
                    fut.cancel()
                raise
        return commit_dataset(store, receipts, metadata)
    finally:
        if not isinstance(uri, Store):
            store.close()


def _write_forked(
    uri: str, samples: Sequence[Mapping[str, Any]], per_part: int, workers: int,
    opts: dict[str, Any],
) -> list[dict[str, Any]]:
    """Partitions written by `workers` forked processes (partition p by child p % workers).
    Only bytes cross the pipes (JSON receipts, error text): nothing is pickled."""
    count = max(1, -(-len(samples) // per_part))
    workers = min(workers, count)

    def write_every_kth(k: int) -> Iterator[dict[str, Any]]:
        for p in range(k, count, workers):
            part = samples[p * per_part : (p + 1) * per_part]
            yield write_partition(uri, p, part, first_sample=p * per_part, **opts)

    receipts = run_forked(
        workers, write_every_kth, what="writer",
        error=lambda kind, msg: RuntimeError(f"partition write failed: {kind}: {msg}"),
    )
    if len(receipts) != count:
        raise RuntimeError(f"{count - len(receipts)} partition(s) were not written")
    return receipts
