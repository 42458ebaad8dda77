"""A tiered repository: a list of single-store repositories, nearest first, plus the
replicator that copies each checkpoint from tier 0 to the later tiers and the repair of a
nearer tier from a farther copy (docs/recovery.md).

Saves land on tier 0 (its SingleStore writes them); the reading methods take the union of
the tiers that can answer; `load` reads each chunk from the nearest good copy. The rule "with
a far tier unreachable, everything tier 0 can answer goes on" is decided in one place,
`_from_tiers`, and saves never ask a far tier anything (`_route`: what they are checked
against beyond tier 0 is what this store last saw of the later tiers).
"""

from __future__ import annotations

import builtins
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from ..errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    FormatError,
    ObjectNotFoundError,
    RepositoryNotFoundError,
    TierUnreachableError,
)
from ..format.manifest import BlobUnion, Manifest
from ..format.names import validate_name
from ..layout import blob_key
from ..maintenance import checks
from ..maintenance.transfer import fetch_verified
from ..pipeline.commit import Committer, SaveRequest
from ..pipeline.options import SaveInfo
from ..pipeline.writer import CheckpointWriter, KnownChunks
from ..redact import redact_uri
from ..stores import Store, open_store
from ..tiers import config as tier_config
from ..tiers import pending
from ..tiers.far import FarTier
from ..tiers.replication import Replicator, RetryPolicy
from .base import LATEST, CheckpointStore, LaterTiers, RepositoryURI, Route
from .catalog import ManifestProblem
from .marker import check_marker
from .single import SingleStore

T = TypeVar("T")
log = logging.getLogger("ckptstore")


