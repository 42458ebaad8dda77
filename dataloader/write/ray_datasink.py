"""`RayDatasink`: write a Ray Data dataset as a dataloader dataset.

    import ray, dataloader
    ds = ray.data.read_parquet(...).map_batches(tokenize)
    ds.write_datasink(dataloader.RayDatasink("s3://bucket/ds", store_options={...}))

Each write task writes one partition (`write_partition`, partition index = the task's index)
and returns its receipt; `on_write_complete` runs once on the driver and commits them
(`commit_dataset`). A failed job commits nothing: its partitions are orphans that
`gc_partitions` removes after its grace period. The dataset lists partitions by task index:
to keep the input's order set ``DataContext.get_current().execution_options.preserve_order =
True`` (Ray may otherwise number tasks in the order blocks become ready).

This is the only module that imports ray (``pip install 'ckptstore[ray]'``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from ckptstore.toolkit import missing

try:
    from ray.data import Datasink
    from ray.data.block import BlockAccessor
except ModuleNotFoundError as _exc:  # ray is the `ray` extra
    raise missing(_exc) from None

from ckptstore.errors import ObjectExistsError
from ckptstore.stores import open_store

from ..format.index import DatasetIndex
from ..format.spec import INDEX_KEY
from .partitions import commit_dataset, write_partition

__all__ = ["RayDatasink"]


def _rows(block: Any) -> Iterator[dict[str, Any]]:
    """The samples of one Ray block (an Arrow table or a pandas frame): numeric columns give
    numpy scalars, tensor columns numpy arrays, string and binary columns str and bytes."""
    cols = BlockAccessor.for_block(block).to_numpy()
    if not isinstance(cols, dict):
        raise TypeError(f"RayDatasink: expected named columns, got {type(cols).__name__}")
    names = list(cols)
    n = len(cols[names[0]]) if names else 0
    for i in range(n):
        yield {k: _value(cols[k][i]) for k in names}


def _value(v: Any) -> Any:
    if isinstance(v, np.ndarray) and v.dtype == object:
        raise TypeError("RayDatasink: nested object arrays are not supported")
    return v


class RayDatasink(Datasink[dict[str, Any]]):  # type: ignore[misc, unused-ignore]
    """A `ray.data.Datasink` writing a dataloader dataset at `uri`.

    Options: `metadata` (stored in dataset.json), `store_options`, and write_partition's
    options (schema, rows_per_chunk, chunk_bytes, shard_bytes, data_chunk_bytes,
    compression). Pass `rows_per_chunk` for blocks of the same size in every partition (by
    default each partition chooses its own, and a partition's last block may be short)."""

    def __init__(
        self,
        uri: str,
        *,
        metadata: Mapping[str, Any] | None = None,
        store_options: Mapping[str, Any] | None = None,
        min_rows_per_write: int | None = None,
        **options: Any,
    ) -> None:
        self.uri = uri
        self.metadata = dict(metadata or {})
        self.store_options = dict(store_options or {})
        self.options = options
        self._min_rows = min_rows_per_write
        self.index: DatasetIndex | None = None

    @property
    def min_rows_per_write(self) -> int | None:
        """Rows Ray gathers before a write task (larger partitions, fewer of them)."""
        return self._min_rows

    def get_name(self) -> str:
        return "DataloaderDataset"

    def on_write_start(self, schema: Any = None) -> None:
        with open_store(self.uri, **self.store_options) as store:
            if store.exists(INDEX_KEY):
                raise ObjectExistsError(f"{store.uri}: a dataset exists here already")

    def write(self, blocks: Iterable[Any], ctx: Any) -> dict[str, Any]:
        samples = (row for block in blocks for row in _rows(block))
        return write_partition(
            self.uri, int(ctx.task_idx), samples, store_options=self.store_options, **self.options
        )

    def on_write_complete(self, write_result: Any) -> None:
        # Ray >= 2.38 passes a WriteResult; earlier 2.x releases passed the list of returns.
        receipts = (
            write_result if isinstance(write_result, list) else write_result.write_returns
        )
        self.index = commit_dataset(
            self.uri, receipts, self.metadata, store_options=self.store_options
        )
