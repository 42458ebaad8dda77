"""Pure computations behind `ckpt ls`, `show`, `du` and `diff`: no I/O, manifests in, values out.

* Leaves: every tensor and plain value of a checkpoint by dotted key (the key `load(keys=...)`
  takes). OrderedDict `_metadata` (torch's module version records) is not listed.
* Sizes: a blob's stored size is taken from a store listing when one is given, else from the
  manifests (the furthest byte any chunk uses, exact unless a pack blob's tail members are
  referenced only by deleted checkpoints).
* "Unique" bytes of a checkpoint are the stored bytes of the blobs no other checkpoint
  references: what deleting it (and then running gc) frees.
* Diffs compare raw-content digests only (no tensor data is read), so a change of codec is not
  a change; tensors chunked differently cannot be compared by digest and count as changed.
* Space accounting (`usage`, `live_bytes`) also takes manifests one at a time (`UsageScan`):
  `ckpt ls` and `du` stream a repository's manifests through it, two parsed at a time, each
  distinct index segment read once.
"""

from __future__ import annotations

import fnmatch
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import FormatError
from ..format import dtypes
from ..format.manifest import (
    Manifest,
    SegmentExtents,
    TensorEntry,
    fold_extents,
    with_next_read_ahead,
)
from ..format.segment_encoding import ChunkTable
from ..format.tree import CONTAINERS, children, key_string, node_kind


# --------------------------------------------------------------------------- leaves
@dataclass(frozen=True)
class Leaf:
    """One leaf of a checkpoint's state tree. `entry` is set for arrays (torch, numpy, bytes),
    `node` (the typed tree node) for plain values; `alias_of` names the first key of an array
    that appears at several keys (the same object saved twice, e.g. tied weights)."""

    key: str
    entry: TensorEntry | None = None
    node: Any = None
    alias_of: str | None = None

    @property
    def is_tensor(self) -> bool:
        return self.entry is not None


def leaves(manifest: Manifest) -> list[Leaf]:
    """Every leaf in tree order."""
    out: list[Leaf] = []
    first: dict[int, str] = {}

    def walk(node: Any, path: tuple[str | int, ...]) -> None:
        kind, value = node_kind(node)
        if kind in ("dict", "odict"):
            for (_t, k), child in value:
                walk(child, (*path, k))
        elif kind in ("list", "tuple"):
            for i, child in enumerate(value):
                walk(child, (*path, i))
        elif kind in ("tensor", "bytes"):
            key = key_string(path)
            alias = first.setdefault(value, key)
            out.append(Leaf(key, entry=manifest.tensors[value],
                            alias_of=None if alias == key else alias))
        else:
            out.append(Leaf(key_string(path), node=node))

    walk(manifest.tree, ())
    return out


def key_matcher(patterns: Iterable[str] | None) -> Callable[[str], bool]:
    """A predicate for dotted keys: a pattern with glob characters (`*?[`) is matched with
    fnmatch (case-sensitive); a plain pattern matches that key and everything below it."""
    pats = list(patterns or [])
    if not pats:
        return lambda key: True

    def match(key: str) -> bool:
        for p in pats:
            if any(ch in p for ch in "*?["):
                if fnmatch.fnmatchcase(key, p):
                    return True
            elif key == p or key.startswith(p + "."):
                return True
        return False

    return match


def value_of(node: Any) -> tuple[str, Any]:
    """(type name, JSON-safe value) of a plain-value tree node. Non-finite floats become the
    strings 'nan', 'inf', '-inf'."""
    kind, value = node_kind(node)
    if kind == "none":
        return "None", None
    if kind in ("bool", "int", "str"):
        return {"bool": "bool", "int": "int", "str": "str"}[kind], value
    if kind == "float":
        return "float", _json_float(float.fromhex(value))
    if kind == "np_scalar":
        dt = dtypes.by_name(value[0])
        scalar = np.frombuffer(bytes.fromhex(value[1]), dtype=dt.numpy_dtype)[0].item()
        if isinstance(scalar, float):
            scalar = _json_float(scalar)
        elif isinstance(scalar, complex):
            scalar = [_json_float(scalar.real), _json_float(scalar.imag)]
        return f"numpy.{dt.name}", scalar
    return kind, None  # empty containers are not leaves; unreachable for validated trees


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else repr(x)