class TieredStore(CheckpointStore, kind="tiered"):
    """Tiers of single-store repositories, nearest first (module docstring). Options are
    given once; each tier takes those that fit it (tiers/config.py)."""

    def __init__(self, uri: RepositoryURI, *, create: bool = True,
                 replicate: bool = True, replication_retry: RetryPolicy | None = None,
                 chunk_bytes: int | None = None, compression: Any = None,
                 workers: int | None = None, max_inflight_bytes: int | None = None,
                 hash: str | None = None, **options: Any) -> None:
        uris = tier_config.tier_uris(uri)
        tier_config.check_filled(uris)
        repo_options = {k: options.pop(k) for k in (
            "staging", "max_host_bytes", "async_writer", "background_workers",
            "background_io") if k in options}
        near = SingleStore(uris[0], create=create, chunk_bytes=chunk_bytes,
                           compression=compression, workers=workers,
                           max_inflight_bytes=max_inflight_bytes, hash=hash, **repo_options,
                           **tier_config.options_for(uris[0], options))
        common = dict(chunk_bytes=chunk_bytes, compression=compression, workers=workers,
                      max_inflight_bytes=max_inflight_bytes, hash=near.hash.name)
        opened: builtins.list[CheckpointStore] = [near]
        try:
            for u in uris[1:]:
                opts = tier_config.options_for(u, options)
                if not create and not isinstance(u, Store) and not str(u).startswith(
                        "memory://"):
                    opts.setdefault("create", False)
                far = self._far_tier(u, opts, create, near)
                if not far.open_now():
                    log.warning("tier %s is unreachable; saves and restores go on with the "
                                "nearer tiers, replication retries it", far.uri)
                opened.append(SingleStore(far, **common))
        except BaseException:
            for t in opened:
                t.close()
            raise
        self.near = near
        self.tiers = opened
        for i, tier in enumerate(opened):  # an index segment bad on a tier: the later ones
            if isinstance(tier, SingleStore):
                tier.catalog.segment_fallbacks = [t.store for t in opened[i + 1:]]
        self.store = near.store
        self.uri = near.uri
        self.save_options = near.save_options
        self.load_options = near.load_options
        self.staging_defaults = near.staging_defaults
        self.last_load = None
        self._replicator: Replicator | None = None
        if replicate:
            self._replicator = Replicator(
                [t.store for t in opened], self.hash, retry=replication_retry,
                workers=self.save_options.workers,
                max_inflight_bytes=self.save_options.max_inflight_bytes,
                on_replicated=lambda name, tier, created: opened[tier].note_committed(
                    name, created))
            self._replicator.resume()

    @staticmethod
    def _far_tier(uri: tier_config.TierURI, options: dict[str, Any], create: bool,
                  near: SingleStore) -> FarTier:
        def check(store: Store) -> None:
            found = check_marker(store, create, near.hash)
            if found.name != near.hash.name:
                raise FormatError(f"repository {store.uri} names chunks with {found.name}, "
                                  f"not {near.hash.name} like tier 0")

        def opener() -> Store:
            try:
                return open_store(uri, **options)
            except ObjectNotFoundError:
                raise RepositoryNotFoundError(f"no ckptstore repository at {uri}") from None

        shown = uri.uri if isinstance(uri, Store) else redact_uri(uri)
        return FarTier(shown, opener, check)

    # tier 0's save machinery, as tests and tools reach it
    @property
    def _arena(self) -> Any:
        return self.near._arena

    @property
    def _pool(self) -> Any:
        return self.near._pool

    # ------------------------------------------------------------------ the far-tier rule
    def _from_tiers(self, ask: Callable[[CheckpointStore], T]) -> builtins.list[T]:
        """`ask(tier)` of every tier that can answer now, nearest first: a later tier that
        is down, or fails with TierUnreachableError now, is skipped (logged once per
        outage). Tier 0's errors are raised. The one place where "with a far tier
        unreachable, everything tier 0 can answer goes on" is decided for reads."""
        out = []
        for i, tier in enumerate(self.tiers):
            if i and not tier.reachable:
                continue
            try:
                out.append(ask(tier))
            except TierUnreachableError as exc:
                if not i:
                    raise
                log.warning("%s; going on with the nearer tiers", exc)
        return out

    # ------------------------------------------------------------------ catalog
    def _manifest_of(self, name: str, *, cache: bool = True) -> Manifest:
        """The manifest from the nearest tier with a readable one (an unreadable near copy
        is logged and skipped)."""
        damaged: FormatError | None = None
        down: builtins.list[str] = []
        for i, tier in enumerate(self.tiers):
            try:
                if i and not tier.reachable:
                    raise TierUnreachableError(f"tier {tier.uri} is unreachable")
                return tier._manifest_of(name, cache=cache)
            except CheckpointNotFoundError:
                continue
            except TierUnreachableError as exc:
                if not i:
                    raise
                down.append(str(exc))
            except FormatError as exc:
                log.warning("%s; reading it from the next tier", exc)
                damaged = damaged or exc
        if damaged is not None:
            raise damaged
        if down:
            raise TierUnreachableError(f"checkpoint {name!r} is not on the tiers of {self.uri} "
                                       f"that can be reached now ({'; '.join(down)})")
        raise CheckpointNotFoundError(f"no checkpoint {name!r} on any tier of {self.uri}")

    def names(self) -> builtins.list[str]:
        return list(dict.fromkeys(n for names in self._from_tiers(lambda t: t.names())
                                  for n in names))

    def created_times(self) -> dict[str, float]:
        seen: dict[str, float] = {}
        for times in self._from_tiers(lambda t: t.created_times()):
            for name, c in times.items():
                seen.setdefault(name, c)
        return seen

    def exists(self, name: str) -> bool:
        return self.near.exists(name) or any(self._from_tiers(
            lambda t: t is not self.near and t.exists(name)))

    def problems(self) -> builtins.list[ManifestProblem]:
        return [ManifestProblem(p.key, f"{uri}: {p.reason}") for uri, found in
                self._from_tiers(lambda t: (t.uri, t.problems())) for p in found]

    def known_created(self) -> dict[str, float]:
        seen: dict[str, float] = {}
        for tier in self.tiers:
            for name, c in tier.known_created().items():
                seen.setdefault(name, c)
        return seen

    # ------------------------------------------------------------------ save
    def _route(self, tiers: Iterable[int] | None, committer: Committer) -> Route:
        """Saves land on tier 0; they are checked against what this store last saw of the
        later tiers (never a request to them), and replicated to `tiers` once committed."""
        targets = self._targets(tiers)
        seen = [t.known_created() for t in self.tiers[1:]]
        later = LaterTiers(taken=frozenset(n for s in seen for n in s),
                           newest=max((c for s in seen for c in s.values()), default=None),
                           targets=targets)
        if targets and self._replicator is not None:
            committer = _Replicating(committer, self._replicator, targets)
        return Route(self.near, committer, later)

    def _targets(self, tiers: Iterable[int] | None) -> tuple[int, ...]:
        """The later tiers a save is meant for (`tiers=None`: all); checked before saving."""
        if tiers is None:
            return tuple(range(1, len(self.tiers)))
        chosen = set(tiers)
        bad = [t for t in chosen if type(t) is not int or not 0 <= t < len(self.tiers)]
        if bad:
            raise ValueError(f"tiers must be in 0..{len(self.tiers) - 1}, got {bad}")
        return tuple(sorted(chosen - {0}))

    def wait(self) -> None:
        self.near.wait()

    # ------------------------------------------------------------------ load repair
    def _repair(self, blob: str, good: int, bad: builtins.list[int],
                repaired: builtins.list[str]) -> None:
        """Rewrite `blob` on tiers `bad` (which hold the checkpoint but lack a good copy)
        from tier `good`, verified; a failed repair is a warning, never the load's error."""
        if not bad:
            return
        try:
            data = fetch_verified(blob, [self.tiers[good].store], self.hash)
            for i in bad:
                store = self.tiers[i].store
                store.put(blob_key(blob), data)
                store.sync()
            repaired.append(blob)
            warnings.warn(f"blob {blob} was missing or corrupt in "
                          f"{', '.join(self.tiers[i].uri for i in bad)}; read from "
                          f"{self.tiers[good].uri} and rewritten there", RuntimeWarning,
                          stacklevel=2)
        except CkptStoreError as exc:
            warnings.warn(f"blob {blob} was missing or corrupt in "
                          f"{', '.join(self.tiers[i].uri for i in bad)} and read from "
                          f"{self.tiers[good].uri}, but rewriting it failed: {exc}",
                          RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------ maintenance
    def delete(self, name: str, *, tier: int | None = None) -> None:
        if tier is not None and not 0 <= tier < len(self.tiers):
            raise ValueError(f"tier must be in 0..{len(self.tiers) - 1}, got {tier!r}")
        validate_name(name)
        if self._replicator is not None:
            self._replicator.cancel(name)
        chosen = range(len(self.tiers)) if tier is None else [tier]
        try:
            holders = [i for i in chosen if self.tiers[i].exists(name)]
        except TierUnreachableError as exc:
            raise TierUnreachableError(f"{exc}; nothing was deleted (delete(name, tier=0) "
                                       "removes the tier-0 copy alone)") from exc
        if not holders:
            where = "any tier of " if tier is None else f"tier {tier} of "
            raise CheckpointNotFoundError(f"no checkpoint {name!r} on {where}{self.uri}")
        if tier is None or tier == 0:
            pending.clear_record(self.store, name)  # nothing left to replicate from
        else:
            pending.drop_tier(self.store, name, tier)
        for i in holders:
            self.tiers[i].delete(name)

    def verify(self, name: str = LATEST, *, sample: float = 1.0,
               tier: int | None = None) -> checks.VerifyReport:
        if tier is not None and not 0 <= tier < len(self.tiers):
            raise ValueError(f"tier must be in 0..{len(self.tiers) - 1}, got {tier!r}")
        if name == LATEST:
            name = self.manifest(name).name
        chosen: CheckpointStore | None
        if tier is None:  # the nearest holder: tier 0 answers without the far tiers
            chosen = self.near if self.near.exists(name) else next(
                (t for t in self._from_tiers(lambda t: t if t is not self.near
                                             and t.exists(name) else None) if t), None)
        else:
            chosen = self.tiers[tier] if self.tiers[tier].exists(name) else None
        if chosen is None:
            where = "any tier" if tier is None else f"tier {tier}"
            raise CheckpointNotFoundError(f"no checkpoint {name!r} on {where} of {self.uri}")
        return chosen.verify(name, sample=sample)

    def referenced_blobs(self) -> set[str]:
        union = BlobUnion()  # each index segment read once

        def manifests() -> Iterator[Manifest]:
            for name in self.names():
                try:  # two parsed manifests at a time (add_each): not cached
                    manifest = self._manifest_of(name, cache=False)
                except CheckpointNotFoundError:
                    continue
                yield manifest

        try:
            union.add_each(manifests())
        except CkptStoreError as exc:
            raise CkptStoreError(f"gc stopped, nothing deleted: {exc}") from exc
        return union.blobs

    def gc(self, grace_seconds: float = 3600.0, dry_run: bool = False, *, wait: float = 0.0,
           now: float | None = None) -> checks.GcReport:
        reports = [t.gc(grace_seconds, dry_run, wait=wait, now=now) for t in self.tiers]
        return checks.GcReport(
            dry_run=dry_run,
            referenced_blobs=sum(r.referenced_blobs for r in reports),
            deleted_blobs=sum(r.deleted_blobs for r in reports),
            freed_bytes=sum(r.freed_bytes for r in reports),
            kept_young_blobs=sum(r.kept_young_blobs for r in reports),
            deleted_temp_files=sum(r.deleted_temp_files for r in reports),
            seconds=sum(r.seconds for r in reports),
            deleted=[f"{t.uri}/{k}" for t, r in zip(self.tiers, reports) for k in r.deleted],
            min_age_seconds=max(r.min_age_seconds for r in reports),
            removed_stale_leases=sum(r.removed_stale_leases for r in reports))

    # ------------------------------------------------------------------ replication
    def wait_replicated(self, timeout: float | None = None) -> None:
        self.wait()
        if self._replicator is not None:
            self._replicator.wait(timeout)

    def replicate_pending(self) -> builtins.list[str]:
        return [] if self._replicator is None else self._replicator.resume()

    def replicating(self) -> builtins.list[str]:
        return [] if self._replicator is None else self._replicator.pending()

    def forget_replication(self, name: str, tier: int) -> None:
        pending.drop_tier(self.store, name, tier)
        if self._replicator is not None and not pending.has_record(self.store, name):
            self._replicator.discard(name)

    def replication_pending(self, name: str) -> bool:
        return pending.has_record(self.store, name)

    # ------------------------------------------------------------------ lifecycle
    def close(self, *, wait_replication: bool = True) -> None:
        """Wait for any save in flight and (unless told not to) for replication, then release
        the stores. Replication left unfinished resumes on the next open. Raises the error of
        a save or replication nobody has seen, after releasing."""
        try:
            self.wait()
        finally:
            try:
                if self._replicator is not None:
                    self._replicator.close(wait=wait_replication)
            finally:
                for tier in self.tiers:
                    tier.close()


class _Replicating:
    """A committer whose commit is followed by queueing the checkpoint's replication to the
    later tiers it is meant for, then by what the inner committer runs after a commit."""

    def __init__(self, inner: Committer, replicator: Replicator,
                 targets: tuple[int, ...]) -> None:
        self.inner = inner
        self.replicator = replicator
        self.targets = targets

    def prepare_failed(self, name: str, error: str) -> None:
        self.inner.prepare_failed(name, error)

    def known_chunks(self, parent: str) -> KnownChunks | None:
        return self.inner.known_chunks(parent)

    def commit(self, writer: CheckpointWriter, request: SaveRequest) -> Manifest | None:
        return self.inner.commit(writer, request)

    def committed(self, info: SaveInfo) -> None:
        self.replicator.submit(info.name, self.targets)
        self.inner.committed(info)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # e.g. CollectiveCommitter.joined
