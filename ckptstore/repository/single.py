"""A repository in one store (a folder, an S3 prefix, memory): the catalog of its manifests,
the save (prepare, write, commit) and maintenance. A tiered repository is a list of these.

Layout (docs/format.md): `ckptstore.json` marker, `blobs/ab/<digest>` immutable chunks,
`checkpoints/<name>.json` manifests. A manifest is created once, after all its blobs are
durable, and never overwritten: a checkpoint is whole or invisible.

The save flows one way: `save`/`save_async` (base.py) -> `_prepare` builds the typed
SaveRequest (names and commit order checked, state encoded, known chunks of the parent,
the commit-order floor, the later tiers it is meant for) -> staging (copy or overlap) ->
`_write`: a CheckpointWriter built once from the request -> the Committer commits ->
`committed(info)` (retention; a tiered store's replication).

Why one module: one class, whose save steps (prepare, stage, write, commit, retry) share its
lease, arena and catalog.
"""

from __future__ import annotations

import builtins
import concurrent.futures as cf
import json
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

from ..collector import paused_collector, quiet_collector
from ..concurrency import Turns
from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptStoreError,
    FormatError,
    ObjectNotFoundError,
    RepositoryNotFoundError,
    ReusedBlobsMissingError,
    TierUnreachableError,
    UnsupportedTypeError,
)
from ..format.canonical import canonical_json
from ..format.codecs import Codec, codec_option
from ..format.hashing import HASH_NAME, hash_algorithm
from ..format.manifest import BlobUnion, Manifest
from ..format.manifest_parse import committed_manifest
from ..format.names import validate_name
from ..format.tree import TreeEncoder, flatten_arrays
from ..layout import manifest_key, missing_blobs
from ..maintenance import checks, leases
from ..pipeline.commit import Committer, LocalCommitter, SaveRequest
from ..pipeline.options import (
    METADATA_THREADS,
    LoadOptions,
    SaveInfo,
    SaveOptions,
    Staging,
)
from ..pipeline.overlap import (
    Guard,
    Overlap,
    StagingPool,
    check_async_writer,
    staging_pool,
)
from ..pipeline.staging import StagingArena
from ..pipeline.writer import CheckpointWriter, KnownChunks, background_turns
from ..stores import Store, open_store
from ..tiers import config as tier_config
from ..tiers import pending
from ..tiers.far import FarTier
from .base import (
    LATEST,
    REPO_DEFAULT,
    CheckpointStore,
    Compression,
    Route,
    SaveCall,
    _Default,
)
from .catalog import Catalog, ManifestProblem, find
from .handles import LoadInfo, SaveHandle
from .marker import check_marker

#: A save's manifest is created at least this long after the newest checkpoint it saw.
COMMIT_ORDER_STEP = 1e-3
log = logging.getLogger("ckptstore")

__all__ = ["COMMIT_ORDER_STEP", "LATEST", "REPO_DEFAULT", "SingleStore"]


