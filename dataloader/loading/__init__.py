"""What training loops iterate: datasets, loaders, mixtures, and their resumable state. Imports
flow down this list only:

    state.py     the JSON-able state: its format, and every check of an untrusted one
    collate.py   numpy batches -> what the loop wants (torch tensors, imported only then)
    dataset.py   StreamingDataset: order, ranks, windows, torch's DataLoader protocol
    tokens.py    TokenDataset: documents packed into fixed-length token sequences
    loader.py    StreamingLoader: batches prefetched by threads, exactly resumable
    mixing.py    MixedLoader: several datasets mixed with weights, deterministically

Depends on `read`, `order` and `format`; never on `write`, `sources` or `cli`.
"""

from __future__ import annotations

from .dataset import StreamingDataset
from .loader import StreamingLoader
from .mixing import MixedLoader
from .tokens import TokenDataset

__all__ = ["MixedLoader", "StreamingDataset", "StreamingLoader", "TokenDataset"]
