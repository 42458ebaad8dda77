"""ckptstore: a sharded, content-addressed checkpoint store for PyTorch."""

from __future__ import annotations

from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptStoreError,
    DurabilityError,
    FormatError,
    IntegrityError,
    InvalidNameError,
    ObjectExistsError,
    ObjectNotFoundError,
    StoreAccessError,
    StoreError,
    UnsupportedTypeError,
)
from .stores import LocalStore, MemoryStore, ObjectInfo, Store, open_store

__version__ = "0.1.0"

__all__ = [
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CkptStoreError",
    "DurabilityError",
    "FormatError",
    "IntegrityError",
    "InvalidNameError",
    "LocalStore",
    "MemoryStore",
    "ObjectExistsError",
    "ObjectInfo",
    "ObjectNotFoundError",
    "Store",
    "StoreAccessError",
    "StoreError",
    "UnsupportedTypeError",
    "open_store",
]

from .codecs import Codec  # noqa: E402
from .errors import KeyMismatchError, RepositoryNotFoundError  # noqa: E402
from .maintenance import GcReport, VerifyReport  # noqa: E402
from .repository import CheckpointInfo, CheckpointStore, SaveHandle  # noqa: E402
from .writer import SaveInfo  # noqa: E402

__all__ += [
    "CheckpointInfo",
    "CheckpointStore",
    "Codec",
    "GcReport",
    "KeyMismatchError",
    "RepositoryNotFoundError",
    "SaveHandle",
    "SaveInfo",
    "VerifyReport",
]
from .sharding import Shard  # noqa: E402

__all__ += ["Shard"]
from .retention import Retention  # noqa: E402
from .rng import RNGState  # noqa: E402


def __getattr__(name: str):  # CheckpointManager imports torch: load it on first use
    if name == "CheckpointManager":
        from .manager import CheckpointManager

        return CheckpointManager
    if name == "zarr_store":  # zarr costs ~0.45 s to import; the CLI never needs it
        from .zarr_view import zarr_store

        return zarr_store
    raise AttributeError(f"module 'ckptstore' has no attribute {name!r}")


__all__ += ["CheckpointManager", "Retention", "RNGState", "zarr_store"]
