"""Repositories of checkpoints: `CheckpointStore(uri)` for one location, `CheckpointStore([near,
far, ...])` for tiers (docs/recovery.md). Imports flow down this list only:

    marker.py    the repository marker (format version, hash algorithm)
    catalog.py   one store's manifests, commit order, latest
    handles.py   SaveHandle, LoadInfo, CheckpointInfo
    base.py      CheckpointStore: the constructor, and what every repository has (load from
                 the nearest good copy, "latest", listing in commit order, the save entry)
    single.py    SingleStore: a repository in one store (save, write, commit, maintenance)
    tiered.py    TieredStore: a list of SingleStores, the replicator, repair, the far-tier rule
"""

from ..errors import ReusedBlobsMissingError
from .base import LATEST, REPO_DEFAULT, CheckpointStore, Compression, LaterTiers
from .catalog import Catalog, ManifestProblem
from .handles import CheckpointInfo, LoadInfo, SaveHandle
from .marker import REPO_FORMAT, REPO_VERSION, check_marker
from .single import COMMIT_ORDER_STEP, SingleStore
from .tiered import TieredStore

__all__ = [
    "COMMIT_ORDER_STEP", "LATEST", "REPO_DEFAULT", "REPO_FORMAT", "REPO_VERSION", "Catalog",
    "CheckpointInfo", "CheckpointStore", "Compression", "LaterTiers", "LoadInfo",
    "ManifestProblem", "ReusedBlobsMissingError", "SaveHandle", "SingleStore", "TieredStore",
    "check_marker",
]  # fmt: skip
