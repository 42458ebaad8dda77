"""CheckpointStore: the user-facing repository of checkpoints in one store, or in several
tiers (a list of URIs, nearest first: see ckptstore/tiers and docs/recovery.md).

Layout (docs/format.md): `ckptstore.json` marker, `blobs/ab/<digest>` immutable chunks,
`checkpoints/<name>.json` manifests. A manifest is created once, after all its blobs are
durable, and never overwritten: a checkpoint is whole or invisible. `latest` is derived from
the manifests, never stored.

Why one module of ~710 lines: it is the facade; listing and commit order, the save (prepare,
write, commit, retry on vanished reuse), the load and the maintenance entry points each take
a screen, and they share the manifest cache and the save lock. A tiered store is the same
object over tier 0 (where saves land) plus plain single-tier CheckpointStores for every tier;
the reading methods take the union, `load` the nearest good copy of each chunk, and the
tiers package does replication and its bookkeeping.
"""

from __future__ import annotations

import builtins
import concurrent.futures as cf
import enum
import json
import logging
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from .collector import paused_collector, quiet_collector
from .concurrency import Turns
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptStoreError,
    FormatError,
    InvalidNameError,
    ObjectExistsError,
    ObjectNotFoundError,
    RepositoryNotFoundError,
    StoreError,
    UnsupportedTypeError,
)
from .format.canonical import canonical_json
from .format.codecs import Codec, codec_option
from .format.hashing import HASH_NAME, HashAlgorithm, hash_algorithm
from .format.manifest import MAX_MANIFEST_BYTES, Manifest
from .format.manifest_parse import committed_manifest, parse_manifest
from .format.names import validate_name
from .format.tree import TreeEncoder, flatten_arrays
from .layout import MANIFEST_PREFIX, MARKER_KEY, blob_key, manifest_key, name_of_manifest_key
from .maintenance import checks, leases
from .pipeline.commit import LOCAL, Committer, LocalCommitter, SaveRequest
from .pipeline.loading import load_state
from .pipeline.overlap import (
    Guard,
    Overlap,
    StagingPool,
    check_async_writer,
    check_staging,
    overlap_options,
    staging_pool,
)
from .pipeline.reader import CheckpointReader, LoadOptions
from .pipeline.staging import StagingArena
from .pipeline.writer import (
    CheckpointWriter,
    KnownChunks,
    SaveInfo,
    SaveOptions,
    background_turns,
)
from .redact import redact_uri
from .stores import Store, open_store
from .tiers import config as tier_config
from .tiers import pending
from .tiers.far import FarTier, TierUnreachableError
from .tiers.replication import Replicator, RetryPolicy, fetch_verified

REPO_FORMAT = "ckptstore"
REPO_VERSION = 1
_MARKER = {"format": REPO_FORMAT, "version": REPO_VERSION, "hash": HASH_NAME}
LATEST = "latest"
# canonical JSON sorts keys, so every manifest starts with its creation time
_HEADER_RE = re.compile(rb'\{"created":(-?[0-9][0-9.eE+-]*),"format":"ckptstore\.manifest"')
_HEADER_BYTES = 96
class _Default(enum.Enum):
    REPOSITORY = "the repository's setting"


#: `compression=` of a save that keeps the repository's setting (None means "no compression").
REPO_DEFAULT = _Default.REPOSITORY
Compression = str | Codec | None | _Default

T = TypeVar("T")
#: A save's manifest is created at least this long after the newest checkpoint it saw.
COMMIT_ORDER_STEP = 1e-3
log = logging.getLogger("ckptstore")


@dataclass(frozen=True)
class ManifestProblem:
    """An object under checkpoints/ that is not a readable manifest, and why. Listing and
    `latest` skip it; gc refuses to run while one with a checkpoint name exists."""

    key: str
    reason: str


class ReusedBlobsMissingError(StoreError):
    """Blobs a save meant to reuse from earlier checkpoints were deleted meanwhile (a gc ran
    beside the save); the manifest was not committed."""

    def __init__(self, missing: list[str]) -> None:
        super().__init__(f"{len(missing)} blob(s) this save reuses were deleted before its "
                         f"commit (first: {missing[0]}); nothing was committed")
        self.missing = missing


@dataclass(frozen=True)
class LoadInfo:
    """What the last `load` of a CheckpointStore read: stored bytes served by each tier
    (URI -> bytes, nearest first) and the blobs rewritten on a nearer tier because its copy
    was missing or corrupt there."""

    name: str
    bytes_by_tier: dict[str, int]
    repaired: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(frozen=True)
class CheckpointInfo:
    """One listed checkpoint."""

    name: str
    created: float
    metadata: dict[str, Any]
    logical_bytes: int
    tensors: int
    parent: str | None


class SaveHandle:
    """A save running in the background. `wait()` returns its SaveInfo or raises its error."""

    def __init__(self, future: cf.Future[SaveInfo], name: str,
                 overlap: Overlap | None = None, turns: Turns | None = None) -> None:
        self._future = future
        self.name = name
        self._observed = False
        self._overlap = overlap
        self._turns = turns
        self._guards: builtins.list[Guard] = []

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveInfo:
        """Block until the save has committed; return its SaveInfo or raise its error. While
        the caller blocks here its core is lent to the save (concurrency.Turns)."""
        self._observed = True
        turns = None if self._future.done() else self._turns
        try:
            with turns.lent_to_waiter() if turns is not None else nullcontext():
                return self._future.result(timeout)
        finally:
            if self._future.done():
                self.remove_guards()

    def guard(self, optimizer: Any) -> None:
        """Make `optimizer.step()` wait until this save has copied every tensor the step
        changes (its parameters and their state tensors), so that the checkpoint holds their
        values at the call. Only overlapped saves need it (`staging="overlap"`); for a save
        staged at call time, or one already finished, it does nothing. The time steps waited
        is `SaveInfo.guard_wait_seconds`. The step pre-hook is inert once the save ends and
        removed by `wait()` or the next save (from the training thread)."""
        if self._overlap is None or self._overlap.finished:
            return
        self._guards.append(Guard(self._overlap, optimizer))

    def remove_guards(self) -> None:
        """Remove the step pre-hooks of `guard` (call from the thread that runs `step()`)."""
        guards, self._guards = self._guards, []
        for g in guards:
            g.remove()

    @property
    def observed(self) -> bool:
        """True once the caller has waited on this handle (and so seen any error)."""
        return self._observed

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"SaveHandle({self.name!r}, {state})"