def describe_tensor(entry: TensorEntry) -> dict[str, Any]:
    """Stable JSON description of one stored array."""
    return {
        "kind": entry.kind, "dtype": entry.dtype.name, "shape": list(entry.shape),
        "bytes": entry.nbytes, "chunks": len(entry.chunks),
        "stored_bytes": sum(c.size for c in entry.chunks),
        "codec": None if entry.codec is None else f"{entry.codec.id}:{entry.codec.level}",
    }


# --------------------------------------------------------------------------- sizes
def blob_extents(manifests: Iterable[Manifest]) -> dict[str, int]:
    """Blob digest -> the furthest byte any of these manifests uses in it
    (`Manifest.blob_extents`), each distinct index segment read once, the next manifest's
    while one is taken in (SegmentExtents, `with_next_read_ahead`)."""
    segments = SegmentExtents()
    ext: dict[str, int] = {}
    for m in with_next_read_ahead(manifests, segments.read):
        fold_extents(ext, segments.of(m))
    return ext


def live_bytes(manifests: Iterable[Manifest]) -> int:
    """Stored bytes of the distinct chunks these manifests reference (a byte range of a pack
    counts, not the whole pack): what the checkpoints need, against what their blobs hold."""
    scan = UsageScan(live=True)
    for _m in scan.added(manifests):
        pass
    return scan.live_bytes


@dataclass(frozen=True)
class CheckpointUsage:
    name: str
    logical_bytes: int  # raw bytes of its arrays (a tied tensor counts once)
    referenced_bytes: int  # stored bytes of the distinct blobs it references
    unique_bytes: int  # stored bytes only it references: what deleting it frees
    blobs: int
    unique_blobs: int


@dataclass(frozen=True)
class StoreUsage:
    checkpoints: tuple[CheckpointUsage, ...]
    logical_bytes: int  # summed over checkpoints
    referenced_bytes: int  # stored bytes of every blob some checkpoint references
    referenced_blobs: int
    #: listing-only figures (None without `blob_sizes`)
    blob_bytes: int | None = None
    blobs: int | None = None
    unreferenced_blobs: int | None = None
    unreferenced_bytes: int | None = None
    missing_blobs: tuple[str, ...] = ()

    @property
    def dedup_ratio(self) -> float:
        """Logical bytes per stored byte (above 1: dedup or compression saves space)."""
        if self.referenced_bytes == 0:
            return 1.0 if self.logical_bytes == 0 else math.inf
        return self.logical_bytes / self.referenced_bytes


