"""The commit seam of a save: how this process's blobs are written and the manifest committed.

One `Committer` per save; the repository calls, in this order:

1. `prepare_failed(name, error)` only if this process could not build its part of the save
   (a bad state, a name already taken). A committer whose save involves other processes
   tells them (so nobody waits forever or commits) and raises; one that does not returns,
   and the repository raises the original error.
   Before building the request, `known_chunks(parent)` may answer which chunks of the
   parent this process may reuse without reading the parent (a rank of a collective save
   remembers the chunks its part of the parent holds); None: the parent is read.
2. otherwise `commit(writer, request)`: write the blobs this process owns and commit the
   manifest, or take part in committing it. Returns the committed Manifest on the process
   that committed it, None on the others. Raises if nothing was committed.
3. `committed(info)` after a successful commit, outside the save's lease (retention runs
   here); its failure is reported as a warning, never as the save's error.

`LocalCommitter` is the single-process save; `training.distributed.CollectiveCommitter`
commits once for many ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ..format.leaf import ArrayLeaf
from ..format.manifest import Manifest
from .options import SaveInfo
from .writer import CheckpointWriter, KnownChunks


@dataclass(frozen=True)
class SaveRequest:
    """What one save commits, decided once before anything is written and passed down as it
    is: the encoded state of this process, where it goes, the chunks the store is known to
    hold (`known`: the parent's, reused without a request), the commit-order floor
    (`not_before`: the manifest's `created` is at least this) and the later tiers it is meant
    for (`targets`: recorded on tier 0 before the commit, tiers/pending.py)."""

    name: str
    tree: Any
    leaves: list[ArrayLeaf]
    metadata: dict[str, Any]
    parent: str | None
    manifest_key: str
    known: KnownChunks = field(default_factory=KnownChunks)
    not_before: float = 0.0
    targets: tuple[int, ...] = ()


class Committer(Protocol):
    """See the module docstring for the call order and contracts."""

    def prepare_failed(self, name: str, error: str) -> None: ...

    def known_chunks(self, parent: str) -> KnownChunks | None: ...

    def commit(self, writer: CheckpointWriter, request: SaveRequest) -> Manifest | None: ...

    def committed(self, info: SaveInfo) -> None: ...


class LocalCommitter:
    """A save by this process alone: write every blob, then commit."""

    def prepare_failed(self, name: str, error: str) -> None:
        """Nobody else to tell: the repository raises the original error."""

    def known_chunks(self, parent: str) -> KnownChunks | None:
        """Nothing remembered: the repository reads the parent."""
        return None

    def commit(self, writer: CheckpointWriter, request: SaveRequest) -> Manifest | None:
        return writer.write(request.name, request.tree, request.leaves, request.metadata,
                            request.parent, request.manifest_key)

    def committed(self, info: SaveInfo) -> None:
        """Nothing to do after the commit."""


LOCAL = LocalCommitter()
