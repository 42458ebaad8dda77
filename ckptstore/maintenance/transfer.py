"""Copying checkpoints into a store: the one protocol behind `ckpt cp` (tools/copying.py) and
replication to later tiers (tiers/replication.py).

Contract of `transfer(names, sources, dst, algorithm)` (idempotent, resumable; a kill at any
instant leaves `dst` listing only whole checkpoints):

1. Each manifest is read from the nearest of `sources` holding a readable one (a name no
   source holds any more is reported in `gone`).
2. A save lease is taken on `dst` (a gc there waits, maintenance/leases.py).
3. A name `dst` holds already: identical bytes -> skipped (nothing to commit); other bytes ->
   CheckpointExistsError before anything is sent (never overwritten).
4. The blobs `dst` lacks are found: those of a manifest committed on `dst` (the parent) are
   known present, unless `repair` (then every blob is checked, the skipped checkpoints'
   too, so that copying again restores a blob deleted from `dst`); the rest are asked with
   one listing of `dst`'s blobs when there are many (more than LIST_ABOVE), else one
   `exists` each.
5. Each missing blob is read from the nearest source holding a good copy, re-hashed and
   compared with its name (IntegrityError when no source has one: nothing committed), and
   written; at most `max_inflight_bytes` held at once. If a gc may have swept `dst`
   meanwhile (its sweep marker changed), the blobs assumed present are asked again and any
   gone are sent too, as a save confirms what it reuses.
6. `dst.sync()` (every blob durable), then each manifest is created create-only with the
   source's exact bytes: `dst` never lists a checkpoint whose chunks it lacks. Right before
   that, a source must still hold those bytes: a checkpoint deleted from every tier while
   its copy was under way goes into `gone` instead of coming back on `dst`.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ..concurrency import completed
from ..errors import (
    CheckpointExistsError,
    FormatError,
    IntegrityError,
    ObjectExistsError,
    ObjectNotFoundError,
)
from ..format.hashing import HashAlgorithm
from ..format.manifest import Manifest
from ..format.manifest_parse import parse_manifest
from ..layout import BLOB_PREFIX, blob_key, blob_of_key, manifest_key, segments_in
from ..pipeline.budget import ByteBudget
from ..pipeline.options import METADATA_THREADS
from ..stores.base import Store
from . import leases

MiB = 1 << 20
#: ask presence with one listing of dst's blobs when more blobs than this are in question
LIST_ABOVE = 256
Progress = Callable[[int], None]


@dataclass
class TransferResult:
    """What one transfer did. Byte counts are stored bytes."""

    copied: list[str] = field(default_factory=list)  # manifests committed in dst
    skipped: list[str] = field(default_factory=list)  # already there, identical
    gone: list[str] = field(default_factory=list)  # held by no source any more
    created: dict[str, float] = field(default_factory=dict)  # the manifests' `created`
    blobs_needed: int = 0
    blobs_present: int = 0  # needed but already in dst
    blobs_sent: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0


def read_manifest(sources: Sequence[Store], name: str, algorithm: HashAlgorithm
                  ) -> tuple[bytes, Manifest] | None:
    """The exact bytes and parse of `name`'s manifest from the nearest source holding a
    readable one, or None if none holds it (a damaged copy is passed over; FormatError if
    every copy is damaged)."""
    damaged: FormatError | None = None
    for i, store in enumerate(sources):
        try:
            raw = store.get(manifest_key(name))
            return raw, parse_manifest(raw, name, algorithm, segments_in(sources[i:], algorithm))
        except ObjectNotFoundError:
            continue
        except FormatError as exc:
            damaged = damaged or exc
    if damaged is not None:
        raise damaged
    return None


def fetch_verified(blob: str, sources: Sequence[Store], algorithm: HashAlgorithm) -> bytes:
    """The bytes of `blob` from the nearest source whose copy matches its digest."""
    problems = []
    for store in sources:
        try:
            data = store.get(blob_key(blob))
        except ObjectNotFoundError:
            problems.append(f"missing from {store.uri}")
            continue
        if algorithm.digest(data) == blob:
            return data
        problems.append(f"corrupt in {store.uri} (content does not match its digest)")
    raise IntegrityError(f"blob {blob} has no good copy: {'; '.join(problems)}; nothing "
                         "committed in the destination")


def transfer(names: Iterable[str], sources: Sequence[Store], dst: Store,
             algorithm: HashAlgorithm, *, repair: bool = False, workers: int = 8,
             max_inflight_bytes: int = 256 * MiB, progress: Progress | None = None,
             on_total: Progress | None = None, lease_wait: float | None = None
             ) -> TransferResult:
    """Copy checkpoints `names` from `sources` (nearest first) into `dst` (module contract).
    `progress` is called with the stored bytes of each blob sent; `on_total` once with the
    bytes to send."""
    t0 = time.perf_counter()
    result = TransferResult()
    found: dict[str, tuple[bytes, Manifest]] = {}
    for name in dict.fromkeys(names):
        got = read_manifest(sources, name, algorithm)
        if got is None:
            result.gone.append(name)
        else:
            found[name] = got
            result.created[name] = got[1].created
    if not found:
        result.seconds = time.perf_counter() - t0
        return result
    with leases.save_lease(dst, wait=lease_wait) as lease:
        for name, (raw, _m) in found.items():
            try:
                existing = dst.get(manifest_key(name))
            except ObjectNotFoundError:
                continue
            if existing != raw:
                raise CheckpointExistsError(f"checkpoint {name!r} exists in {dst.uri} with "
                                            "other content; it was not touched, nothing "
                                            "copied")
            result.skipped.append(name)
        todo = [n for n in found if n not in result.skipped]
        sizes: dict[str, int] = {}
        for name in (found if repair else todo):
            for blob, extent in found[name][1].blob_extents().items():
                sizes[blob] = max(sizes.get(blob, 0), extent)
        known = set() if repair else _committed_blobs(dst, [found[n][1] for n in todo],
                                                      algorithm)
        ask = sorted(b for b in sizes if b not in known)
        with cf.ThreadPoolExecutor(workers, thread_name_prefix="ckpt-transfer") as pool:
            missing = _missing(dst, ask, pool)
            result.blobs_needed = len(sizes)
            result.blobs_present = len(sizes) - len(missing)
            if on_total is not None:
                on_total(sum(sizes[b] for b in missing))
            budget = ByteBudget(max_inflight_bytes)

            def send(blob: str) -> int:
                with budget.hold(sizes[blob]):
                    data = fetch_verified(blob, sources, algorithm)
                    dst.put(blob_key(blob), data)
                if progress is not None:
                    progress(sizes[blob])  # the unit `on_total` counted: the bar ends at 100%
                return len(data)

            def send_all(blobs: list[str]) -> None:
                for fut in completed(pool.submit(send, b) for b in blobs):
                    result.bytes_sent += fut.result()
                    result.blobs_sent += 1

            send_all(missing)
            if lease.sweep_may_have_run():  # belt and braces, as a save does (leases.py)
                assumed = sorted(set(sizes) - set(missing))
                send_all(_missing(dst, assumed, pool, listing=False))
        dst.sync()  # every blob durable before any manifest exists
        for name in todo:
            lease.check()
            if not _still_held(sources, name, found[name][0]):
                result.gone.append(name)  # deleted meanwhile: it must not come back here
                continue
            try:
                dst.create(manifest_key(name), found[name][0])
            except ObjectExistsError:
                raise CheckpointExistsError(f"checkpoint {name!r} appeared in {dst.uri} with "
                                            "other content during the copy; it was not "
                                            "touched") from None
            result.copied.append(name)
    result.seconds = time.perf_counter() - t0
    return result


def _still_held(sources: Sequence[Store], name: str, raw: bytes) -> bool:
    """Whether a source still holds the manifest `raw` of `name` (checked right before the
    destination's copy is created: a checkpoint deleted from every tier while its copy was
    under way is not committed again; a delete that lands between this check and the
    create can still be undone by it)."""
    for store in sources:
        try:
            if store.get(manifest_key(name)) == raw:
                return True
        except ObjectNotFoundError:
            continue
    return False


def _committed_blobs(dst: Store, manifests: list[Manifest], algorithm: HashAlgorithm
                     ) -> set[str]:
    """Blobs of the parents of `manifests` that `dst` has committed: present there (a
    committed manifest's blobs all are)."""
    known: set[str] = set()
    for parent in {m.parent for m in manifests if m.parent is not None}:
        try:
            got = read_manifest([dst], parent, algorithm)
        except FormatError:
            continue  # unreadable there: trust nothing of it
        if got is not None:
            known |= got[1].blob_digests()
    return known


def _missing(dst: Store, blobs: list[str], pool: cf.ThreadPoolExecutor,
             listing: bool | None = None) -> list[str]:
    """The blobs of `blobs` that `dst` lacks: one listing when there are many (or
    `listing`), else one `exists` each (on the pool)."""
    if not blobs:
        return []
    if listing if listing is not None else len(blobs) > LIST_ABOVE:
        present = {b for info in dst.list(BLOB_PREFIX) if (b := blob_of_key(info.key))}
        return [b for b in blobs if b not in present]
    found = list(pool.map(lambda b: dst.exists(blob_key(b)), blobs))
    return [b for b, ok in zip(blobs, found) if not ok]


__all__ = ["LIST_ABOVE", "METADATA_THREADS", "TransferResult",
           "fetch_verified", "read_manifest", "transfer"]