class SingleStore(CheckpointStore, kind="single"):
    """A repository in one store (module docstring); see CheckpointStore for the options."""

    def __init__(self, uri: Any, *, create: bool = True, chunk_bytes: int | None = None,
                 compression: str | Codec | None = None, workers: int | None = None,
                 max_inflight_bytes: int | None = None, hash: str | None = None,
                 staging: str = "copy", max_host_bytes: int | None = None,
                 replicate: bool = True, replication_retry: Any = None,
                 async_writer: str = "auto", background_workers: int = 1,
                 background_io: int = 0, **store_options: Any) -> None:
        self.staging_defaults = Staging(staging, max_host_bytes)
        [uri] = tier_config.tier_uris(uri)
        tier_config.check_filled([uri])
        if not isinstance(uri, Store) and not create and not str(uri).startswith("memory://"):
            store_options.setdefault("create", False)  # a typo must not make a folder/bucket
        try:
            self.store = open_store(uri, **store_options) if not isinstance(uri, Store) else uri
        except ObjectNotFoundError:
            raise RepositoryNotFoundError(f"no ckptstore repository at {uri}") from None
        self.uri = self.store.uri
        defaults = SaveOptions()
        options = SaveOptions(
            chunk_bytes=chunk_bytes or defaults.chunk_bytes,
            pack_threshold=min(defaults.pack_threshold, chunk_bytes or defaults.chunk_bytes),
            compression=codec_option(compression),
            workers=defaults.workers if workers is None else workers,
            max_inflight_bytes=max_inflight_bytes or defaults.max_inflight_bytes,
            background_workers=background_workers, background_io=background_io,
            async_writer=async_writer)
        check_async_writer(async_writer, self.store)
        load_defaults = LoadOptions()
        load_options = LoadOptions(
            workers=load_defaults.workers if workers is None else workers,
            max_inflight_bytes=max_inflight_bytes or load_defaults.max_inflight_bytes)
        if isinstance(self.store, FarTier) and hash:
            algorithm = hash_algorithm(hash)  # its opener checks the marker (TieredStore)
        else:
            algorithm = check_marker(self.store, create, hash_algorithm(hash or HASH_NAME))
        if hash is not None and hash != algorithm.name:
            raise FormatError(f"repository {self.uri} names chunks with {algorithm.name}, "
                              f"not {hash}; a repository keeps the hash it was created with")
        self.save_options = replace(options, hash=algorithm)
        self.load_options = replace(load_options, hash=algorithm)
        self.catalog = Catalog(self.store, algorithm)
        self._save_lock = threading.Lock()
        self._arena = StagingArena()
        self._pool: StagingPool | None = None  # staging="overlap": reused block slots
        self._bg = cf.ThreadPoolExecutor(1, thread_name_prefix="ckpt-async")
        self._pending: SaveHandle | None = None
        self.last_load: LoadInfo | None = None
        self.tiers = [self]

    @property
    def reachable(self) -> bool:
        return not isinstance(self.store, FarTier) or self.store.reachable

    # ------------------------------------------------------------------ catalog
    def _manifest_of(self, name: str, *, cache: bool = True) -> Manifest:
        return self.catalog.manifest(name, cache=cache)

    def names(self) -> builtins.list[str]:
        return list(self.catalog.listing())

    def created_times(self) -> dict[str, float]:
        return {name: c for c, name in self.catalog.order()}

    def _order(self) -> builtins.list[tuple[float, str]]:
        return self.catalog.order()

    def exists(self, name: str) -> bool:
        return self.catalog.exists(name)

    def problems(self) -> builtins.list[ManifestProblem]:
        """Every object under checkpoints/ that is not a readable manifest, and why (reads
        every manifest)."""
        return self.catalog.problems()

    def each_manifest(self, problems: builtins.list[ManifestProblem]) -> Iterator[Manifest]:
        return self.catalog.scan(problems)

    def _readable(self, names: builtins.list[str]) -> Iterator[Manifest]:
        for name, manifest_of in self.catalog.in_turn(names):
            m = find(manifest_of, name)
            if m is not None:
                yield m

    def known_created(self) -> dict[str, float]:
        seen = self.catalog.known_created()
        if seen is not None:
            return seen
        if not self.reachable:
            return {}
        try:
            return {name: c for c, name in self.catalog.order()}
        except TierUnreachableError as exc:
            log.warning("%s; saving with what tier 0 knows", exc)
            return {}

    def note_committed(self, name: str, created: float) -> None:
        """A checkpoint committed here by someone else (replication)."""
        self.catalog.note_committed(name, created)

    # ------------------------------------------------------------------ save
    def _route(self, tiers: Iterable[int] | None, committer: Committer) -> Route:
        if tiers is not None:
            bad = [t for t in set(tiers) if t != 0]
            if bad:
                raise ValueError(f"tiers must be in 0..0, got {bad}")
        return Route(self, committer)

    def _prepare(self, call: SaveCall) -> SaveRequest:
        """Check the name and metadata, encode the state, choose the parent: the request a
        committer commits. Raises on bad input (nothing written).

        Names and commit order are checked against this store's listing and, for tier 0 of
        a tiered store, against what it last saw of the later tiers (`call.later`), never
        by asking them: a far tier that is down neither stops nor slows a save. A name that
        exists only there and was never seen here is committed on tier 0, and its
        replication then reports the conflict (the far copy is never touched):
        docs/recovery.md."""
        name, parent, later = call.name, call.parent, call.later
        validate_name(name)
        metadata = {} if call.metadata is None else call.metadata
        if not isinstance(metadata, dict):
            raise UnsupportedTypeError("metadata must be a dict of JSON values")
        try:
            metadata = json.loads(canonical_json(metadata))
        except (TypeError, ValueError) as exc:
            raise UnsupportedTypeError(f"metadata must be JSON-serializable: {exc}") from None
        order = self.catalog.order(save_hint=True)
        if name in later.taken or name in {n for _c, n in order} or self.exists(name):
            raise CheckpointExistsError(f"checkpoint {name!r} already exists in {self.uri}; it "
                                        "was not touched")
        # only chunks this store holds may be reused: the parent is its latest. Only the
        # parent's chunks are known to exist: chunks remembered from earlier saves may belong
        # to checkpoints deleted (and swept by retention or gc) since.
        parent_name = self.catalog.newest_whole(order) if parent == LATEST else parent
        known = KnownChunks()
        parent_manifest = None
        if parent_name is not None and not (parent_name in later.taken
                                            and not self.exists(parent_name)):
            remembered = call.committer.known_chunks(parent_name)
            if remembered is not None:  # this process's part of the parent, kept from its save
                known = remembered
            else:
                parent_manifest = self.catalog.manifest(parent_name)  # raises if nowhere
        # (a parent only a later tier holds: its chunks are not here, nothing is reused)
        encoder = TreeEncoder()
        # the parent's index segments are read while the state is encoded (a restarted
        # process's incremental save would otherwise wait for their round trips after it)
        reading = (nullcontext() if parent_manifest is None else
                   parent_manifest.index_read_ahead(self.save_options.threads()))
        with reading:
            with paused_collector():
                tree = encoder.encode_state(call.state)
            if parent_manifest is not None:
                known.add_manifest(parent_manifest)
        newest = max([c for c, _n in order[-1:]] + (
            [] if later.newest is None else [later.newest]), default=None)
        return SaveRequest(name, tree, encoder.leaves, metadata, parent_name,
                           manifest_key(name), known=known,
                           not_before=0.0 if newest is None else newest + COMMIT_ORDER_STEP,
                           targets=later.targets)

    def _prepare_or_abort(self, call: SaveCall) -> SaveRequest:
        """`_prepare`; on failure the committer hears of it first (a collective save tells
        the other ranks, which would otherwise wait forever), then the error is raised."""
        try:
            return self._prepare(call)
        except Exception as exc:
            call.committer.prepare_failed(call.name, f"{type(exc).__name__}: {exc}")
            raise

    def _options(self, compression: Compression) -> SaveOptions:
        if isinstance(compression, _Default):
            return self.save_options
        return replace(self.save_options, compression=codec_option(compression))

    def _save_now(self, call: SaveCall) -> SaveInfo:
        """A save the caller waits for (CheckpointStore.save)."""
        with self._save_lock:
            self._wait_pending()
            # the lease spans reading the parent (whose chunks are reused) to the commit;
            # the caller waits for this whole call: the collector is paused for it, as for
            # any CPU-bound step (a background write only freezes: see collector.py)
            with leases.save_lease(self.store) as lease, quiet_collector(), paused_collector():
                request = self._prepare_or_abort(call)
                return self._write(request, call.committer, self._options(call.compression),
                                   call.t0, -1.0, lease)

    def _save_in_background(self, call: SaveCall, staging: Staging, copy_keys: set[str],
                            guard: builtins.list[Any]) -> SaveHandle:
        """A save beside training (CheckpointStore.save_async)."""
        with self._save_lock:
            self._wait_pending()
            lease = leases.acquire_save(self.store)  # released when the background write ends
            overlap: Overlap | None = None
            guards: builtins.list[Guard] = []
            options = self._options(call.compression)
            try:
                with quiet_collector():
                    request = self._prepare_or_abort(call)
                    with paused_collector():
                        if staging.mode == "copy":
                            request = replace(request,
                                              leaves=self._arena.stage(request.leaves))
                            options = options.for_background()
                            turns = background_turns(options)
                        else:
                            options = options.overlapped(staging)
                            turns = background_turns(options)
                            request, overlap = self._overlap_request(
                                request, call.state, copy_keys, options, turns)
                            guards.extend(Guard(overlap, opt) for opt in guard)
            except BaseException:
                for g in guards:
                    g.remove()
                lease.release()
                raise
            blocked = time.perf_counter() - call.t0

            def write() -> SaveInfo:
                try:
                    with quiet_collector():
                        info = self._write(request, call.committer, options, call.t0, blocked,
                                           lease, overlap, turns)
                    if overlap is None:
                        return info
                    overlap.finish()
                    eager = sum(leaf.nbytes for leaf, src in zip(request.leaves,
                                                                   overlap.sources)
                                if src is None and leaf.kind != "bytes")
                    return replace(info, staging="overlap", guard_wait_seconds=overlap.waited,
                                   copied_at_call_bytes=eager)
                finally:
                    if overlap is not None:
                        overlap.finish()
                    lease.release()

            future = self._bg.submit(write)
            handle = SaveHandle(future, call.name, overlap, turns)
            handle._guards = guards
            self._pending = handle
            return handle

    def _overlap_request(self, request: SaveRequest, state: Any, copy_keys: set[str],
                         options: SaveOptions, turns: Turns | None
                         ) -> tuple[SaveRequest, Overlap]:
        """The request of an overlapped save: numpy arrays and `copy_keys` copied now, every
        other leaf left on the caller's memory and tracked by an Overlap."""
        objects = flatten_arrays(state)
        leaves: builtins.list[Any] = []
        sources: builtins.list[Any] = []
        for leaf in request.leaves:
            obj = objects.get(leaf.key)
            if leaf.kind == "numpy" or leaf.key in copy_keys or (
                    leaf.kind == "torch" and getattr(obj, "_version", None) is None
                    and type(obj).__name__ != "Shard"):
                if leaf.kind != "bytes":  # bytes are immutable: nothing to copy
                    leaf = leaf.with_array(leaf.array.copy())
                obj = None
            leaves.append(leaf)
            sources.append(obj)
        self._pool = staging_pool(self._pool, self.store, options)
        overlap = Overlap(leaves, sources, self._pool, turns)
        return replace(request, leaves=leaves), overlap

    def _write(self, request: SaveRequest, committer: Committer, options: SaveOptions,
               t0: float, blocked: float, lease: leases.Lease,
               overlap: Overlap | None = None, turns: Turns | None = None) -> SaveInfo:
        """Write and commit `request` through `committer`; release the lease; then let the
        committer run what follows a commit. Returns the SaveInfo."""
        name, leaves = request.name, request.leaves
        writer = self._writer(request, options, request.known, lease, overlap, turns)
        try:
            manifest = committer.commit(writer, request)
        except ReusedBlobsMissingError as exc:
            if not isinstance(committer, LocalCommitter):
                raise  # other ranks wrote their part with the same assumption: nothing committed
            # a gc deleted chunks this save meant to reuse: write every chunk again
            log.warning("%s; writing checkpoint %r again without reusing chunks", exc, name)
            writer = self._writer(request, options, KnownChunks(), lease, overlap, turns)
            manifest = committer.commit(writer, request)
        if manifest is not None:
            # cache what any reader will parse from the store: the writer's own objects only
            # when they provably equal that parse, else the parse of the committed bytes
            # (a segmented one's parse reads its index blobs from the bytes this save
            # wrote, then as any reader does: no read back, no round trip)
            written = {ref.digest: data for ref, data in manifest.index_blob_data()}
            manifest = committed_manifest(
                manifest, writer.committed or manifest.to_bytes(), expected_name=name,
                segments=self.catalog.segment_source(written))
            self.catalog.remember(manifest)
        s = writer.stats
        info = SaveInfo(name=name, tensors=len(leaves),
                        logical_bytes=sum(leaf.nbytes for leaf in leaves) if manifest is None
                        else manifest.logical_bytes,
                        written_bytes=s.written, reused_bytes=s.reused,
                        chunks_written=s.chunks_written, chunks_reused=s.chunks_reused,
                        seconds=time.perf_counter() - t0,
                        blocked_seconds=blocked if blocked >= 0 else time.perf_counter() - t0,
                        stage_seconds=dict(s.seconds), peak_extra_bytes=writer.budget.peak)
        lease.release()  # committed: what follows (retention's sweep) may take a gc lease
        if manifest is not None:
            try:
                committer.committed(info)
            except Exception as exc:  # the checkpoint is committed: the save succeeded
                warnings.warn(f"checkpoint {name!r} was committed, but what runs after the "
                              f"commit (retention) failed: {type(exc).__name__}: {exc}",
                              RuntimeWarning, stacklevel=2)
        return info

    def _writer(self, request: SaveRequest, options: SaveOptions, known: KnownChunks,
                lease: leases.Lease, overlap: Overlap | None, turns: Turns | None
                ) -> CheckpointWriter:
        """The writer of `request`, built once with everything it needs."""
        targets = request.targets

        def before_commit(manifest: Manifest, reused: set[str]) -> None:
            # every blob, those this save wrote too: a save stalled past its lease's bound
            # (a suspended job) may find them taken by a gc that judged the lease stale
            self._confirm_reused(lease, reused, every=manifest.blob_digests)
            if targets:  # durable before the commit: a crash after it resumes (pending.py)
                pending.write_record(self.store, manifest.name, targets)

        return CheckpointWriter(self.store, options, known, turns=turns, overlap=overlap,
                                not_before=request.not_before, before_commit=before_commit,
                                confirm_reused=lambda reused: self._confirm_reused(lease,
                                                                                   reused))

    def _confirm_reused(self, lease: leases.Lease, reused: set[str],
                        every: Callable[[], set[str]] | None = None) -> None:
        """Before a commit: if a gc may have run since the save took its lease, check that
        every blob it reuses from earlier checkpoints still exists (see maintenance/leases.py),
        or, given `every` (the blobs the commit names), every one of those;
        ReusedBlobsMissingError (the save writes everything again) if one is gone."""
        if (not reused and every is None) or not lease.sweep_may_have_run():
            return
        missing = missing_blobs(self.store, reused if every is None else every(),
                                METADATA_THREADS)
        if missing:
            raise ReusedBlobsMissingError(missing)

    def _save_in_flight(self) -> SaveHandle | None:
        return self._pending

    def _wait_pending(self) -> None:
        """Wait for the save in flight; re-raise its error if nobody has seen it yet."""
        in_flight, self._pending = self._pending, None
        if in_flight is None:
            return
        seen = in_flight.observed
        try:
            in_flight.wait()  # also removes its guards' hooks (this is the training thread)
        except BaseException:
            if not seen:
                raise

    def wait(self) -> None:
        with self._save_lock:
            self._wait_pending()

    # ------------------------------------------------------------------ maintenance
    def delete(self, name: str, *, tier: int | None = None) -> None:
        if tier not in (None, 0):
            raise ValueError(f"tier must be in 0..0, got {tier!r}")
        key = manifest_key(name)
        if not self.store.exists(key):
            raise CheckpointNotFoundError(f"no checkpoint {name!r} in {self.uri}")
        self.store.delete(key)
        self.store.sync()
        self.catalog.forget(name)

    def verify(self, name: str = LATEST, *, sample: float = 1.0,
               tier: int | None = None) -> checks.VerifyReport:
        if tier not in (None, 0):
            raise ValueError(f"tier must be in 0..0, got {tier!r}")
        if name == LATEST:
            name = self.manifest(name).name
        # what the store holds: a manifest this process cached may serve its index blobs
        # from memory (the ones its save wrote), which would check nothing
        return checks.verify(self.store, [self.catalog.stored(name)], self.hash,
                             sample=sample)

    def referenced_blobs(self) -> set[str]:
        return self._references(set(), BlobUnion())

    def _references(self, seen: set[str], union: BlobUnion) -> set[str]:
        """Add to `union` the blobs of every checkpoint not in `seen` (their names are added
        to it), two parsed manifests at a time (not cached: `BlobUnion.add_each`); returns
        `union.blobs`."""
        added: list[str] = []

        def manifests() -> Iterator[Manifest]:
            for name, manifest_of in self.catalog.in_turn([n for n in self.names()
                                                           if n not in seen]):
                try:
                    manifest = manifest_of(name)
                except CheckpointNotFoundError:
                    continue  # deleted meanwhile: its blobs may go
                added.append(name)
                yield manifest

        try:
            union.add_each(manifests())
        except CkptStoreError as exc:
            raise CkptStoreError(f"gc stopped, nothing deleted: {exc}") from exc
        seen.update(added)
        return union.blobs

    def gc(self, grace_seconds: float = 3600.0, dry_run: bool = False, *, wait: float = 0.0,
           now: float | None = None) -> checks.GcReport:
        # gc asks twice and keeps the union: the second look reads only the checkpoints
        # committed since the first (a manifest never changes once committed)
        seen: set[str] = set()
        union = BlobUnion()  # (each index segment read once over both looks)

        def referenced() -> set[str]:
            return set(self._references(seen, union))

        if dry_run:
            return checks.gc(self.store, referenced, grace_seconds, True, now)
        with leases.gc_lease(self.store, wait=wait):
            return checks.gc(self.store, referenced, grace_seconds, False, now)

    # ------------------------------------------------------------------ lifecycle
    def close(self, *, wait_replication: bool = True) -> None:
        """Wait for any save in flight, then release the store. Raises the error of a save
        nobody has seen, after releasing."""
        try:
            self.wait()
        finally:
            self._bg.shutdown(wait=True)
            if self._pool is not None:
                self._pool.close()
            self.store.close()

