"""The catalog of one store: its manifests, their commit order and the latest checkpoint.

A manifest is immutable once committed, so parsed manifests are cached (the most recently
used ones, up to CACHE_TENSORS tensor entries in all, so a long-lived store does not keep
every manifest it ever read). A name is not: another process may delete a checkpoint and
save another under its name. So a cached manifest is used only while the store still holds
the object it was parsed from (the same size and modification time, `_Identity`: one stat);
otherwise it is dropped and the store's object read (on S3, whose modification times have a
resolution of a second, a name deleted and saved again within the second its cached object
was written, at the same size, is not told apart). Commit order is the manifests' `created`
(each save sets it later than the newest checkpoint it saw): canonical JSON sorts keys, so a
manifest starts with `{"created":<time>,"format":"ckptstore.manifest"`, and the order is
read from the first 96 bytes of each manifest (ranged reads, METADATA_THREADS at a time),
once per manifest object: a listing whose name, size and modification time are unchanged
reuses the time read before, so a save in a repository of 500 checkpoints costs one listing,
not 500 reads; a fresh process starts from the times a saving process recorded
(order_hint.py). Only the manifests asked for are parsed; a pass over every manifest
(`scan`, `in_turn` for list, ls, du, gc) does not cache what it reads, so it holds one
parsed manifest at a time (the passes of ls, du and gc two: they read the next one's index
segments meanwhile), while the bytes of the next few are read side by side. `latest` is the
newest whole checkpoint in that order, never a stored pointer.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass

from ..concurrency import outcome, read_ahead
from ..errors import CheckpointNotFoundError, FormatError, ObjectNotFoundError, StoreError
from ..format.hashing import HashAlgorithm
from ..format.manifest import MAX_MANIFEST_BYTES, Manifest
from ..format.manifest_parse import parse_manifest
from ..format.segments import SegmentSource
from ..layout import MANIFEST_PREFIX, manifest_key, name_of_manifest_key, segments_in
from ..pipeline.options import METADATA_THREADS
from ..stores.base import ObjectInfo, Store
from .order_hint import WRITE_AFTER_HEADS, Heads, read_hint, write_hint

# canonical JSON sorts keys, so every manifest starts with its creation time
_HEADER_RE = re.compile(rb'\{"created":(-?[0-9][0-9.eE+-]*),"format":"ckptstore\.manifest"')
_HEADER_BYTES = 96
#: parsed manifests cached, in tensor entries (about 1 KB each parsed): the newest manifest
#: is always kept, whatever its size
CACHE_TENSORS = 400_000
#: a pass over many manifests (`Catalog.in_turn`) reads this many ahead of the one in use,
#: each of at most READ_AHEAD_MANIFEST_BYTES (a larger one is read when its turn comes)
MANIFEST_READ_AHEAD = 8
READ_AHEAD_MANIFEST_BYTES = 8 << 20
log = logging.getLogger("ckptstore")


#: (size, modification time) of the manifest object a cached parse was read from
_Identity = tuple[int, float]


def _identity(info: ObjectInfo) -> _Identity:
    return (info.size, info.mtime)


def _given(manifest: Manifest, _name: str) -> Manifest:
    return manifest


@dataclass(frozen=True)
class ManifestProblem:
    """An object under checkpoints/ that is not a readable manifest, and why. Listing and
    `latest` skip it; gc refuses to run while one with a checkpoint name exists."""

    key: str
    reason: str


def find(manifest_of: Callable[[str], Manifest], name: str) -> Manifest | None:
    """`manifest_of(name)`, or None if there is no such checkpoint or its manifest cannot be
    read (logged): the one rule of listings and `latest`, which skip what they cannot read."""
    try:
        return manifest_of(name)
    except CheckpointNotFoundError:
        return None
    except FormatError as exc:
        log.warning("skipping unreadable manifest: %s", exc)
        return None


class Catalog:
    """What one store holds: manifests (parsed, validated, cached), names, commit order.
    Thread-safe."""

    def __init__(self, store: Store, hash: HashAlgorithm) -> None:
        self.store = store
        self.hash = hash
        #: parsed manifests and the object each was read from, least recently used first
        self._manifests: OrderedDict[str, tuple[Manifest, _Identity]] = OrderedDict()
        self._cached_tensors = 0
        #: {name: created} as last listed (see `known_created`); None: never listed
        self._seen: dict[str, float] | None = None
        #: (name, size, mtime) of a listed manifest -> its created: read once per object
        self._heads: Heads = {}
        self._hint_read = False
        self._lock = threading.Lock()
        #: stores read for an index segment this store lacks or holds damaged (a tiered
        #: store's later tiers; see layout.segments_in)
        self.segment_fallbacks: list[Store] = []

    # ------------------------------------------------------------------ manifests
    def manifest(self, name: str, *, cache: bool = True) -> Manifest:
        """The parsed, validated manifest of checkpoint `name` (cached while the store holds
        the object it was read from). The size cap is checked before the object is read.
        `cache=False` (a pass over every manifest: list, ls, du, gc) reuses a cached manifest
        but does not cache the one it reads, so such a pass holds one parsed manifest at a
        time whatever the number of checkpoints."""
        cached = self._cached(name, touch=cache)
        if cached is not None:
            return cached
        manifest, identity = self._read(name)
        if cache:
            self.remember(manifest, identity)
        return manifest

    def _cached(self, name: str, touch: bool = True) -> Manifest | None:
        """The cached manifest of `name` if the store still holds the object it was read from
        (one stat); a stale one (deleted, or another object saved under the name since) is
        dropped. `touch`: mark it most recently used."""
        with self._lock:
            entry = self._manifests.get(name)
        if entry is None:
            return None
        try:
            now = _identity(self.store.stat(manifest_key(name)))
        except ObjectNotFoundError:
            now = None
        with self._lock:
            if self._manifests.get(name) is not entry:
                return None  # replaced or dropped meanwhile: read it
            if now != entry[1]:
                self._drop(name)
                return None
            if touch:
                self._manifests.move_to_end(name)
        return entry[0]

    def stored(self, name: str) -> Manifest:
        """The manifest of `name` as the store holds it now: read and parsed, neither taken
        from nor put in the cache, its index blobs read from this store alone when used (what
        a verify checks: not what this process remembers having written, nor a later tier's
        copy)."""
        return self._parse(name, self._fetch(name), segments_in([self.store], self.hash))

    def _read(self, name: str) -> tuple[Manifest, _Identity]:
        """Read, parse and validate the manifest of `name` from the store (not cached), and
        the identity of the object read."""
        raw, identity = self._fetch_at_most(name, MAX_MANIFEST_BYTES)
        assert raw is not None  # within the cap, or _fetch_at_most raised
        return self._parse(name, raw), identity

    def _fetch(self, name: str) -> bytes:
        raw = self._fetch_at_most(name, MAX_MANIFEST_BYTES)[0]
        assert raw is not None
        return raw

    def _fetch_at_most(self, name: str, most: int) -> tuple[bytes | None, _Identity]:
        """The bytes of the manifest of `name`, its size checked against the cap before it is
        read (None, nothing read, where it is larger than `most` but within the cap), and the
        identity of the object as stat'd before the read."""
        key = manifest_key(name)
        try:
            info = self.store.stat(key)
            if info.size > MAX_MANIFEST_BYTES:
                raise FormatError(f"checkpoint {name!r} in {self.store.uri}: manifest of "
                                  f"{info.size} bytes is larger than the {MAX_MANIFEST_BYTES} "
                                  "allowed")
            return (None if info.size > most else self.store.get(key)), _identity(info)
        except ObjectNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint {name!r} in {self.store.uri}"
                                          ) from None

    def segment_source(self, written: Mapping[str, bytes] | None = None) -> SegmentSource:
        """Where this store's version-3 manifests read their index blobs: the store, then
        its fallbacks (layout.segments_in); `written` (digest -> bytes: blobs this process
        wrote itself) first."""
        return segments_in([self.store, *self.segment_fallbacks], self.hash, written)

    def _parse(self, name: str, raw: bytes, source: SegmentSource | None = None) -> Manifest:
        """The manifest of `name` parsed from `raw`, its index blobs read from `source`
        (default: `segment_source()`)."""
        try:
            return parse_manifest(raw, name, self.hash,
                                  source if source is not None else self.segment_source())
        except FormatError as exc:
            raise FormatError(f"checkpoint {name!r} in {self.store.uri}: {exc}") from None

    def find_manifest(self, name: str) -> Manifest | None:
        """The manifest of `name`, or None if there is none or it cannot be read (logged)."""
        return find(self.manifest, name)

    def in_turn(self, names: Sequence[str]) -> Iterator[tuple[str, Callable[[str], Manifest]]]:
        """(name, `manifest_of`) for each of `names` in order, where `manifest_of(name)` gives
        what `manifest(name, cache=False)` gives or raises what it raises: for a pass over
        many checkpoints (list, ls, du, gc). A manifest not cached is parsed by that call and
        not kept, so the pass holds one parsed manifest at a time; meanwhile the bytes of the
        next MANIFEST_READ_AHEAD are read side by side (a remote store's round trips
        overlap), at most READ_AHEAD_MANIFEST_BYTES each: a larger one is read in its turn."""
        with self._lock:
            held = [n for n in names if n in self._manifests]
        cached = {n: m for n in held if (m := self._cached(n, touch=False)) is not None}

        def parsed(fetched: Callable[[], tuple[bytes | None, _Identity]], name: str
                   ) -> Manifest:
            raw = fetched()[0]  # raises what reading it raised
            return self._parse(name, raw if raw is not None else self._fetch(name))

        todo = [n for n in names if n not in cached]
        with closing(read_ahead([functools.partial(outcome, functools.partial(
                                     self._fetch_at_most, n, READ_AHEAD_MANIFEST_BYTES))
                                 for n in todo], MANIFEST_READ_AHEAD)) as fetched:
            for name in names:
                got = cached.get(name)
                if got is not None:
                    yield name, functools.partial(_given, got)
                else:
                    yield name, functools.partial(parsed, next(fetched))

    def remember(self, manifest: Manifest, identity: _Identity | None = None) -> None:
        """Cache a manifest this process committed (or read): it equals what any reader
        parses from the object of `identity` (None: stat the object now; a manifest gone
        already is not cached)."""
        if identity is None:
            try:
                identity = _identity(self.store.stat(manifest_key(manifest.name)))
            except ObjectNotFoundError:
                return
        with self._lock:
            self._drop(manifest.name)
            self._manifests[manifest.name] = (manifest, identity)
            self._cached_tensors += len(manifest.tensors)
            while self._cached_tensors > CACHE_TENSORS and len(self._manifests) > 1:
                _name, (evicted, _identity_) = self._manifests.popitem(last=False)
                self._cached_tensors -= len(evicted.tensors)
            if self._seen is not None:
                self._seen[manifest.name] = manifest.created

    def _drop(self, name: str) -> None:
        """Drop the cached manifest of `name`, if any (the lock held)."""
        old = self._manifests.pop(name, None)
        self._cached_tensors -= 0 if old is None else len(old[0].tensors)

    def note_committed(self, name: str, created: float) -> None:
        """A checkpoint committed in this store by someone else (replication)."""
        with self._lock:
            if self._seen is not None:
                self._seen[name] = created

    def forget(self, name: str) -> None:
        """`name` was deleted from this store."""
        with self._lock:
            self._drop(name)
            if self._seen is not None:
                self._seen.pop(name, None)

    # ------------------------------------------------------------------ listing
    def listing(self, problems: list[ManifestProblem] | None = None) -> dict[str, int]:
        """name -> manifest size in bytes, from one listing. Keys that cannot be manifests
        (`._step-1.json`, `step 1.json`, sub-folders) are skipped, or added to `problems`."""
        return {name: info.size for name, info in self._listed(problems).items()}

    def _listed(self, problems: list[ManifestProblem] | None = None) -> dict[str, ObjectInfo]:
        out = {}
        for info in self.store.list(MANIFEST_PREFIX):
            name = name_of_manifest_key(info.key)
            if name is not None:
                out[name] = info
            elif problems is not None:
                problems.append(ManifestProblem(info.key, "not a checkpoint name: ignored"))
        return out

    def exists(self, name: str) -> bool:
        return self.store.exists(manifest_key(name))

    def problems(self) -> list[ManifestProblem]:
        """Every object under checkpoints/ that is not a readable manifest, and why (reads
        every manifest)."""
        problems: list[ManifestProblem] = []
        names = self.listing(problems)
        with cf.ThreadPoolExecutor(METADATA_THREADS) as pool:
            for name, error in zip(names, pool.map(self._manifest_error, names)):
                if error is not None:
                    problems.append(ManifestProblem(manifest_key(name), error))
        return sorted(problems, key=lambda p: p.key)

    def scan(self, problems: list[ManifestProblem]) -> Iterator[Manifest]:
        """Every readable manifest in commit order, each read when the pass reaches it and
        not cached: the pass holds one parsed manifest at a time, whatever the number of
        checkpoints. Once it is over, `problems` has what `problems()` finds (every object
        under checkpoints/ that is not a readable manifest, sorted by key); each manifest is
        read once, for both."""
        found: list[ManifestProblem] = []
        listed = self.listing(found)
        ordered = [name for _created, name in self.order()]
        for name, manifest_of in self.in_turn(ordered):
            manifest = self._scanned(name, manifest_of, found)
            if manifest is not None:
                yield manifest
        # a head that cannot be read: is the rest readable?
        for name, manifest_of in self.in_turn([n for n in listed if n not in set(ordered)]):
            self._scanned(name, manifest_of, found)
        problems.extend(sorted(found, key=lambda p: p.key))

    def _scanned(self, name: str, manifest_of: Callable[[str], Manifest],
                 found: list[ManifestProblem]) -> Manifest | None:
        try:
            return manifest_of(name)
        except CheckpointNotFoundError:
            return None  # deleted meanwhile
        except FormatError as exc:
            found.append(ManifestProblem(manifest_key(name), str(exc)))
            return None

    def _manifest_error(self, name: str) -> str | None:
        try:
            self.manifest(name)
        except CheckpointNotFoundError:
            return None  # deleted meanwhile
        except FormatError as exc:
            return str(exc)
        return None

    # ------------------------------------------------------------------ commit order
    def order(self, *, save_hint: bool = False) -> list[tuple[float, str]]:
        """(created, name) of this store's checkpoints, in commit order (oldest first). The
        first call starts from the commit-order hint (order_hint.py); with `save_hint` (a
        saving process: it writes to the store anyway) the hint is saved again when this call
        had to read more than WRITE_AFTER_HEADS heads."""
        listed = self._listed()
        if not self._hint_read:
            hint = read_hint(self.store)
            with self._lock:
                self._hint_read = True
                self._heads = {**hint, **self._heads}
        with self._lock:
            known = {name: self._heads.get((name, info.size, info.mtime))
                     for name, info in listed.items()}
        unknown = [name for name, c in known.items() if c is None]
        if unknown:
            with cf.ThreadPoolExecutor(METADATA_THREADS) as pool:
                found = list(pool.map(lambda n: self._created(n, listed[n]), unknown))
            known.update(zip(unknown, found))
        order = sorted((c, name) for name, c in known.items() if c is not None)
        heads = {(n, listed[n].size, listed[n].mtime): c for c, n in order}
        with self._lock:
            self._seen = {name: c for c, name in order}
            self._heads = heads
        if save_hint and len(unknown) > WRITE_AFTER_HEADS:
            write_hint(self.store, heads)
        return order

    def newest_whole(self, order: list[tuple[float, str]]) -> str | None:
        """The last name of `order` with a readable manifest: a newest manifest that cannot
        be read (torn, corrupt) is skipped and logged."""
        for _created, name in reversed(order):
            if self.find_manifest(name) is not None:
                return name
        return None

    def known_created(self) -> dict[str, float] | None:
        """{name: created} as last listed, kept up to date with what this process committed
        or deleted here; None if never listed."""
        with self._lock:
            return None if self._seen is None else dict(self._seen)

    def _created(self, name: str, info: ObjectInfo) -> float | None:
        """Creation time of a checkpoint from its manifest's first bytes (or, for a manifest
        not in canonical form, the whole manifest); None if it was deleted meanwhile or
        cannot be read. A cached manifest read from the object `info` lists gives it."""
        with self._lock:
            entry = self._manifests.get(name)
        if entry is not None and entry[1] == _identity(info):
            return entry[0].created
        size = info.size
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