def _check_marker(store: Store, create: bool, algorithm: HashAlgorithm) -> HashAlgorithm:
    """Read (or, with `create`, write) the repository marker of `store`; returns its hash
    algorithm."""
    try:
        raw = store.get(MARKER_KEY)
    except ObjectNotFoundError:
        if not create:
            raise RepositoryNotFoundError(
                f"no ckptstore repository at {store.uri} (missing {MARKER_KEY})") from None
        try:
            store.create(MARKER_KEY, canonical_json({**_MARKER, "hash": algorithm.name}))
            return algorithm
        except ObjectExistsError:
            raw = store.get(MARKER_KEY)
    try:
        doc = json.loads(raw)
    except ValueError:
        raise FormatError(f"{store.uri}/{MARKER_KEY} is not valid JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != REPO_FORMAT:
        raise FormatError(f"{store.uri}/{MARKER_KEY} is not a ckptstore marker")
    if doc.get("version") != REPO_VERSION:
        raise FormatError(f"repository {store.uri} has format version {doc.get('version')!r};"
                          f" this ckptstore reads version {REPO_VERSION}")
    try:
        return hash_algorithm(doc.get("hash"))
    except FormatError as exc:
        raise FormatError(f"repository {store.uri}: {exc}") from None


class CheckpointStore:
    """A repository of checkpoints in a local folder, S3 or memory.

    Thread-safety: one CheckpointStore may be shared by threads for reads; saves are serialized
    (at most one save in flight, a new one waits for the previous).

    `workers` sets the threads of saves and restores alike; by default a save uses 8 and a
    restore `reader.default_load_workers()` (two per core, 4 to 8). A save that runs beside
    training (`save_async`) works on `background_workers` threads at once (default 1: one
    core); `background_io` more may wait in writes meanwhile (default 0: raise it for S3,
    or where the trainer leaves cores idle). Overlapped saves into a local folder are
    written by a writer process (`async_writer="auto"`, the default; "thread" keeps them in
    this process, "process" insists). See docs/training.md, "Overlapped async saves".

    `hash` chooses, when the repository is created, how chunks are named: "xxh3-128" (the
    default; detects accidents) or "sha256-128" (a writer without the manifest cannot forge
    a chunk; about 1 GB/s per core, see format/hashing.py). An existing repository keeps its own;
    asking for another is an error.
    """

    def __init__(self, uri: str | os.PathLike[str] | Store | Sequence[tier_config.TierURI], *,
                 create: bool = True, chunk_bytes: int | None = None,
                 compression: str | Codec | None = None, workers: int | None = None,
                 max_inflight_bytes: int | None = None, hash: str | None = None,
                 staging: str = "copy", max_host_bytes: int | None = None,
                 replicate: bool = True, replication_retry: RetryPolicy | None = None,
                 async_writer: str = "auto", background_workers: int = 1,
                 background_io: int = 0, **store_options: Any) -> None:
        check_staging(staging, max_host_bytes)
        tier_uris = tier_config.tier_uris(uri)
        if any(tier_config.has_placeholders(u) for u in tier_uris):
            raise InvalidNameError("tier URIs with {rank}/{node}/{local_rank} must be filled in "
                                   "first (CheckpointManager does it; or tiers.config.expand)")
        uri = tier_uris[0]
        tier_options = dict(store_options)
        if len(tier_uris) > 1:
            store_options = tier_config.options_for(uri, store_options)
        #: defaults of `save_async` (see there)
        self.staging = staging
        self.max_host_bytes = max_host_bytes
        if not isinstance(uri, Store) and not create and not str(uri).startswith("memory://"):
            store_options.setdefault("create", False)  # a typo must not make a folder/bucket
        try:
            self.store = open_store(uri, **store_options) if not isinstance(uri, Store) else uri
        except ObjectNotFoundError:
            raise RepositoryNotFoundError(f"no ckptstore repository at {uri}") from None
        self.uri = self.store.uri
        defaults = SaveOptions()
        self.save_options = SaveOptions(
            chunk_bytes=chunk_bytes or defaults.chunk_bytes,
            pack_threshold=min(defaults.pack_threshold, chunk_bytes or defaults.chunk_bytes),
            compression=codec_option(compression),
            workers=defaults.workers if workers is None else workers,
            max_inflight_bytes=max_inflight_bytes or defaults.max_inflight_bytes,
            background_workers=background_workers, background_io=background_io,
            async_writer=async_writer)
        check_async_writer(async_writer, self.store)
        load_defaults = LoadOptions()
        self.load_options = LoadOptions(
            workers=load_defaults.workers if workers is None else workers,
            max_inflight_bytes=max_inflight_bytes or load_defaults.max_inflight_bytes)
        if isinstance(self.store, FarTier) and hash:
            algorithm = hash_algorithm(hash)  # its opener checks the marker (_far_tier)
        else:
            algorithm = _check_marker(self.store, create, hash_algorithm(hash or HASH_NAME))
        if hash is not None and hash != algorithm.name:
            raise FormatError(f"repository {self.uri} names chunks with {algorithm.name}, "
                              f"not {hash}; a repository keeps the hash it was created with")
        self.hash = algorithm
        self.save_options = replace(self.save_options, hash=algorithm)
        self.load_options = replace(self.load_options, hash=algorithm)
        self._known = KnownChunks()
        self._manifests: dict[str, Manifest] = {}
        #: {name: created} as last listed here (see known_created); None: never listed
        self._seen_created: dict[str, float] | None = None
        self._cache_lock = threading.Lock()
        self._save_lock = threading.Lock()
        self._arena = StagingArena()
        self._pool: StagingPool | None = None  # staging="overlap": reused block slots
        self._bg = cf.ThreadPoolExecutor(1, thread_name_prefix="ckpt-async")
        self._pending: SaveHandle | None = None
        self._not_before = 0.0  # set by each save's _prepare (see CheckpointWriter.not_before)
        #: what the last `load` read, per tier (see LoadInfo)
        self.last_load: LoadInfo | None = None
        #: the tiers, nearest first, each a single-tier CheckpointStore ([self] for one tier)
        self.tiers: builtins.list[CheckpointStore] = [self]
        self._tiered = len(tier_uris) > 1
        self._replicator: Replicator | None = None
        if self._tiered:
            self._open_tiers(tier_uris, create, chunk_bytes, compression, workers,
                             max_inflight_bytes, tier_options, replicate, replication_retry)

    def _open_tiers(self, uris: builtins.list[tier_config.TierURI], create: bool,
                    chunk_bytes: int | None, compression: str | Codec | None,
                    workers: int | None, max_inflight_bytes: int | None,
                    options: dict[str, Any], replicate: bool,
                    retry: RetryPolicy | None) -> None:
        """Open every tier as an ordinary repository (same hash as tier 0; each takes the
        options that fit it), then resume the replications a crash left pending. Later tiers
        are FarTiers (tiers/far.py): one that cannot be reached now is opened on first use."""
        common = dict(chunk_bytes=chunk_bytes, compression=compression, workers=workers,
                      max_inflight_bytes=max_inflight_bytes, hash=self.hash.name)
        opened: builtins.list[CheckpointStore] = []
        try:
            opened.append(CheckpointStore(self.store, **common))  # type: ignore[arg-type]
            for u in uris[1:]:
                opts = tier_config.options_for(u, options)
                if not create and not isinstance(u, Store) and not str(u).startswith(
                        "memory://"):
                    opts.setdefault("create", False)
                far = self._far_tier(u, opts, create)
                if not far.open_now():
                    log.warning("tier %s is unreachable; saves and restores go on with the "
                                "nearer tiers, replication retries it", far.uri)
                opened.append(CheckpointStore(far, **common))  # type: ignore[arg-type]
        except BaseException:
            for t in opened[1:]:
                t.close()
            raise
        self.tiers = opened
        if replicate:
            self._replicator = Replicator(
                [t.store for t in opened], self.hash, retry=retry,
                workers=self.save_options.workers,
                max_inflight_bytes=self.save_options.max_inflight_bytes,
                on_replicated=lambda name, tier, created: opened[tier].note_committed(
                    name, created))
            self._replicator.resume()

    def _far_tier(self, uri: tier_config.TierURI, options: dict[str, Any],
                  create: bool) -> FarTier:
        def check(store: Store) -> None:
            found = _check_marker(store, create, self.hash)
            if found.name != self.hash.name:
                raise FormatError(f"repository {store.uri} names chunks with {found.name}, "
                                  f"not {self.hash.name} like tier 0")

        def opener() -> Store:
            try:
                return open_store(uri, **options)
            except ObjectNotFoundError:
                raise RepositoryNotFoundError(f"no ckptstore repository at {uri}") from None

        shown = uri.uri if isinstance(uri, Store) else redact_uri(uri)
        return FarTier(shown, opener, check)

    @property
    def reachable(self) -> bool:
        """False for a later tier that is not open or known to be down (tiers/far.py):
        tiered listings and lookups skip it without a request."""
        return not isinstance(self.store, FarTier) or self.store.reachable

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

    def note_committed(self, name: str, created: float) -> None:
        """A checkpoint committed in this (single-tier) store by someone else (replication):
        remembered for `known_created`."""
        with self._cache_lock:
            if self._seen_created is not None:
                self._seen_created[name] = created

    def known_created(self) -> dict[str, float]:
        """{name: created} of this tier's checkpoints as last listed, kept up to date with
        what this process committed or deleted there; listed now if never listed and the
        tier can answer. A later tier that is down answers from what it showed last (or
        nothing): what a save checks names and commit order against without a request."""
        with self._cache_lock:
            seen = None if self._seen_created is None else dict(self._seen_created)
        if seen is not None:
            return seen
        if not self.reachable:
            return {}
        try:
            return {name: c for c, name in self._created_order()}
        except TierUnreachableError as exc:
            log.warning("%s; saving with what tier 0 knows", exc)
            return {}

    # ------------------------------------------------------------------ manifests
    def manifest(self, name: str) -> Manifest:
        """The parsed, validated manifest of a checkpoint (cached: manifests are immutable)."""
        if name == LATEST:
            latest = self.latest()
            if latest is None:
                raise CheckpointNotFoundError(f"no checkpoints in {self.uri}")
            name = latest
        if self._tiered:
            return self._nearest_manifest(name)
        key = manifest_key(name)
        with self._cache_lock:
            cached = self._manifests.get(name)
        if cached is not None:
            return cached
        try:
            size = self.store.stat(key).size  # the cap is checked before reading the object
            if size > MAX_MANIFEST_BYTES:
                raise FormatError(f"checkpoint {name!r} in {self.uri}: manifest of {size} bytes"
                                  f" is larger than the {MAX_MANIFEST_BYTES} allowed")
            raw = self.store.get(key)
        except ObjectNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint {name!r} in {self.uri}") from None
        try:
            manifest = parse_manifest(raw, name, self.hash)
        except FormatError as exc:
            raise FormatError(f"checkpoint {name!r} in {self.uri}: {exc}") from None
        with self._cache_lock:
            self._manifests[name] = manifest
        return manifest

    def _nearest_manifest(self, name: str) -> Manifest:
        """Tiered: the manifest from the nearest tier with a readable one (an unreadable
        near copy is logged and skipped)."""
        damaged: FormatError | None = None
        down: builtins.list[str] = []
        for i, tier in enumerate(self.tiers):
            try:
                if i and not tier.reachable:
                    raise TierUnreachableError(f"tier {tier.uri} is unreachable")
                return tier.manifest(name)
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

    def names(self) -> list[str]:
        """Names of the committed checkpoints, unordered (one listing, no manifest reads).
        Objects under checkpoints/ whose names no checkpoint can have are skipped. Tiered:
        the union over every tier."""
        if self._tiered:
            return list(dict.fromkeys(n for names in self._from_tiers(CheckpointStore.names)
                                      for n in names))
        return list(self._listing())

    def _listing(self, problems: list[ManifestProblem] | None = None) -> dict[str, int]:
        """name -> manifest size in bytes, from one listing. Keys that cannot be manifests
        (`._step-1.json`, `step 1.json`, sub-folders) are skipped, or added to `problems`."""
        out = {}
        for info in self.store.list(MANIFEST_PREFIX):
            name = name_of_manifest_key(info.key)
            if name is not None:
                out[name] = info.size
            elif problems is not None:
                problems.append(ManifestProblem(info.key, "not a checkpoint name: ignored"))
        return out

    def list(self) -> list[CheckpointInfo]:
        """Every committed checkpoint, in commit order (oldest first: by creation time, then
        name). Manifests that cannot be read are skipped and logged (see `problems`)."""
        names = self.names()
        with cf.ThreadPoolExecutor(8) as pool:
            manifests = list(pool.map(self.find_manifest, names))
        infos = [CheckpointInfo(m.name, m.created, m.metadata, m.logical_bytes,
                                len(m.tensors), m.parent) for m in manifests if m is not None]
        return sorted(infos, key=lambda i: (i.created, i.name))

    def problems(self) -> builtins.list[ManifestProblem]:
        """Every object under checkpoints/ that is not a readable manifest, and why (reads
        every manifest)."""
        problems: builtins.list[ManifestProblem] = []
        if self._tiered:
            return [replace(p, reason=f"{uri}: {p.reason}") for uri, found in self._from_tiers(
                lambda t: (t.uri, t.problems())) for p in found]
        names = self._listing(problems)
        with cf.ThreadPoolExecutor(8) as pool:
            for name, error in zip(names, pool.map(self._manifest_error, names)):
                if error is not None:
                    problems.append(ManifestProblem(manifest_key(name), error))
        return sorted(problems, key=lambda p: p.key)

    def _manifest_error(self, name: str) -> str | None:
        try:
            self.manifest(name)
        except CheckpointNotFoundError:
            return None  # deleted meanwhile
        except FormatError as exc:
            return str(exc)
        return None

    def find_manifest(self, name: str) -> Manifest | None:
        """The manifest of `name`, or None if there is none or it cannot be read (logged)."""
        try:
            return self.manifest(name)
        except CheckpointNotFoundError:
            return None
        except FormatError as exc:
            log.warning("skipping unreadable manifest: %s", exc)
            return None

    def history(self) -> builtins.list[str]:
        """Names of the committed checkpoints in commit order, oldest first: by `created`,
        which every save sets later than that of the newest checkpoint it saw (so a run that
        went back to an earlier step and saves again comes after the run it abandoned), then
        by name. Reads only the first bytes of each manifest, where canonical JSON puts
        "created"; may list a manifest whose later bytes are damaged (see `latest`).
        Tiered: the union over every tier, in the same order."""
        return [name for c, name in sorted((c, n) for n, c in self.created_times().items())]

    def created_times(self) -> dict[str, float]:
        """{name: creation time from its manifest} of the committed checkpoints (tiered: the
        union, nearest tier's copy first): the key of commit order."""
        seen: dict[str, float] = {}
        for order in self._from_tiers(CheckpointStore._created_order):
            for c, name in order:
                seen.setdefault(name, c)
        return seen

    def _created_order(self) -> builtins.list[tuple[float, str]]:
        """(created, name) of this tier's checkpoints, in commit order."""
        listing = self._listing()
        with cf.ThreadPoolExecutor(8) as pool:
            created = list(pool.map(lambda item: self._created(*item), listing.items()))
        order = sorted((c, name) for c, name in zip(created, listing) if c is not None)
        with self._cache_lock:
            self._seen_created = {name: c for c, name in order}
        return order

    def latest(self) -> str | None:
        """Name of the newest whole checkpoint in commit order (see `history`), or None if
        there is none. A newest manifest that cannot be read (torn, corrupt) is skipped and
        logged: the one before it is the latest."""
        return self._newest_whole(sorted((c, n) for n, c in self.created_times().items()))

    def _newest_whole(self, order: builtins.list[tuple[float, str]]) -> str | None:
        """The last name of `order` ((created, name), oldest first) with a readable
        manifest (see `latest`)."""
        for _created, name in reversed(order):
            if self.find_manifest(name) is not None:
                return name
        return None

    def _created(self, name: str, size: int) -> float | None:
        """Creation time of a checkpoint from its manifest's first bytes (or, for a manifest
        not in canonical form, the whole manifest); None if it was deleted meanwhile or
        cannot be read."""
        with self._cache_lock:
            cached = self._manifests.get(name)
        if cached is not None:
            return cached.created
        try:
            head = self.store.get_range(manifest_key(name), 0, min(size, _HEADER_BYTES))
        except ObjectNotFoundError:
            return None
        except StoreError:
            head = b""  # shorter than listed (replaced meanwhile): read it whole
        match = _HEADER_RE.match(head)
        if match is not None:
            return float(match.group(1))
        manifest = self.find_manifest(name)
        return None if manifest is None else manifest.created

    def exists(self, name: str) -> bool:
        """True if a tier (any, for a tiered store) holds the checkpoint's manifest."""
        if self._tiered:
            return self.tiers[0].exists(name) or any(self._from_tiers(
                lambda t: t is not self.tiers[0] and t.exists(name)))
        return self.store.exists(manifest_key(name))

    def where(self, name: str) -> builtins.list[str]:
        """URIs of the tiers holding a committed copy of `name`, nearest first ([] if none)."""
        if name == LATEST:
            name = self.manifest(name).name
        return [uri for uri in self._from_tiers(lambda t: t.uri if t.exists(name) else None)
                if uri is not None]

    def delete(self, name: str, *, tier: int | None = None) -> None:
        """Remove a checkpoint (its manifest) from every tier, or from tier `tier` only. Its
        blobs stay until `gc`. A replication of it in progress is stopped first; deleting it
        from a later tier only also removes that tier from its pending replication."""
        if tier is not None and not 0 <= tier < len(self.tiers):
            raise ValueError(f"tier must be in 0..{len(self.tiers) - 1}, got {tier!r}")
        if self._tiered:
            self._delete_tiered(name, tier)
            return
        key = manifest_key(name)
        if not self.store.exists(key):
            raise CheckpointNotFoundError(f"no checkpoint {name!r} in {self.uri}")
        self.store.delete(key)
        self.store.sync()
        with self._cache_lock:
            self._manifests.pop(name, None)
            if self._seen_created is not None:
                self._seen_created.pop(name, None)

    def _delete_tiered(self, name: str, tier: int | None) -> None:
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
        near = self.tiers[0].store
        if tier is None or tier == 0:
            pending.clear_record(near, name)  # nothing left to replicate from
        else:
            pending.drop_tier(near, name, tier)
        for i in holders:
            self.tiers[i].delete(name)

    # ------------------------------------------------------------------ save
    def _prepare(self, name: str, state: Any, metadata: dict[str, Any] | None,
                 parent: str | None) -> SaveRequest:
        """Check the name and metadata, encode the state, choose the parent: the request a
        committer commits. Raises on bad input (nothing written)."""
        validate_name(name)
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict):
            raise UnsupportedTypeError("metadata must be a dict of JSON values")
        try:
            metadata = json.loads(canonical_json(metadata))
        except (TypeError, ValueError) as exc:
            raise UnsupportedTypeError(f"metadata must be JSON-serializable: {exc}") from None
        # Saves land on tier 0: its listing is read now; a later tier is checked against
        # what this store last saw of it (known_created), never asked in the foreground, so
        # a far tier that is down neither stops nor slows a save. A name that exists only
        # there and was never seen here is committed on tier 0, and its replication then
        # reports the conflict (the far copy is never touched): docs/recovery.md.
        near = self.tiers[0]
        order = near._created_order()
        taken = {n for _c, n in order} | {n for t in self.tiers[1:] for n in t.known_created()}
        if name in taken or near.exists(name):
            raise CheckpointExistsError(f"checkpoint {name!r} already exists in {self.uri}; it "
                                        "was not touched")
        encoder = TreeEncoder()
        with paused_collector():
            tree = encoder.encode_state(state)
        # only chunks tier 0 holds may be reused: the parent is tier 0's latest
        parent_name = near._newest_whole(order) if parent == LATEST else parent
        # Only the parent's chunks are known to exist: chunks remembered from earlier saves
        # may belong to checkpoints deleted (and swept by retention or gc) since.
        self._known = KnownChunks()
        if parent_name is not None:
            if self._tiered and not near.exists(parent_name):
                self.manifest(parent_name)  # raises if it is nowhere; its chunks are not near
            else:
                self._known.add_manifest(near.manifest(parent_name))
        newest = max([c for c, _n in order[-1:]] + [
            c for t in self.tiers[1:] for c in t.known_created().values()], default=None)
        self._not_before = 0.0 if newest is None else newest + COMMIT_ORDER_STEP
        return SaveRequest(name, tree, encoder.leaves, metadata, parent_name, manifest_key(name))

    def _prepare_or_abort(self, committer: Committer, name: str, state: Any,
                          metadata: dict[str, Any] | None, parent: str | None) -> SaveRequest:
        """`_prepare`; on failure the committer hears of it first (a collective save tells
        the other ranks, which would otherwise wait forever), then the error is raised."""
        try:
            return self._prepare(name, state, metadata, parent)
        except Exception as exc:
            committer.prepare_failed(name, f"{type(exc).__name__}: {exc}")
            raise

    def _options(self, compression: Compression) -> SaveOptions:
        if isinstance(compression, _Default):
            return self.save_options
        return replace(self.save_options, compression=codec_option(compression))

    def _targets(self, tiers: Iterable[int] | None) -> tuple[int, ...]:
        """The later tiers a save is meant for (`tiers=None`: all); checked before saving."""
        if tiers is None:
            return tuple(range(1, len(self.tiers)))
        chosen = set(tiers)
        bad = [t for t in chosen if type(t) is not int or not 0 <= t < len(self.tiers)]
        if bad:
            raise ValueError(f"tiers must be in 0..{len(self.tiers) - 1}, got {bad}")
        return tuple(sorted(chosen - {0}))

    def _write(self, request: SaveRequest, committer: Committer, options: SaveOptions,
               t0: float, blocked: float, lease: leases.Lease,
               overlap: Overlap | None = None, targets: tuple[int, ...] = (),
               turns: Turns | None = None) -> SaveInfo:
        """Write and commit `request` through `committer`; release the lease; queue the
        replication to `targets` (later tiers); then let the committer run what follows a
        commit. Returns the SaveInfo. `turns`: those of a background save (SaveHandle)."""
        name, leaves = request.name, request.leaves
        writer = self._writer(options, self._known, lease, overlap, targets, turns)
        try:
            manifest = committer.commit(writer, request)
        except ReusedBlobsMissingError as exc:
            if not isinstance(committer, LocalCommitter):
                raise  # other ranks wrote their part with the same assumption: nothing committed
            # a gc deleted chunks this save meant to reuse: write every chunk again
            log.warning("%s; writing checkpoint %r again without reusing chunks", exc, name)
            writer = self._writer(options, KnownChunks(), lease, overlap, targets, turns)
            manifest = committer.commit(writer, request)
        if manifest is not None:
            # cache what any reader will parse from the store: the writer's own objects only
            # when they provably equal that parse, else the parse of the committed bytes
            manifest = committed_manifest(manifest, writer.committed or manifest.to_bytes(),
                                          expected_name=name)
            with self._cache_lock:
                self._manifests[name] = manifest
            if self._tiered:
                with self.tiers[0]._cache_lock:
                    self.tiers[0]._manifests[name] = manifest
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
        if manifest is not None and targets and self._replicator is not None:
            self._replicator.submit(name, targets)
        if manifest is not None:
            try:
                committer.committed(info)
            except Exception as exc:  # the checkpoint is committed: the save succeeded
                warnings.warn(f"checkpoint {name!r} was committed, but what runs after the "
                              f"commit (retention) failed: {type(exc).__name__}: {exc}",
                              RuntimeWarning, stacklevel=2)
        return info

    def _writer(self, options: SaveOptions, known: KnownChunks,
                lease: leases.Lease | None, overlap: Overlap | None = None,
                targets: tuple[int, ...] = (), turns: Turns | None = None
                ) -> CheckpointWriter:
        writer = CheckpointWriter(self.store, options, known, turns)
        writer.overlap = overlap
        writer.not_before = self._not_before
        if lease is not None:
            def before_commit(manifest: Manifest, reused: set[str]) -> None:
                self._confirm_reused(lease, reused)
                if targets:  # durable before the commit: a crash after it resumes (pending.py)
                    pending.write_record(self.store, manifest.name, targets)
            writer.before_commit = before_commit
        return writer

    def _confirm_reused(self, lease: leases.Lease, reused: set[str]) -> None:
        """Before a commit: if a gc may have run since the save took its lease, check that
        every blob it reuses from earlier checkpoints still exists (see maintenance/leases.py)."""
        if not reused or not lease.sweep_may_have_run():
            return
        keys = sorted(reused)
        with cf.ThreadPoolExecutor(8) as pool:
            present = list(pool.map(lambda b: self.store.exists(blob_key(b)), keys))
        missing = [b for b, ok in zip(keys, present) if not ok]
        if missing:
            raise ReusedBlobsMissingError(missing)

    def _wait_pending(self) -> None:
        """Wait for the save in flight; re-raise its error if nobody has seen it yet."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        seen = pending.observed
        try:
            pending.wait()  # also removes its guards' hooks (this is the training thread)
        except BaseException:
            if not seen:
                raise

    def save(self, name: str, state: Any, metadata: dict[str, Any] | None = None, *,
             parent: str | None = LATEST,
             compression: Compression = REPO_DEFAULT,
             committer: Committer = LOCAL, tiers: Iterable[int] | None = None) -> SaveInfo:
        """Save `state` as checkpoint `name` and commit it; returns when it is durable.
        `committer` decides how the manifest is committed (pipeline/commit.py): alone, or
        once for many ranks (CheckpointManager under torch.distributed).

        Chunks already in the store (known from `parent`, default the latest checkpoint, and
        from this object's earlier saves) are not written again. Raises CheckpointExistsError
        if `name` exists, TypeError (UnsupportedTypeError) naming the key path of a value that
        cannot be stored.

        Tiered: returns once tier 0 has committed; the checkpoint is then replicated in the
        background to the later tiers among `tiers` (default: all; see wait_replicated)."""
        t0 = time.perf_counter()
        targets = self._targets(tiers)
        with self._save_lock:
            self._wait_pending()
            # the lease spans reading the parent (whose chunks are reused) to the commit
            # the caller waits for this whole call: the collector is paused for it, as for
            # any CPU-bound step (a background write only freezes: see collector.py)
            with leases.save_lease(self.store) as lease, quiet_collector(), paused_collector():
                request = self._prepare_or_abort(committer, name, state, metadata, parent)
                return self._write(request, committer, self._options(compression), t0, -1.0,
                                   lease, targets=targets)

    def save_async(self, name: str, state: Any, metadata: dict[str, Any] | None = None, *,
                   parent: str | None = LATEST, compression: Compression = REPO_DEFAULT,
                   committer: Committer = LOCAL, staging: str | None = None,
                   max_host_bytes: int | None = None,
                   copy_keys: Iterable[str] = (), guard: Iterable[Any] = (),
                   tiers: Iterable[int] | None = None) -> SaveHandle:
        """Save `state` in the background; the checkpoint holds each tensor's value at the
        moment of this call. One save is in flight at a time: this first waits for the
        previous one, and raises its error if it failed and `wait()` never reported it.
        Errors of the background write are raised by `handle.wait()`.

        `staging` (default: the store's, itself "copy"):

        * "copy": copy every array of `state` into a staging arena, then return. The caller
          may change its tensors at once. Extra host memory: the whole state's size, kept
          between saves (the arena is reused), plus the pipeline's `max_inflight_bytes`.
        * "overlap": return before copying anything (the call only encodes the state tree,
          records each tensor's in-place version counter and copies numpy arrays and the
          leaves named in `copy_keys`). In the background each block is copied into a reused
          staging pool of at most `max_host_bytes` (default `max_inflight_bytes`; at least
          one chunk), hashed, written and released: extra host memory stays under
          `max_host_bytes` (plus what was copied at call time) whatever the state's size.
          The caller must not change a tensor before the save has copied it: call
          `handle.guard(optimizer)` to make `optimizer.step()` wait for that; a tensor
          changed in place too early fails the save with `SourceChangedError` naming it and
          nothing is committed (what can and cannot be detected: docs/training.md).
          `guard=[optimizers]` guards them from the start, before the background write
          begins (as `handle.guard`; a wrapper such as accelerate's AcceleratedOptimizer is
          guarded through the optimizer it wraps): if one cannot be guarded
          (UnsupportedTypeError), the save is abandoned before it writes anything.

        Tiered: the handle finishes when tier 0 has committed; replication to the later
        tiers among `tiers` (default: all) follows in the background (`wait_replicated`).
        """
        t0 = time.perf_counter()
        targets = self._targets(tiers)
        staging = self.staging if staging is None else staging
        max_host_bytes = self.max_host_bytes if max_host_bytes is None else max_host_bytes
        check_staging(staging, max_host_bytes)
        with self._save_lock:
            self._wait_pending()
            lease = leases.acquire_save(self.store)  # released when the background write ends
            overlap: Overlap | None = None
            guards: builtins.list[Guard] = []
            options = self._options(compression)
            try:
                with quiet_collector():
                    request = self._prepare_or_abort(committer, name, state, metadata, parent)
                    with paused_collector():
                        if staging == "copy":
                            request = replace(request,
                                              leaves=self._arena.stage(request.leaves))
                            options = options.for_background()
                        else:
                            options = overlap_options(options, max_host_bytes)
                            request, overlap = self._overlap_request(
                                request, state, set(copy_keys), options)
                            guards.extend(Guard(overlap, opt) for opt in guard)
            except BaseException:
                for g in guards:
                    g.remove()
                lease.release()
                raise
            blocked = time.perf_counter() - t0
            turns = background_turns(options)

            def write() -> SaveInfo:
                try:
                    with quiet_collector():
                        info = self._write(request, committer, options, t0, blocked, lease,
                                           overlap, targets, turns)
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
            handle = SaveHandle(future, name, overlap, turns)
            handle._guards = guards
            self._pending = handle
            return handle

    def _overlap_request(self, request: SaveRequest, state: Any, copy_keys: set[str],
                         options: SaveOptions) -> tuple[SaveRequest, Overlap]:
        """The request of an overlapped save: numpy arrays and `copy_keys` copied now, every
        other leaf left on the caller's memory and tracked by an Overlap."""
        objects = flatten_arrays(state)
        leaves: builtins.list[Any] = []
        sources: builtins.list[Any] = []
        for leaf in request.leaves:
            obj = objects.get(leaf.key)
            if getattr(obj, "is_cpu", True) is False:
                obj = None  # encoding copied it to the CPU already: a call-time copy
            elif leaf.kind == "numpy" or leaf.key in copy_keys or (
                    leaf.kind == "torch" and getattr(obj, "_version", None) is None
                    and type(obj).__name__ != "Shard"):
                if leaf.kind != "bytes":  # bytes are immutable: nothing to copy
                    leaf = leaf.with_array(leaf.array.copy())
                obj = None
            leaves.append(leaf)
            sources.append(obj)
        self._pool = staging_pool(self._pool, self.store, options)
        overlap = Overlap(leaves, sources, self._pool)
        return replace(request, leaves=leaves), overlap

    def wait(self) -> None:
        """Wait for any save in flight; raise its error if it failed unobserved."""
        with self._save_lock:
            self._wait_pending()

    # ------------------------------------------------------------------ load
    def load(self, name: str = LATEST, *, into: Any = None, keys: Iterable[str] | None = None,
             strict: bool = True, prefer: Store | None = None) -> Any:
        """Restore a checkpoint. Returns a new nested state of the saved types; with `into`,
        tensors at the same dotted keys are filled in place (same objects returned) and
        `strict` requires every tensor of `into` to be in the checkpoint; with `keys`, only
        those keys or subtrees are read. Every byte is verified (IntegrityError names the
        tensor and blob); on an error, `into` tensors may be partly overwritten.

        Tiered: the manifest comes from the nearest tier holding it, each chunk from the
        nearest tier holding a good copy; a missing or corrupt chunk on a tier that holds the
        checkpoint is rewritten there from the farther copy (a RuntimeWarning names the blob).
        IntegrityError only when no tier has a good copy. `last_load` tells the bytes each
        tier served.

        `prefer`: a store read before the tiers, manifest and chunks (blobs just received
        from a peer: training/peers.py); what it lacks comes from the tiers, and nothing is
        repaired from it (its caller writes it to tier 0)."""
        t0 = time.perf_counter()
        with quiet_collector():
            manifest = (self._preferred_manifest(name, prefer)
                        if prefer is not None and name != LATEST else None)
            manifest = manifest or self.manifest(name)
            repaired: builtins.list[str] = []
            first = [prefer] if prefer is not None else []
            if self._tiered or first:
                skip = len(first)  # store indexes of the reader -> tier indexes
                holders = [i for i, held in self._from_tiers(
                    lambda t: (self.tiers.index(t), t.exists(manifest.name))) if held]
                stores = [*first, *(t.store for t in self.tiers)]
                reader = CheckpointReader(
                    stores[0], self.load_options, fallbacks=stores[1:],
                    on_fallback=lambda blob, good, failed: None if good < skip else self._repair(
                        blob, good - skip, [i - skip for i in failed if i - skip in holders],
                        repaired))
            else:
                reader = CheckpointReader(self.store, self.load_options)
            try:
                return load_state(reader, manifest, into=into, keys=keys, strict=strict)
            finally:
                served = reader.bytes_by_source
                by_uri = {prefer.uri: served[0]} if prefer is not None else {}
                by_uri.update((t.uri, n) for t, n in zip(self.tiers, served[len(first):]))
                self.last_load = LoadInfo(manifest.name, by_uri, repaired,
                                          time.perf_counter() - t0)

    def _preferred_manifest(self, name: str, store: Store) -> Manifest | None:
        """The manifest of `name` in `store` (validated), or None if it has none."""
        try:
            raw = store.get(manifest_key(name))
        except ObjectNotFoundError:
            return None
        try:
            return parse_manifest(raw, name, self.hash)
        except FormatError as exc:
            raise FormatError(f"checkpoint {name!r} in {store.uri}: {exc}") from None

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
    def verify(self, name: str = LATEST, *, sample: float = 1.0,
               tier: int | None = None) -> checks.VerifyReport:
        """Re-read and re-hash every blob the checkpoint references (or a random `sample`
        fraction of them). Returns a report; `report.ok` is False on any bad or missing blob.
        Tiered: the copy on tier `tier`, by default on the nearest tier holding it."""
        if self._tiered:
            if tier is not None and not 0 <= tier < len(self.tiers):
                raise ValueError(f"tier must be in 0..{len(self.tiers) - 1}, got {tier!r}")
            if name == LATEST:
                name = self.manifest(name).name
            if tier is None:  # the nearest holder: tier 0 answers without the far tiers
                chosen = self.tiers[0] if self.tiers[0].exists(name) else next(
                    (t for t in self._from_tiers(lambda t: t if t is not self.tiers[0]
                                                 and t.exists(name) else None) if t), None)
            else:
                chosen = self.tiers[tier] if self.tiers[tier].exists(name) else None
            if chosen is None:
                where = "any tier" if tier is None else f"tier {tier}"
                raise CheckpointNotFoundError(f"no checkpoint {name!r} on {where} of {self.uri}")
            return chosen.verify(name, sample=sample)
        manifest = self.manifest(name)
        return checks.verify(self.store, [manifest], self.hash, sample=sample)

    def referenced_blobs(self) -> set[str]:
        """Every blob referenced by a committed manifest. Raises CkptStoreError if a manifest
        with a checkpoint name cannot be read: it could reference anything."""
        refs: set[str] = set()
        for name in self.names():
            try:
                refs |= self.manifest(name).blob_digests()
            except CheckpointNotFoundError:
                continue  # deleted meanwhile: its blobs may go
            except CkptStoreError as exc:
                raise CkptStoreError(f"gc stopped, nothing deleted: {exc}") from exc
        return refs

    def gc(self, grace_seconds: float = 3600.0, dry_run: bool = False, *, wait: float = 0.0,
           now: float | None = None) -> checks.GcReport:
        """Delete blobs no manifest references that are older than `grace_seconds` (and than
        checks.MIN_BLOB_AGE), ages read on the store's clock (`now` overrides it: tests), and
        the lease objects left by dead processes. Raises LeaseBusyError (nothing deleted) if
        saves hold leases on this store for longer than `wait` seconds. Tiered: every tier
        in turn (each keeps what its own manifests reference); the report sums them."""
        if self._tiered:
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
        if dry_run:
            return checks.gc(self.store, self.referenced_blobs, grace_seconds, True, now)
        with leases.gc_lease(self.store, wait=wait):
            return checks.gc(self.store, self.referenced_blobs, grace_seconds, False, now)

    # ------------------------------------------------------------------ tiers
    def wait_replicated(self, timeout: float | None = None) -> None:
        """Block until every checkpoint this object saved or found pending is committed on
        every tier it is meant for; raise the ReplicationError of one that gave up (after
        retrying transient errors), or TimeoutError. A single-tier store only waits for the
        save in flight."""
        self.wait()
        if self._replicator is not None:
            self._replicator.wait(timeout)

    def replicate_pending(self) -> builtins.list[str]:
        """Queue the replications recorded on tier 0 and not finished (done on open; call
        again after a ReplicationError to retry). Returns the names queued."""
        return [] if self._replicator is None else self._replicator.resume()

    def replicating(self) -> builtins.list[str]:
        """Names queued or being replicated now, in order."""
        return [] if self._replicator is None else self._replicator.pending()

    def forget_replication(self, name: str, tier: int) -> None:
        """Tier `tier` no longer needs `name` (retention: newer checkpoints replace it
        there): its pending record drops that tier, and once no tier is left a queued
        replication of it is dropped too, without waiting for one in progress."""
        near = self.tiers[0].store
        pending.drop_tier(near, name, tier)
        if self._replicator is not None and not pending.has_record(near, name):
            self._replicator.discard(name)

    def replication_pending(self, name: str) -> bool:
        """True while `name` still has to reach a later tier (its record is on tier 0)."""
        return self._tiered and pending.has_record(self.tiers[0].store, name)

    # ------------------------------------------------------------------ lifecycle
    def close(self, *, wait_replication: bool = True) -> None:
        """Wait for any save in flight and (tiered, unless told not to) for replication,
        then release the stores. Replication left unfinished resumes on the next open.
        Raises the error of a save or replication nobody has seen, after releasing."""
        try:
            self.wait()
        finally:
            try:
                if self._replicator is not None:
                    self._replicator.close(wait=wait_replication)
            finally:
                self._bg.shutdown(wait=True)
                if self._pool is not None:
                    self._pool.close()
                for tier in self.tiers[1:]:
                    tier.close()
                self.store.close()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r})"
