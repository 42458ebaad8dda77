"""ckptstore: a sharded, content-addressed checkpoint store for PyTorch.

Where things are (each folder's `__init__` says more; imports flow down this list only):

    errors.py        the error model
    format/          what is stored: canonical JSON, hashing, names, dtypes, codecs, tree, manifest
    layout.py        where it is stored: every key prefix and key <-> name mapping
    stores/          the object stores: local folder, memory, S3; `testing`, the contract suite
    pipeline/        moving bytes: the save and restore pipelines under a memory budget
    maintenance/     verify, gc, the leases that keep saves and gc apart, the copy protocol
    tiers/           tiered repositories: tier list, far tiers, replication, pending records
    repository/      CheckpointStore: one store (single.py) or tiers of them (tiered.py)
    tools/           copying, inspection, import/export, the zarr view
    training/        CheckpointManager, torch.distributed, peers, RNG state, integrations
    dcp/             a torch.distributed.checkpoint storage backend: DCP saves into a repository
    healing/         live healing: a replica's state served chunk by chunk, fetched verified
    cli/             the `ckpt` command

Beside the list, at the top like this module: `toolkit.py`, the stable building blocks other
packages (the dataloader) import, re-exported from the layers above; and the documented
import paths of the integrations (`lightning.py`, `accelerate.py`, `torchtitan.py`,
`torchft.py`).
"""

from __future__ import annotations

from typing import Any

from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptStoreError,
    CollectiveError,
    DeviceCopyError,
    DurabilityError,
    ExportWarning,
    FormatError,
    IntegrityError,
    InvalidNameError,
    KeyMismatchError,
    LeaseBusyError,
    MissingDependencyError,
    ObjectExistsError,
    ObjectNotFoundError,
    PeerExchangeError,
    ReplicationError,
    RepositoryNotFoundError,
    ReusedBlobsMissingError,
    SourceChangedError,
    StoreAccessError,
    StoreError,
    TierUnreachableError,
    TrustRequiredError,
    UnrestorableCheckpointError,
    UnsupportedTypeError,
)
from .format.codecs import Codec
from .format.shard import Shard
from .maintenance.checks import GcReport, VerifyReport
from .pipeline.options import SaveInfo
from .repository import CheckpointInfo, CheckpointStore, SaveHandle
from .stores import LocalStore, MemoryStore, ObjectInfo, Store, open_store
from .training.retention import Retention
from .training.rng import RNGState
from .version import __version__

__all__ = [
    "CheckpointExistsError", "CheckpointInfo", "CheckpointManager", "CheckpointNotFoundError",
    "CheckpointStore", "CkptStoreError", "Codec", "CollectiveError", "DeviceCopyError",
    "DurabilityError",
    "ExportWarning",
    "FormatError", "GcReport",
    "IntegrityError", "InvalidNameError", "KeyMismatchError", "LeaseBusyError", "LocalStore",
    "MemoryStore",
    "MissingDependencyError",
    "ObjectExistsError", "ObjectInfo", "ObjectNotFoundError", "PeerExchangeError", "RNGState",
    "ReplicationError", "RepositoryNotFoundError", "Retention", "ReusedBlobsMissingError",
    "SaveHandle", "SaveInfo", "Shard",
    "SourceChangedError", "Store",
    "StoreAccessError", "StoreError", "TierUnreachableError", "TrustRequiredError",
    "UnrestorableCheckpointError", "UnsupportedTypeError",
    "VerifyReport", "__version__",
    "open_store", "zarr_store",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    """Names whose modules are costly to import, loaded on first use: CheckpointManager
    imports torch; zarr_store imports zarr (~0.45 s, which the CLI never needs)."""
    if name == "CheckpointManager":
        from .training.manager import CheckpointManager

        return CheckpointManager
    if name == "zarr_store":
        from .tools.zarr_view import zarr_store

        return zarr_store
    raise AttributeError(f"module 'ckptstore' has no attribute {name!r}")
