"""dataloader: a streaming, prefetching, exactly resumable dataloader over ckptstore stores.

    import dataloader
    dataloader.write_dataset("s3://bucket/ds", samples, store_options={"endpoint_url": ...})
    ds = dataloader.StreamingDataset("s3://bucket/ds", shuffle=True, seed=0, store_options=...)
    loader = dataloader.StreamingLoader(ds, batch_size=32, num_workers=4)
    for batch in loader: ...
    receipt = dataloader.write_partition(uri, i, samples_i)   # any engine, any order
    dataloader.commit_dataset(uri, receipts)                   # then one commit
    state = loader.state_dict()          # small, JSON-able; save it in a checkpoint
    loader.load_state_dict(state)        # resume with exactly the next sample

Where things are (each folder's `__init__` says more). The data goes from sources/ through
write/ into a store, and from the store through read/ into loading/; imports flow down this
list only:

    errors.py    the dataloader's errors (derived from ckptstore's)
    format/      what is stored: dataset.json (index, fields, arrays), untrusted-JSON checks,
                 the layout's limits, the bytes of the zarr objects
    sources/     input formats -> sample dicts (JSON Lines, Parquet, NumPy, files, WebDataset,
                 Hugging Face)
    write/       samples -> a stored dataset: sample checks, array and dataset writers,
                 partitions, the parallel drivers, the Ray datasink
    order/       pure arithmetic: the epoch's order, rank shares, the torch-workers schedule
    read/        a stored dataset -> decoded windows: block reads, cache, views, prefetching,
                 verify
    loading/     StreamingDataset, TokenDataset, StreamingLoader, MixedLoader, their state
    cli/         the `ckpt-data` command

write/ and read/ never import each other, nor does anything import cli/ but `__main__`. Of
ckptstore, only its public API is used: `ckptstore` (top level), `ckptstore.errors`,
`ckptstore.stores` and `ckptstore.toolkit`. tests/dataloader/test_layers.py checks all of it.

See docs/dataloader.md.
"""

from __future__ import annotations

from typing import Any

from .errors import DatasetNotFoundError, MissingShardError, StateMismatchError
from .format.index import DatasetIndex
from .loading.dataset import StreamingDataset
from .loading.loader import StreamingLoader
from .loading.mixing import MixedLoader
from .loading.tokens import TokenDataset
from .read.metrics import Metrics
from .write.api import write_dataset
from .write.dataset_writer import DatasetWriter
from .write.partitions import commit_dataset, gc_partitions, write_partition


def __getattr__(name: str) -> Any:
    """`dataloader.RayDatasink` imports ray on first use only (the 'ray' extra)."""
    if name == "RayDatasink":
        from .write.ray_datasink import RayDatasink

        return RayDatasink
    raise AttributeError(f"module 'dataloader' has no attribute {name!r}")


__all__ = [
    "DatasetIndex",
    "DatasetNotFoundError",
    "DatasetWriter",
    "Metrics",
    "MissingShardError",
    "MixedLoader",
    "StateMismatchError",
    "StreamingDataset",
    "StreamingLoader",
    "TokenDataset",
    "commit_dataset",
    "gc_partitions",
    "write_dataset",
    "write_partition",
]
