"""dataloader: a streaming, prefetching, exactly resumable dataloader over ckptstore stores.

    import dataloader
    dataloader.write_dataset("s3://bucket/ds", samples, store_options={"endpoint_url": ...})
    ds = dataloader.StreamingDataset("s3://bucket/ds", shuffle=True, seed=0, store_options=...)
    loader = dataloader.StreamingLoader(ds, batch_size=32, num_workers=4)
    for batch in loader: ...
    state = loader.state_dict()          # small, JSON-able; save it in a checkpoint
    loader.load_state_dict(state)        # resume with exactly the next sample

See docs/dataloader.md.
"""

from __future__ import annotations

from .dataset import StreamingDataset
from .errors import DatasetNotFoundError, MissingShardError, StateMismatchError
from .format import DatasetIndex
from .loader import StreamingLoader
from .metrics import Metrics
from .mixing import MixedLoader
from .tokens import TokenDataset
from .writer import DatasetWriter, write_dataset

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
    "write_dataset",
]