class UsageScan:
    """`usage` and `live_bytes` over manifests given one at a time (`add`, or `added` over
    many: the next one's segments read meanwhile), so that a pass over a repository holds
    two parsed manifests at a time: of each checkpoint it keeps its name, logical bytes and
    the blobs it references; over all, the furthest byte any chunk uses in each blob,
    (`live`) the distinct chunk ranges, and the extents of each distinct index segment, read
    once however many checkpoints name it (SegmentExtents). Digests are interned: a blob many
    checkpoints share is one string."""

    def __init__(self, *, live: bool = False, skip_unreadable: bool = False) -> None:
        self._rows: list[tuple[str, int, frozenset[str]]] = []
        #: with `skip_unreadable`: (name, why) of each checkpoint left out of the accounting
        #: because an index blob of it cannot be read (FormatError: missing or damaged);
        #: without, that FormatError is raised
        self.unreadable: list[tuple[str, str]] = []
        self._skip_unreadable = skip_unreadable
        self._extents: dict[str, int] = {}
        self._segments = SegmentExtents()  # each distinct index segment read once
        self._ranges: set[tuple[str, int, int]] | None = set() if live else None

    def add(self, manifest: Manifest) -> bool:
        """Account one checkpoint: the blobs of its chunks and of its index segments (version
        3: read as chunk tables, no entries built; a segment an earlier checkpoint named is
        not read again). False if it was left out (`unreadable`)."""
        ext, ranges, name = self._extents, self._ranges, self._segments.name

        def chunk_ranges(table: ChunkTable) -> None:
            if ranges is not None:  # (blob names interned once per table)
                ranges.update(replace(table, blobs=tuple(map(name, table.blobs))).ranges())

        try:
            blobs = self._segments.of(manifest, chunk_ranges)
        except FormatError as exc:
            if not self._skip_unreadable:
                raise
            self.unreadable.append((manifest.name, " ".join(str(exc).split())))
            return False
        fold_extents(ext, blobs)
        if ranges is not None:
            ranges.update((name(r.digest), 0, r.size) for r in manifest.segment_refs())
        self._rows.append((manifest.name, manifest.logical_bytes, frozenset(blobs)))
        return True

    def added(self, manifests: Iterable[Manifest]) -> Iterator[Manifest]:
        """`add` each of `manifests`, then give it to the caller (a listing's rows) unless it
        was left out; the next one's segments not read yet are read meanwhile
        (`with_next_read_ahead`)."""
        for manifest in with_next_read_ahead(manifests, self._segments.read):
            if self.add(manifest):
                yield manifest

    @property
    def live_bytes(self) -> int:
        """See `live_bytes` (needs `live=True`)."""
        if self._ranges is None:
            raise ValueError("UsageScan(live=True) keeps the chunk ranges live_bytes needs")
        return sum(size for _blob, _offset, size in self._ranges)

    def usage(self, blob_sizes: Mapping[str, int] | None = None) -> StoreUsage:
        """See `usage`."""
        sizes = dict(self._extents)
        missing: list[str] = []
        if blob_sizes is not None:
            missing = sorted(b for b in sizes if b not in blob_sizes)
            sizes.update({b: blob_sizes[b] for b in sizes if b in blob_sizes})
        refcount: Counter[str] = Counter()
        for _name, _logical, blobs in self._rows:
            refcount.update(blobs)
        rows = []
        for name, logical, blobs in self._rows:
            unique = [b for b in blobs if refcount[b] == 1]
            rows.append(CheckpointUsage(
                name=name, logical_bytes=logical,
                referenced_bytes=sum(sizes[b] for b in blobs),
                unique_bytes=sum(sizes[b] for b in unique),
                blobs=len(blobs), unique_blobs=len(unique)))
        referenced = set(refcount)
        result = StoreUsage(
            checkpoints=tuple(rows), logical_bytes=sum(r[1] for r in self._rows),
            referenced_bytes=sum(sizes[b] for b in referenced),
            referenced_blobs=len(referenced))
        if blob_sizes is None:
            return result
        unref = [b for b in blob_sizes if b not in referenced]
        return StoreUsage(
            checkpoints=result.checkpoints, logical_bytes=result.logical_bytes,
            referenced_bytes=result.referenced_bytes, referenced_blobs=result.referenced_blobs,
            blob_bytes=sum(blob_sizes.values()), blobs=len(blob_sizes),
            unreferenced_blobs=len(unref), unreferenced_bytes=sum(blob_sizes[b] for b in unref),
            missing_blobs=tuple(missing))


def usage(manifests: list[Manifest], blob_sizes: Mapping[str, int] | None = None) -> StoreUsage:
    """Space accounting over a repository's manifests (see the module docstring)."""
    scan = UsageScan()
    for _m in scan.added(manifests):
        pass
    return scan.usage(blob_sizes)


def stored_bytes(manifest: Manifest) -> int:
    """Stored bytes of the distinct blobs one checkpoint references (from its own manifest)."""
    return sum(blob_extents([manifest]).values())


# --------------------------------------------------------------------------- diff
@dataclass(frozen=True)
class Change:
    key: str
    detail: str


