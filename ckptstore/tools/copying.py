"""Copy checkpoints between repositories (local <-> S3, or any two stores): `ckpt cp`.

`copy_checkpoints` is the copy protocol of maintenance/transfer.py (the one replication uses
too) with `repair`: every blob of every named checkpoint is checked in the destination,
including those whose manifest is already there, so deleting a bad blob from the
destination and copying again repairs it. Blobs the destination has are trusted, not
re-read; every blob read from the source is re-hashed before it is written; a name present
in the destination with other bytes is an error raised before anything is sent; the
destination never lists a checkpoint it cannot restore. Memory: at most
`max_inflight_bytes` of blob data (plus one oversized blob) held at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import CheckpointNotFoundError, FormatError
from ..maintenance.transfer import transfer
from ..repository import CheckpointStore

MiB = 1 << 20


@dataclass
class CopyReport:
    """What a copy did. Byte counts are stored bytes."""

    copied: list[str] = field(default_factory=list)  # checkpoints committed in the destination
    skipped: list[str] = field(default_factory=list)  # already there, identical
    blobs_needed: int = 0
    blobs_present: int = 0  # needed but already in the destination
    blobs_sent: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0


def resolve_names(repo: CheckpointStore, names: Iterable[str]) -> list[str]:
    """Names with 'latest' resolved, duplicates removed, each checked to exist (raises
    CheckpointNotFoundError naming the first missing one)."""
    out: list[str] = []
    for name in names:
        real = repo.manifest(name).name  # also validates the name and the manifest
        if real not in out:
            out.append(real)
    return out


def copy_checkpoints(src: CheckpointStore, dst: CheckpointStore, names: Iterable[str], *,
                     workers: int = 8, max_inflight_bytes: int = 256 * MiB,
                     progress: Callable[[int], None] | None = None,
                     on_total: Callable[[int], None] | None = None,
                     lease_wait: float | None = None) -> CopyReport:
    """Copy checkpoints `names` from `src` to `dst` (see the module contract). `progress` is
    called with the stored bytes of each blob sent; `on_total` once with the bytes to send."""
    if src.hash != dst.hash:
        raise FormatError(f"{src.uri} names chunks with {src.hash.name} and {dst.uri} with "
                          f"{dst.hash.name}: checkpoints cannot be copied between them as they "
                          "are (load and save instead); nothing copied")
    wanted = resolve_names(src, names)
    done = transfer(wanted, [src.store], dst.store, src.hash, repair=True, workers=workers,
                    max_inflight_bytes=max_inflight_bytes, progress=progress,
                    on_total=on_total, lease_wait=lease_wait)
    if done.gone:
        raise CheckpointNotFoundError(f"checkpoint {done.gone[0]!r} was deleted from "
                                      f"{src.uri} during the copy; nothing of it copied")
    return CopyReport(copied=done.copied, skipped=done.skipped,
                      blobs_needed=done.blobs_needed, blobs_present=done.blobs_present,
                      blobs_sent=done.blobs_sent, bytes_sent=done.bytes_sent,
                      seconds=done.seconds)
