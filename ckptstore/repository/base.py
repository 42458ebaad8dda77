"""`CheckpointStore`, the public constructor and the interface every repository has.

`CheckpointStore(uri)` makes a `SingleStore` (one location: single.py) and
`CheckpointStore([near, far, ...])` a `TieredStore` (tiers, nearest first: tiered.py); both are
CheckpointStores. What does not depend on the number of tiers is written here once, over
`self.tiers` (a single store is its own only tier): the load from the nearest good copy,
resolving "latest", listing in commit order.

Why one module: the public interface every repository has, with docstrings that are the API
reference, and the code that does not depend on the number of tiers (load, latest, the save
entry).
"""

from __future__ import annotations

import builtins
import copy
import enum
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from ..collector import quiet_collector
from ..errors import CheckpointNotFoundError, FormatError, ObjectNotFoundError
from ..format.codecs import Codec
from ..format.manifest import Manifest
from ..format.manifest_parse import parse_manifest
from ..format.tree import flatten_arrays
from ..layout import manifest_key, segments_in
from ..maintenance.checks import GcReport, VerifyReport
from ..pipeline.commit import LOCAL, Committer
from ..pipeline.loading import load_state
from ..pipeline.options import LoadOptions, SaveInfo, SaveOptions, Staging
from ..pipeline.reader import CheckpointReader
from ..stores.base import Store
from ..tiers import config as tier_config
from .catalog import ManifestProblem, find
from .handles import CheckpointInfo, LoadInfo, SaveHandle

T = TypeVar("T")
LATEST = "latest"
log = logging.getLogger("ckptstore")


class _Default(enum.Enum):
    REPOSITORY = "the repository's setting"


#: `compression=` of a save that keeps the repository's setting (None means "no compression").
REPO_DEFAULT = _Default.REPOSITORY
Compression = str | Codec | None | _Default
RepositoryURI = str | os.PathLike[str] | Store | Sequence[tier_config.TierURI]