@dataclass(frozen=True)
class ManifestDiff:
    """Keys of B relative to A. `same` ignores user metadata (reported in `metadata`)."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[Change, ...]
    unchanged: tuple[str, ...]
    metadata: dict[str, tuple[Any, Any]]  # user-metadata key -> (value in A, value in B)

    @property
    def same(self) -> bool:
        return not (self.added or self.removed or self.changed)


def _tensor_change(a: TensorEntry, b: TensorEntry) -> str | None:
    """Why two stored arrays differ, or None if their contents are equal by digest."""
    if a.kind != b.kind:
        return f"kind {a.kind} -> {b.kind}"
    if a.dtype.name != b.dtype.name:
        return f"dtype {a.dtype.name} -> {b.dtype.name}"
    if a.shape != b.shape:
        return f"shape {list(a.shape)} -> {list(b.shape)}"
    if a.requires_grad != b.requires_grad or a.parameter != b.parameter:
        return "requires_grad/Parameter flag differs"
    da = [c.digest for c in a.chunks]
    db = [c.digest for c in b.chunks]
    if a.block_shape() != b.block_shape() and len(da) + len(db) > 2:
        return "chunked differently: contents not comparable by digest"
    n = sum(x != y for x, y in zip(da, db))
    if n:
        return f"{n} of {len(da)} chunk(s) differ"
    return None


def diff(a: Manifest, b: Manifest) -> ManifestDiff:
    """Compare two checkpoints by dotted key, from their manifests alone: tensors by their
    chunks' digests (so both must be named by one hash algorithm: ValueError otherwise),
    plain values by value, and the containers holding them (kind, key types, empty ones)."""
    if a.hash != b.hash:
        raise ValueError(f"cannot compare {a.name!r} and {b.name!r} by digest: their "
                         f"repositories hash with {a.hash} and {b.hash} (load both and "
                         "compare the values)")
    la = {leaf.key: leaf for leaf in leaves(a)}
    lb = {leaf.key: leaf for leaf in leaves(b)}
    added = tuple(k for k in lb if k not in la)
    removed = tuple(k for k in la if k not in lb)
    changed: list[Change] = []
    unchanged: list[str] = []
    for key, x in la.items():
        y = lb.get(key)
        if y is None:
            continue
        why: str | None
        if x.entry is not None and y.entry is not None:
            why = _tensor_change(x.entry, y.entry)
        elif x.entry is not None or y.entry is not None:
            why = "array <-> plain value"
        else:
            ta, va = value_of(x.node)
            tb, vb = value_of(y.node)
            why = None if x.node == y.node else (
                f"{ta} -> {tb}" if ta != tb else f"{_short(va)} -> {_short(vb)}")
        if why is None:
            unchanged.append(key)
        else:
            changed.append(Change(key, why))
    ca, cb = containers(a.tree), containers(b.tree)
    for key in sorted(set(ca) | set(cb)):
        was, now = ca.get(key), cb.get(key)
        if was == now or ((was is None or now is None)  # one side absent: its leaves are
                          and not (was or now or "").startswith("empty")):  # added/removed
            continue
        changed.append(Change(key or "(root)", f"{was or 'absent'} -> {now or 'absent'}"))
    meta: dict[str, tuple[Any, Any]] = {}
    for k in sorted(set(a.metadata) | set(b.metadata)):
        va, vb = a.metadata.get(k), b.metadata.get(k)
        if va != vb or (k in a.metadata) != (k in b.metadata):
            meta[k] = (va, vb)
    return ManifestDiff(added, removed, tuple(changed), tuple(unchanged), meta)


def containers(tree: Any) -> dict[str, str]:
    """Dotted key -> what the container there is: its kind and its keys' types (`dict with
    int keys`), marked `empty` when it holds nothing: what dotted keys alone do not tell."""
    out: dict[str, str] = {}

    def walk(node: Any, key: str) -> None:
        kind, value = node_kind(node)
        if kind not in CONTAINERS:
            return
        items = list(children(kind, value))
        what = kind
        if kind in ("dict", "odict"):
            types = sorted({"int" if isinstance(k, int) else "str" for k, _child in items})
            what += f" with {' and '.join(types)} keys" if types else ""
        out[key] = what if items else f"empty {what}"
        for name, child in items:
            walk(child, f"{key}.{name}" if key else str(name))

    walk(tree, "")
    return out


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
