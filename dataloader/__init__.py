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

See docs/dataloader.md.
"""

from __future__ import annotations

from typing import Any

from .dataset import StreamingDataset
from .errors import DatasetNotFoundError, MissingShardError, StateMismatchError
from .format import DatasetIndex
from .loader import StreamingLoader
from .metrics import Metrics
from .mixing import MixedLoader
from .partitions import commit_dataset, gc_partitions, write_partition
from .tokens import TokenDataset
from .writer import DatasetWriter, write_dataset


def __getattr__(name: str) -> Any:
    """`dataloader.RayDatasink` imports ray on first use only (the 'ray' extra)."""
    if name == "RayDatasink":
        from .ray_datasink import RayDatasink

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