class CheckpointStore:
    """A repository of checkpoints in a local folder, S3 or memory, or in tiers of them.

    `CheckpointStore(uri)` is one location; `CheckpointStore([near, far, ...])` a tiered
    repository (docs/recovery.md). Thread-safety: one CheckpointStore may be shared by threads
    for reads; saves are serialized (at most one save in flight, a new one waits for the
    previous).

    `workers` sets the threads of saves and restores alike; by default a save uses 8 and a
    restore `options.default_load_workers()` (two per core, 4 to 8). A save that runs beside
    training (`save_async`) works on `background_workers` threads at once (default 1: one
    core); `background_io` more may wait in writes meanwhile (default 0: raise it for S3,
    or where the trainer leaves cores idle). Overlapped saves into a local folder are
    written by a writer process (`async_writer="auto"`, the default; "thread" keeps them in
    this process, "process" insists). See docs/training.md, "Overlapped async saves".

    `hash` chooses, when the repository is created, how chunks are named: "xxh3-128" (the
    default; detects accidents) or "sha256-128" (a writer without the manifest cannot forge
    a chunk; about 1 GB/s per core, see format/hashing.py). An existing repository keeps its
    own; asking for another is an error.
    """

    _kinds: ClassVar[dict[str, type[CheckpointStore]]] = {}

    #: the store of tier 0 (where saves land) and its URI
    store: Store
    uri: str
    save_options: SaveOptions
    load_options: LoadOptions
    #: the defaults of `save_async` (its `staging` and `max_host_bytes`)
    staging_defaults: Staging
    #: the tiers, nearest first, each a single-store repository ([self] for one location)
    tiers: builtins.list[CheckpointStore]
    #: what the last `load` read, per tier (see LoadInfo)
    last_load: LoadInfo | None

    def __init_subclass__(cls, kind: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if kind is not None:
            CheckpointStore._kinds[kind] = cls

    def __new__(cls, uri: RepositoryURI, *args: Any, **kwargs: Any) -> CheckpointStore:
        if cls is CheckpointStore:
            tiered = len(tier_config.tier_uris(uri)) > 1
            cls = CheckpointStore._kinds["tiered" if tiered else "single"]
        return super().__new__(cls)

    # ------------------------------------------------------------------ compatibility
    @property
    def staging(self) -> str:
        """The default staging of `save_async` ("copy" or "overlap")."""
        return self.staging_defaults.mode

    @property
    def max_host_bytes(self) -> int | None:
        """The default bound of an overlapped save's staging memory."""
        return self.staging_defaults.max_host_bytes

    @property
    def hash(self) -> Any:
        """The repository's hash algorithm (names every chunk)."""
        return self.save_options.hash

    @property
    def reachable(self) -> bool:
        """False for a later tier that is not open or known to be down (tiers/far.py):
        tiered listings and lookups skip it without a request."""
        return True

    # ------------------------------------------------------------------ what each kind has
    def names(self) -> builtins.list[str]:
        """Names of the committed checkpoints, unordered (one listing, no manifest reads).
        Tiered: the union over every tier that can answer."""
        raise NotImplementedError

    def created_times(self) -> dict[str, float]:
        """{name: creation time from its manifest} of the committed checkpoints (tiered: the
        union, nearest tier's copy first): the key of commit order."""
        raise NotImplementedError

    def exists(self, name: str) -> bool:
        """True if a tier (any, for a tiered store) holds the checkpoint's manifest."""
        raise NotImplementedError

    def _manifest_of(self, name: str, *, cache: bool = True) -> Manifest:
        """The manifest of checkpoint `name` (a real name, not "latest"); `cache=False`: not
        cached once read (a pass over every manifest, see catalog.py)."""
        raise NotImplementedError

    def _repair(self, blob: str, good: int, bad: builtins.list[int],
                repaired: builtins.list[str]) -> None:
        """Rewrite `blob` on tiers `bad` from tier `good` (tiered stores)."""

    def _from_tiers(self, ask: Callable[[CheckpointStore], T]) -> builtins.list[T]:
        """`ask(tier)` of every tier that can answer now, nearest first (tiered.py)."""
        return [ask(self)]

    def problems(self) -> builtins.list[ManifestProblem]:
        raise NotImplementedError

    # ------------------------------------------------------------------ manifests
    def manifest(self, name: str) -> Manifest:
        """The parsed, validated manifest of a checkpoint (cached: manifests are immutable;
        it is shared, so its `metadata` must not be changed: `list()` gives copies); `name`
        may be "latest"."""
        if name == LATEST:
            latest = self.latest()
            if latest is None:
                raise CheckpointNotFoundError(f"no checkpoints in {self.uri}")
            name = latest
        return self._manifest_of(name)

    def find_manifest(self, name: str) -> Manifest | None:
        """The manifest of `name`, or None if there is none or it cannot be read (logged)."""
        return find(self.manifest, name)

    def each_manifest(self, problems: builtins.list[ManifestProblem]) -> Iterator[Manifest]:
        """Every readable manifest in commit order, one at a time; `problems` then has what
        `problems()` returns. A single store reads each manifest once, when the pass reaches
        it, and does not cache it (whole-repository commands in memory independent of the
        number of checkpoints: catalog.scan); this default reads them as `problems()` does."""
        found = self.problems()
        problems.extend(found)
        bad = {p.key for p in found}
        for name in self.history():
            if manifest_key(name) not in bad and (m := self.find_manifest(name)) is not None:
                yield m

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every committed checkpoint, in commit order (oldest first: by creation time, then
        name). Manifests that cannot be read are skipped and logged (see `problems`). One
        parsed manifest is held at a time: those read are not cached."""
        return [CheckpointInfo(m.name, m.created, copy.deepcopy(m.metadata), m.logical_bytes,
                               len(m.tensors), m.parent)  # (the caller's own metadata)
                for m in self._readable([name for _created, name in self._order()])]

    def _readable(self, names: builtins.list[str]) -> Iterator[Manifest]:
        """The manifests of `names` that can be read, in order, one at a time and not cached
        (those that cannot are skipped and logged: `find`). A single store reads the next
        ones' bytes meanwhile (catalog.in_turn)."""
        for name in names:
            m = find(lambda n: self._manifest_of(n, cache=False), name)
            if m is not None:
                yield m

    def _order(self) -> builtins.list[tuple[float, str]]:
        return sorted((c, n) for n, c in self.created_times().items())

    def history(self) -> builtins.list[str]:
        """Names of the committed checkpoints in commit order, oldest first: by `created`,
        which every save sets later than that of the newest checkpoint it saw (so a run that
        went back to an earlier step and saves again comes after the run it abandoned), then
        by name. Reads only the first bytes of each manifest, where canonical JSON puts
        "created"; may list a manifest whose later bytes are damaged (see `latest`)."""
        return [name for _created, name in self._order()]

    def latest(self) -> str | None:
        """Name of the newest whole checkpoint in commit order (see `history`), or None if
        there is none. A newest manifest that cannot be read (torn, corrupt) is skipped and
        logged: the one before it is the latest."""
        for _created, name in reversed(self._order()):
            if self.find_manifest(name) is not None:
                return name
        return None

    def where(self, name: str) -> builtins.list[str]:
        """URIs of the tiers holding a committed copy of `name`, nearest first ([] if none)."""
        if name == LATEST:
            name = self.manifest(name).name
        return [uri for uri in self._from_tiers(lambda t: t.uri if t.exists(name) else None)
                if uri is not None]

    # ------------------------------------------------------------------ load
    def load(self, name: str = LATEST, *, into: Any = None, keys: Iterable[str] | None = None,
             strict: bool = True, prefer: Store | None = None, device: Any = None) -> Any:
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
        repaired from it (its caller writes it to tier 0).

        `device` ("cuda:0", a torch.device; None or "cpu": host memory): where the new torch
        tensors are made (tensors of `into` stay where they are). Tensors on a device, new or
        in `into`, are filled through page-locked bounce buffers, each chunk verified before
        its copy to the device is issued (pipeline/loading.DeviceReads)."""
        t0 = time.perf_counter()
        with quiet_collector():
            manifest = (self._preferred_manifest(name, prefer)
                        if prefer is not None and name != LATEST else None)
            manifest = manifest or self.manifest(name)
            repaired: builtins.list[str] = []
            first = [prefer] if prefer is not None else []
            stores = [*first, *(t.store for t in self.tiers)]
            skip = len(first)  # store indexes of the reader -> tier indexes
            holders: builtins.list[int] | None = None

            def on_fallback(blob: str, good: int, failed: builtins.list[int]) -> None:
                nonlocal holders
                if good < skip:
                    return
                if holders is None:  # asked once, and only when a fallback happened
                    holders = [i for i, held in self._from_tiers(
                        lambda t: (self.tiers.index(t), t.exists(manifest.name))) if held]
                self._repair(blob, good - skip,
                             [i - skip for i in failed if i - skip in holders], repaired)

            reader = CheckpointReader(stores[0], self.load_options, fallbacks=stores[1:],
                                      on_fallback=on_fallback if len(stores) > 1 else None)
            in_flight = self.tiers[0]._save_in_flight()
            if into is not None and in_flight is not None:  # it may still read them
                in_flight.wait_copied(flatten_arrays(into).values())
            try:
                return load_state(reader, manifest, into=into, keys=keys, strict=strict,
                                  device=device)
            finally:
                served = reader.bytes_by_source
                by_uri = {prefer.uri: served[0]} if prefer is not None else {}
                by_uri.update((t.uri, n) for t, n in zip(self.tiers, served[skip:]))
                self.last_load = LoadInfo(manifest.name, by_uri, repaired,
                                          time.perf_counter() - t0)

    def _preferred_manifest(self, name: str, store: Store) -> Manifest | None:
        """The manifest of `name` in `store` (validated), or None if it has none."""
        try:
            raw = store.get(manifest_key(name))
        except ObjectNotFoundError:
            return None
        try:
            return parse_manifest(raw, name, self.hash,
                                  segments_in([store, *(t.store for t in self.tiers)], self.hash))
        except FormatError as exc:
            raise FormatError(f"checkpoint {name!r} in {store.uri}: {exc}") from None

    # ------------------------------------------------------------------ lifecycle
    def close(self, *, wait_replication: bool = True) -> None:
        raise NotImplementedError

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r})"

    # ------------------------------------------------------------------ save
    def save(self, name: str, state: Any, metadata: dict[str, Any] | None = None, *,
             parent: str | None = LATEST, compression: Compression = REPO_DEFAULT,
             committer: Committer = LOCAL, tiers: Iterable[int] | None = None) -> SaveInfo:
        """Save `state` as checkpoint `name` and commit it; returns when it is durable.
        `committer` decides how the manifest is committed (pipeline/commit.py): alone, or
        once for many ranks (CheckpointManager under torch.distributed).

        Chunks already in the store (known from `parent`, default the latest checkpoint) are
        not written again. Raises CheckpointExistsError if `name` exists, TypeError
        (UnsupportedTypeError) naming the key path of a value that cannot be stored.

        Tiered: returns once tier 0 has committed; the checkpoint is then replicated in the
        background to the later tiers among `tiers` (default: all; see wait_replicated)."""
        t0 = time.perf_counter()
        route = self._route(tiers, committer)
        return route.tier0._save_now(SaveCall(name, state, metadata, parent, compression,
                                              route.committer, route.later, t0))

    def save_async(self, name: str, state: Any, metadata: dict[str, Any] | None = None, *,
                   parent: str | None = LATEST, compression: Compression = REPO_DEFAULT,
                   committer: Committer = LOCAL, staging: str | None = None,
                   max_host_bytes: int | None = None, copy_keys: Iterable[str] = (),
                   guard: Iterable[Any] = (), tiers: Iterable[int] | None = None
                   ) -> SaveHandle:
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
        route = self._route(tiers, committer)
        stage = self.staging_defaults.with_overrides(staging, max_host_bytes)
        return route.tier0._save_in_background(
            SaveCall(name, state, metadata, parent, compression, route.committer, route.later,
                     t0), stage, set(copy_keys), list(guard))

    def _route(self, tiers: Iterable[int] | None, committer: Committer) -> Route:
        """Where a save goes: the single-store repository that writes it (tier 0), the
        committer it commits through, and what it is checked against beyond tier 0."""
        raise NotImplementedError

    def _save_now(self, call: SaveCall) -> SaveInfo:
        """Write and commit a save the caller waits for (a single store: single.py)."""
        raise NotImplementedError

    def _save_in_background(self, call: SaveCall, staging: Staging, copy_keys: set[str],
                            guard: builtins.list[Any]) -> SaveHandle:
        """Start a save beside training (a single store: single.py)."""
        raise NotImplementedError

    def wait(self) -> None:
        """Wait for any save in flight; raise its error if it failed unobserved."""
        raise NotImplementedError

    def _save_in_flight(self) -> SaveHandle | None:
        """The save started by `save_async` that may still be running, if any."""
        return None

    # ------------------------------------------------------------------ maintenance
    def delete(self, name: str, *, tier: int | None = None) -> None:
        """Remove a checkpoint (its manifest) from every tier, or from tier `tier` only. Its
        blobs stay until `gc`. A replication of it in progress is stopped first; deleting it
        from a later tier only also removes that tier from its pending replication."""
        raise NotImplementedError

    def verify(self, name: str = LATEST, *, sample: float = 1.0,
               tier: int | None = None) -> VerifyReport:
        """Re-read and re-hash every blob the checkpoint references (or a random `sample`
        fraction of them). Returns a report; `report.ok` is False on any bad or missing blob.
        Tiered: the copy on tier `tier`, by default on the nearest tier holding it."""
        raise NotImplementedError

    def referenced_blobs(self) -> set[str]:
        """Every blob referenced by a committed manifest. Raises CkptStoreError if a manifest
        with a checkpoint name cannot be read: it could reference anything."""
        raise NotImplementedError

    def gc(self, grace_seconds: float = 3600.0, dry_run: bool = False, *, wait: float = 0.0,
           now: float | None = None) -> GcReport:
        """Delete blobs no manifest references that are older than `grace_seconds` (and than
        checks.MIN_BLOB_AGE), ages read on the store's clock (`now` overrides it: tests), and
        the lease objects left by dead processes. Raises LeaseBusyError (nothing deleted) if
        saves hold leases on this store for longer than `wait` seconds. Tiered: every tier
        in turn (each keeps what its own manifests reference); the report sums them."""
        raise NotImplementedError

    # ------------------------------------------------------------------ tiers
    def known_created(self) -> dict[str, float]:
        """{name: created} of this tier's checkpoints as last listed, kept up to date with
        what this process committed or deleted there; listed now if never listed and the
        tier can answer. A later tier that is down answers from what it showed last (or
        nothing): what a save checks names and commit order against without a request."""
        raise NotImplementedError

    def note_committed(self, name: str, created: float) -> None:
        """A checkpoint committed in this store by someone else (replication)."""

    def wait_replicated(self, timeout: float | None = None) -> None:
        """Block until every checkpoint this object saved or found pending is committed on
        every tier it is meant for; raise the ReplicationError of one that gave up (after
        retrying transient errors), or TimeoutError. A single store only waits for the save
        in flight."""
        self.wait()

    def replicate_pending(self) -> builtins.list[str]:
        """Queue the replications recorded on tier 0 and not finished (done on open; call
        again after a ReplicationError to retry). Returns the names queued."""
        return []

    def replicating(self) -> builtins.list[str]:
        """Names queued or being replicated now, in order."""
        return []

    def forget_replication(self, name: str, tier: int) -> None:
        """Tier `tier` no longer needs `name` (retention: newer checkpoints replace it
        there): its pending record drops that tier, and once no tier is left a queued
        replication of it is dropped too, without waiting for one in progress."""

    def replication_pending(self, name: str) -> bool:
        """True while `name` still has to reach a later tier (its record is on tier 0)."""
        return False


@dataclass(frozen=True)
class LaterTiers:
    """What a save on tier 0 is checked against beyond tier 0, without a request to a later
    tier: names they hold and the newest `created` among them (as this store last saw them:
    `known_created`), and the later tiers it is meant for (`targets`: a pending record is
    written on tier 0 before the commit, tiers/pending.py)."""

    taken: frozenset[str] = frozenset()
    newest: float | None = None
    targets: tuple[int, ...] = ()


@dataclass(frozen=True)
class Route:
    """Where a save goes (`CheckpointStore._route`)."""

    tier0: CheckpointStore  # the single-store repository that writes it
    committer: Committer
    later: LaterTiers = LaterTiers()


@dataclass(frozen=True)
class SaveCall:
    """One call of save or save_async, as the caller made it (checked by `_prepare`)."""

    name: str
    state: Any
    metadata: dict[str, Any] | None
    parent: str | None
    compression: Compression
    committer: Committer
    later: LaterTiers
    t0: float
