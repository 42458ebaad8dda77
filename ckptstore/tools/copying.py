"""Copy checkpoints between repositories (local <-> S3, or any two stores).

Contract of `copy_checkpoints`:
* Only blobs the destination lacks are sent (one listing of the destination's `blobs/`),
  for every named checkpoint, including those whose manifest is already there: deleting a
  bad blob from the destination and copying again repairs it. Blobs the destination has are
  trusted, not re-read.
* Every blob read from the source is re-hashed and compared with its name before it is
  written; a mismatch (or a missing source blob) stops the copy before any manifest is
  committed, so the destination never lists a checkpoint it cannot restore.
* Order per destination: blobs, `store.sync()`, then each manifest with a create-only write of
  the source manifest's exact bytes (so `verify`/`diff` see the same digests). A name present
  in the destination with identical bytes is skipped; with other bytes it is an error, raised
  before anything is sent.
* The copy holds a save lease on the destination (see `leases`), so a `ckpt gc` there cannot
  delete the blobs it sends before their manifest is committed.
* Memory: at most `max_inflight_bytes` of blob data (plus one oversized blob) held at once.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..concurrency import completed
from ..errors import (
    CheckpointExistsError,
    FormatError,
    IntegrityError,
    ObjectExistsError,
    ObjectNotFoundError,
)
from ..format.manifest import Manifest
from ..format.manifest_parse import parse_manifest
from ..layout import BLOB_PREFIX, blob_key, blob_of_key, manifest_key
from ..maintenance import leases
from ..pipeline.budget import ByteBudget
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


def _listed_blobs(repo: CheckpointStore) -> set[str]:
    return {name for info in repo.store.list(BLOB_PREFIX)
            if (name := blob_of_key(info.key)) is not None}


def copy_checkpoints(src: CheckpointStore, dst: CheckpointStore, names: Iterable[str], *,
                     workers: int = 8, max_inflight_bytes: int = 256 * MiB,
                     progress: Callable[[int], None] | None = None,
                     on_total: Callable[[int], None] | None = None,
                     lease_wait: float | None = None) -> CopyReport:
    """Copy checkpoints `names` from `src` to `dst` (see the module contract). `progress` is
    called with the stored bytes of each blob sent; `on_total` once with the bytes to send."""
    t0 = time.perf_counter()
    report = CopyReport()
    if src.hash != dst.hash:
        raise FormatError(f"{src.uri} names chunks with {src.hash.name} and {dst.uri} with "
                          f"{dst.hash.name}: checkpoints cannot be copied between them as they "
                          "are (load and save instead); nothing copied")
    wanted = resolve_names(src, names)
    raw: dict[str, bytes] = {}
    manifests: dict[str, Manifest] = {}
    for name in wanted:
        data = src.store.get(manifest_key(name))
        manifests[name] = parse_manifest(data, name, src.save_options.hash)
        raw[name] = data
        try:
            existing = dst.store.get(manifest_key(name))
        except ObjectNotFoundError:
            continue
        if existing != data:
            raise CheckpointExistsError(
                f"checkpoint {name!r} exists in {dst.uri} with other content; nothing copied")
        report.skipped.append(name)
    todo = [n for n in wanted if n not in report.skipped]

    with leases.save_lease(dst.store, wait=lease_wait) as lease:
        sizes: dict[str, int] = {}
        for n in wanted:  # skipped ones too: a blob deleted from DST is sent again (repair)
            for t in manifests[n].tensors:
                for c in t.chunks:
                    sizes[c.blob] = max(sizes.get(c.blob, 0), c.offset + c.size)
        present = _listed_blobs(dst)
        missing = sorted(b for b in sizes if b not in present)
        report.blobs_needed = len(sizes)
        report.blobs_present = len(sizes) - len(missing)
        if on_total is not None:
            on_total(sum(sizes[b] for b in missing))
        budget = ByteBudget(max_inflight_bytes)

        def send(blob: str) -> int:
            with budget.hold(sizes[blob]):
                try:
                    data = src.store.get(blob_key(blob))
                except ObjectNotFoundError:
                    raise IntegrityError(f"blob {blob} is missing from {src.uri}; nothing "
                                         "committed in the destination") from None
                if src.save_options.hash.digest(data) != blob:
                    raise IntegrityError(f"blob {blob} in {src.uri} is corrupt (content does "
                                         "not match its digest); nothing committed in the "
                                         "destination")
                dst.store.put(blob_key(blob), data)
            if progress is not None:
                progress(sizes[blob])  # the unit `on_total` counted: the bar ends at 100%
            return len(data)

        with cf.ThreadPoolExecutor(workers, thread_name_prefix="ckpt-cp") as pool:
            for fut in completed(pool.submit(send, b) for b in missing):
                report.bytes_sent += fut.result()
                report.blobs_sent += 1
        dst.store.sync()  # every blob durable before any manifest exists
        for name in todo:
            lease.check()
            try:
                dst.store.create(manifest_key(name), raw[name])
            except ObjectExistsError:
                raise CheckpointExistsError(
                    f"checkpoint {name!r} appeared in {dst.uri} with other content during the "
                    "copy; it was not touched") from None
            report.copied.append(name)
    report.seconds = time.perf_counter() - t0
    return report

