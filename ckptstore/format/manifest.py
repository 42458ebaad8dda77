"""Manifests: the commit record of one checkpoint, as sealed canonical JSON (docs/format.md).

This module holds the model (Manifest, TensorEntry, ChunkRef, StorageRef), the rules a tensor
entry obeys (`entry_problem`, the one statement of them) and the writer (`Manifest.to_bytes`);
`manifest_parse` reads untrusted bytes. Every tensor entry is a zarr v3 array metadata document
whose `attributes["ckptstore"]` holds what ckptstore needs.

Why one module: the manifest model and every rule an entry must satisfy (`entry_problem`),
which the parser and the writer both apply; the rules refer to each other.
"""

from __future__ import annotations

import itertools
import json
import json.encoder
import math
import re
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Self, overload

import numpy as np

from ..collector import paused_collector
from ..errors import FormatError
from .canonical import canonical_str, seal
from .codecs import Codec
from .dtypes import DTYPES, DType
from .hashing import HASH_NAME, hash_algorithm
from .segment_encoding import (
    DIGEST_BYTES,
    ChunkTable,
    EncodedSegment,
    IndexBlob,
    SegmentRef,
    TreeRef,
    segment_blobs,
)
from .tree_pages import paginate

_json_str = json.encoder.encode_basestring  # json.dumps' string writer (ensure_ascii=False)
FORMAT_NAME = "ckptstore.manifest"
#: Version 2 = version 1 + a self-digest (canonical.seal) as the last field.
FORMAT_VERSION = 2
#: Version 3 = version 2 with the tensor entries moved into index segments (segments.py) and
#: the state tree into a blob of its own: what large manifests are written as
#: (segments.is_segmented).
SEGMENTED_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MAX_MANIFEST_BYTES = 1 << 30
MAX_TREE_DEPTH = 256
MAX_DIMS = 64
#: No chunk may declare more raw bytes than this (bounds any single allocation on read).
MAX_CHUNK_BYTES = 1 << 34
#: No tensor or shared storage may declare more bytes than this (1 PiB), counting every
#: dimension as at least 1, so that shape arithmetic never overflows an allocator.
MAX_TENSOR_BYTES = 1 << 50
TENSOR_KINDS = ("torch", "numpy", "bytes")


@dataclass(frozen=True)
class ChunkRef:
    """Where one row block's bytes live: `size` stored bytes at `offset` in blob `blob`, which
    decode to `nbytes` raw bytes whose digest is `digest`."""

    blob: str
    offset: int
    size: int
    nbytes: int
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"blob": self.blob, "offset": self.offset, "size": self.size,
                "nbytes": self.nbytes, "digest": self.digest}


#: Entries of more chunks than this, read from an index segment or built from a collective
#: save's rows, keep them as columns (ChunkRows): a ChunkRef is built only for a chunk that
#: is used. Smaller ones get their ChunkRefs at once (cheaper for an entry of few chunks).
ROWS_ABOVE = 64


class HexNames(Sequence[str]):
    """Hex names of raw 16-byte digests (a segment's blob table), each made when it is asked
    for: a table of a million blobs, of which a reader uses a few."""

    def __init__(self, raw: bytes | memoryview) -> None:
        self._raw = raw

    def __len__(self) -> int:
        return len(self._raw) // DIGEST_BYTES

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...

    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._raw[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES].hex()


class ChunkSequence(Sequence[ChunkRef]):
    """A read-only sequence of chunk references held other than as ChunkRefs: a subclass
    gives `__len__` and `_at(j)` (0 <= j < len); indexing (negative, slices), equality with
    any sequence of the same ChunkRefs, hashing and copies are stated here once."""

    __slots__ = ()

    def _at(self, j: int) -> ChunkRef:
        raise NotImplementedError

    @overload
    def __getitem__(self, j: int) -> ChunkRef: ...
    @overload
    def __getitem__(self, j: slice) -> tuple[ChunkRef, ...]: ...

    def __getitem__(self, j: int | slice) -> ChunkRef | tuple[ChunkRef, ...]:
        if isinstance(j, slice):
            return tuple(self[k] for k in range(*j.indices(len(self))))
        if j < 0:
            j += len(self)
        if not 0 <= j < len(self):
            raise IndexError(j)
        return self._at(j)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or len(other) != len(self):
            return False
        return all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __copy__(self) -> Self:  # read-only: a copy is the same rows
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        return self


class ChunkRows(ChunkSequence):
    """The chunk references of one tensor entry as views of an index segment's columns
    (segments.py): chunk j's ChunkRef is built when it is used. A reader that needs a few
    chunks of a tensor held in thousands (a rank's own part of a sharded checkpoint) builds
    a few objects, not one per chunk. Equal to any sequence of the same ChunkRefs; its rules
    are checked on the columns at once (`first_bad`, for `entry_problem`)."""

    __slots__ = ("_blobs", "_digests", "_index", "_nbytes", "_offsets", "_sizes")

    def __init__(self, blobs: Sequence[str], columns: Sequence[np.ndarray],
                 digests: bytes | memoryview) -> None:
        """`columns`: blob index (into `blobs`), offset, size, nbytes of each chunk;
        `digests`: their raw digests, 16 bytes each, in order."""
        self._blobs = blobs
        self._index, self._offsets, self._sizes, self._nbytes = columns
        self._digests = digests

    def __len__(self) -> int:
        return len(self._index)

    def _at(self, j: int) -> ChunkRef:
        w = DIGEST_BYTES
        return ChunkRef(self._blobs[int(self._index[j])], int(self._offsets[j]),
                        int(self._sizes[j]), int(self._nbytes[j]),
                        self._digests[j * w:(j + 1) * w].hex())

    def __iter__(self) -> Iterator[ChunkRef]:
        names, raw, w = self._blobs, self._digests.hex(), 2 * DIGEST_BYTES
        columns = zip(self._index.tolist(), self._offsets.tolist(), self._sizes.tolist(),
                      self._nbytes.tolist())
        for j, (b, offset, size, nbytes) in enumerate(columns):
            yield ChunkRef(names[b], offset, size, nbytes, raw[j * w:(j + 1) * w])

    def __repr__(self) -> str:
        return f"ChunkRows({len(self)} chunks)"

    def first_bad(self, want: np.ndarray, codec: Codec | None) -> int | None:
        """The first chunk breaking a rule `_chunk_problems` states (its ranges, `want[j]` raw
        bytes, stored size against its codec), or None."""
        found = np.flatnonzero(rows_bad(self._offsets, self._sizes, self._nbytes, want,
                                        codec is None))
        return int(found[0]) if len(found) else None


def rows_bad(offsets: np.ndarray, sizes: np.ndarray, nbytes: np.ndarray, want: np.ndarray,
             raw: bool | np.ndarray) -> np.ndarray:
    """Which chunk rows (columns of a segment) break a rule `_chunk_problems` states: their
    ranges, `want` raw bytes each, and the stored size against the codec (`raw`: no codec,
    one flag for all rows or one per row)."""
    bad: np.ndarray = ((offsets > _HI) | (sizes > 2 * MAX_CHUNK_BYTES)
                       | (nbytes > MAX_CHUNK_BYTES) | (nbytes != want))
    coded_bad: np.ndarray = (offsets != 0) | (sizes > 2 * nbytes + 65536)
    size_bad: np.ndarray = sizes != nbytes
    out: np.ndarray
    if raw is True:
        out = bad | size_bad
    elif raw is False:
        out = bad | coded_bad
    else:
        out = bad | np.where(raw, size_bad, coded_bad)
    return out


class LazyChunks(ChunkSequence):
    """The chunk references of one entry read where they are used (a parted index segment's:
    segments.PartedRows). `entry_problem` checks their count; the rows' own rules are checked
    by whoever reads them, before any is handed out (FormatError from the access)."""

    __slots__ = ()


@dataclass(frozen=True)
class StorageRef:
    """Tensors sharing one torch storage: the view's element offset and strides into a storage
    of `nbytes` bytes identified by `id` within the manifest."""

    id: int
    nbytes: int
    offset: int
    stride: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "nbytes": self.nbytes, "offset": self.offset,
                "stride": list(self.stride)}


@dataclass(frozen=True)
class TensorEntry:
    """One stored array, split into a regular grid of chunks listed in C order of their grid
    position. By default the chunks are row blocks: `chunk_rows` rows of dim 0 each (0-d
    arrays: one chunk). With `chunk_shape` (an N-D grid, e.g. written by a job that sharded
    dim 1) each chunk is the C-order block of that shape at its grid position, cut at the
    array's edges; `chunk_shape[0] == chunk_rows` always."""

    key: str
    kind: str
    dtype: DType
    shape: tuple[int, ...]
    chunk_rows: int
    codec: Codec | None
    chunks: tuple[ChunkRef, ...] | ChunkRows | LazyChunks  # see ChunkRows, LazyChunks
    requires_grad: bool = False
    parameter: bool = False
    storage: StorageRef | None = None
    chunk_shape: tuple[int, ...] | None = None  # None: row blocks (chunk_rows, *shape[1:])

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def is_grid(self) -> bool:
        """True if chunks split some dimension other than dim 0 (an N-D chunk grid)."""
        return self.chunk_shape is not None

    def block_shape(self) -> tuple[int, ...]:
        """The full shape of one chunk (edge chunks are cut to the array)."""
        if self.chunk_shape is not None:
            return self.chunk_shape
        return (self.chunk_rows, *self.shape[1:]) if self.shape else ()

    def chunk_region(self, index: int) -> tuple[tuple[int, int], ...]:
        """[start, stop) per dimension of chunk `index` (0-d: ())."""
        return chunk_region(self.shape, self.block_shape(), index)

    def chunks_over(self, region: Sequence[tuple[int, int]]
                    ) -> Iterator[tuple[int, tuple[tuple[int, int], ...], tuple[slice, ...]]]:
        """The chunks a box `region` ([start, stop) per dimension) meets, in C order: each
        chunk's index, the part of the box it holds (global [start, stop) per dimension) and
        that part as slices of the chunk's own block."""
        for index in chunks_meeting(self.shape, self.block_shape(), region):
            creg = self.chunk_region(index)
            inter = tuple((max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(creg, region))
            if any(a >= b for a, b in inter):
                continue
            yield index, inter, tuple(slice(a - c0, b - c0)
                                      for (a, b), (c0, _c1) in zip(inter, creg))

    def chunk_alone(self, index: int, extents: tuple[int, ...]) -> TensorEntry:
        """An entry describing chunk `index` alone, as a tensor of its own `extents` (its
        region's sizes): a reader given it fills exactly that chunk's elements."""
        return replace(self, shape=extents, chunk_rows=max(1, extents[0]) if extents else 1,
                       chunks=(self.chunks[index],), storage=None, chunk_shape=None)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    def chunk_count(self) -> int:
        return expected_chunk_count(self.shape, self.chunk_rows, self.dtype.itemsize,
                                    self.chunk_shape)

    def chunk_rows_range(self, index: int) -> tuple[int, int]:
        """Rows [start, stop) of dim 0 held by chunk `index` (0-d: (0, 1))."""
        if not self.shape:
            return (0, 1)
        start = index * self.chunk_rows
        return (start, min(self.shape[0], start + self.chunk_rows))

    def zarr_chunk_shape(self) -> list[int]:
        if not self.shape:
            return []
        if self.chunk_shape is not None:
            return list(self.chunk_shape)
        return [max(1, self.chunk_rows)] + [max(1, d) for d in self.shape[1:]]

    def to_json(self) -> dict[str, Any]:
        """Zarr v3 array metadata carrying ckptstore's fields in attributes."""
        itemsize = self.dtype.itemsize
        bytes_codec: dict[str, Any] = {"name": "bytes"}
        if itemsize > 1:
            bytes_codec["configuration"] = {"endian": "little"}
        codecs = [bytes_codec]
        if self.codec is not None:
            codecs.append(self.codec.zarr_codec(itemsize))
        kind = self.dtype.numpy_dtype.kind
        fill: Any = False if kind == "b" else ([0.0, 0.0] if kind == "c" else 0)
        attrs: dict[str, Any] = {
            "key": self.key, "kind": self.kind, "dtype": self.dtype.name,
            "chunk_rows": self.chunk_rows,
            "codec": None if self.codec is None else self.codec.to_json(),
            "chunks": [c.to_json() for c in self.chunks],
        }
        if self.kind == "torch":
            attrs["requires_grad"] = self.requires_grad
            attrs["parameter"] = self.parameter
        if self.storage is not None:
            attrs["storage"] = self.storage.to_json()
        if self.chunk_shape is not None:
            attrs["chunk_shape"] = list(self.chunk_shape)
        return {
            "zarr_format": 3, "node_type": "array", "shape": list(self.shape),
            "data_type": self.dtype.zarr_data_type,
            "chunk_grid": {"name": "regular",
                           "configuration": {"chunk_shape": self.zarr_chunk_shape()}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": fill, "codecs": codecs, "attributes": {"ckptstore": attrs},
        }


def extent_ok(shape: tuple[int, ...], itemsize: int, storage_nbytes: int = 0) -> bool:
    """The size rule for tensors: every dimension counted as at least 1, the tensor (and its
    storage) stays within MAX_TENSOR_BYTES."""
    elements = math.prod(shape) or math.prod(max(1, n) for n in shape)  # empty: rare
    return elements * itemsize <= MAX_TENSOR_BYTES and storage_nbytes <= MAX_TENSOR_BYTES


def expected_chunk_count(shape: tuple[int, ...], chunk_rows: int, itemsize: int,
                         chunk_shape: tuple[int, ...] | None = None) -> int:
    if not shape:
        return 1
    if math.prod(shape) * itemsize == 0:
        return 0
    if chunk_shape is not None:
        return math.prod(-(-n // c) for n, c in zip(shape, chunk_shape))
    return -(-shape[0] // chunk_rows)


def chunks_meeting(shape: tuple[int, ...], block: tuple[int, ...],
                   region: Sequence[tuple[int, int]]) -> Iterator[int]:
    """The indexes, in C order, of the chunks of the regular grid of `block`s over `shape`
    whose grid cells meet the box `region` ([start, stop) per dimension)."""
    grid = [max(1, -(-n // c)) for n, c in zip(shape, block)]
    per_dim = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(region, block)]
    for pos in itertools.product(*per_dim):
        index = 0
        for p, g in zip(pos, grid):
            index = index * g + p
        yield index


def chunk_region(shape: tuple[int, ...], block: tuple[int, ...], index: int
                 ) -> tuple[tuple[int, int], ...]:
    """[start, stop) per dimension of chunk `index` of the regular grid of `block`s over
    `shape`, chunks numbered in C order of their grid position."""
    out: list[tuple[int, int]] = []
    for n, c in zip(reversed(shape), reversed(block)):
        per = max(1, -(-n // c))
        index, pos = divmod(index, per)
        out.append((pos * c, min(n, (pos + 1) * c)))
    return tuple(reversed(out))


class LazyTree:
    """The state tree of a version-3 manifest read from a store, before its first use: `ref`
    names its blob (and `pages` those of its paged containers, tree_pages.py); `value()`
    reads and validates it through `load` on its first call, once
    (FormatError if it cannot; a later call tries again). Given as `Manifest(tree=...)`, it
    is what the manifest's `tree` returns."""

    def __init__(self, ref: TreeRef, load: Callable[[], Any], pages: Sequence[TreeRef] = ()
                 ) -> None:
        self.ref = ref
        self.pages = tuple(pages)  # the blobs of its paged containers, as the root lists them
        self._load = load
        self._lock = threading.Lock()
        self._value: Any = None
        self._loaded = False

    def value(self) -> Any:
        with self._lock:
            if not self._loaded:
                self._value = self._load()
                self._loaded = True
            return self._value


class _TreeField:
    """`Manifest.tree`: the tree itself, or the value of a LazyTree once first used."""

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            raise AttributeError("tree")  # a field without a default
        value = obj.__dict__["_tree"]
        if isinstance(value, LazyTree):
            value = value.value()
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__["_tree"] = value


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint. `tree` is the typed state tree (see tree.py); tensor leaves point
    into `tensors` by index. `tensors` is a tuple, or for a version-3 manifest read from a
    store a `segments.SegmentedEntries` that reads its index segments as they are used; its
    tree, a blob of its own, is read when `tree` is first used (LazyTree)."""

    name: str
    created: float  # POSIX seconds, UTC
    metadata: dict[str, Any]
    tree: Any = _TreeField()  # required: a descriptor field (its class access raises)
    tensors: Sequence[TensorEntry]  # type: ignore[misc]  # follows no default (see tree)
    parent: str | None = None
    version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    hash: str = HASH_NAME  # the repository's hash algorithm: chunk digests and the seal

    @property
    def logical_bytes(self) -> int:
        if self.version >= SEGMENTED_VERSION:  # from the root alone
            return sum(r.nbytes for r in self.segment_refs())
        return sum(t.nbytes for t in self.tensors)

    def blob_digests(self, known_segments: Collection[str] = ()) -> set[str]:
        """Every blob the checkpoint needs: its chunks' and (version 3) its index blobs.
        `known_segments`: index segments whose blobs the caller holds already (a segment is
        named by its content, so the same digest names the same chunks): they are not read,
        and the blobs only they name are left out (`BlobUnion`)."""
        return set(self.blob_extents(self.chunk_tables(known_segments)))

    def blob_extents(self, tables: Iterable[ChunkTable] | None = None) -> dict[str, int]:
        """{blob: the bytes of it the checkpoint uses}: the furthest chunk's offset + size,
        an index blob whole (a copy of a blob shorter than that cannot serve it).
        `tables`: this manifest's `chunk_tables()` where the caller already has them."""
        ext = {r.digest: r.size for r in self.index_blobs()}
        if self.version >= SEGMENTED_VERSION and getattr(self.tensors, "refs", None) is None:
            # entries in memory (a writer's): the parts of its parted segments, computed
            ext.update((r.digest, r.size) for e in self.segment_blobs() for r, _d in e.parts)
        for table in self.chunk_tables() if tables is None else tables:
            fold_extents(ext, table.parts_and_extents())  # parts: read from a store
        return ext

    def chunk_tables(self, skip: Collection[str] = ()) -> Iterator[ChunkTable]:
        """Every chunk reference as columns: one table per index segment (version 3 read from
        a store: its segments' bytes, no entries built; those whose digest is in `skip` left
        out, unread), else one for all the entries. For passes over many checkpoints (space
        accounting, gc)."""
        tables = getattr(self.tensors, "chunk_tables", None)
        if tables is not None:
            yield from tables(skip)
        else:
            yield ChunkTable.of(self.tensors)

    def index_read_ahead(self, workers: int, skip: Collection[str] = ()
                         ) -> AbstractContextManager[None]:
        """A block in which this manifest's index segments (version 3 read from a store) are
        read ahead, for a pass inside it (`chunk_tables`, the entries) to take: see
        `SegmentedEntries.bytes_read_ahead` (`skip`: digests of segments not to read).
        Nothing is read ahead otherwise."""
        ahead = getattr(self.tensors, "bytes_read_ahead", None)
        return nullcontext() if ahead is None else ahead(workers, skip=skip)

    def segment_refs(self) -> list[SegmentRef]:
        """The index segments of a version-3 manifest, in order ([] for earlier versions)."""
        if self.version < SEGMENTED_VERSION:
            return []
        refs = getattr(self.tensors, "refs", None)
        if refs is not None:  # read from a store: as its root lists them
            return list(refs)
        return [encoded.ref for encoded in self.segment_blobs()]

    def index_blobs(self) -> list[IndexBlob]:
        """The blobs of a version-3 manifest's index its root names: its segments, then its
        tree and the pages of the tree's paged containers ([] for earlier versions). They are
        blobs like chunks: gc keeps them, copies carry them. The parts of parted segments
        are named by their heads, not the root: `blob_extents` has them too."""
        if self.version < SEGMENTED_VERSION:
            return []
        return [*self.segment_refs(), self.tree_ref(), *self.tree_page_refs()]

    def tree_ref(self) -> TreeRef:
        """Version 3: the blob of the state tree (as the root names it, or computed from the
        tree in memory)."""
        value = self.__dict__["_tree"]
        if isinstance(value, LazyTree):
            return value.ref
        return self.tree_blob()[0]

    def tree_page_refs(self) -> list[TreeRef]:
        """Version 3: the page blobs of the tree's paged containers (tree_pages.py), as the
        root lists them or computed from the tree in memory."""
        value = self.__dict__["_tree"]
        if isinstance(value, LazyTree):
            return list(value.pages)
        return [ref for ref, _data in self._tree_blobs()[1:]]

    def tree_blob(self) -> tuple[TreeRef, bytes]:
        """Version 3, tree in memory (a writer's manifest): the tree's blob and its bytes, the
        canonical JSON of the tree with its wide containers paged, computed once."""
        return self._tree_blobs()[0]

    def _tree_blobs(self) -> list[tuple[TreeRef, bytes]]:
        """The tree's blob, then its pages' (tree_pages.paginate), computed once."""
        blobs = self.__dict__.get("_tree_blob_data")
        if blobs is None:
            digest = hash_algorithm(self.hash).digest
            top, pages = paginate(self.tree, digest)
            data = canonical_str(top).encode()
            blobs = [(TreeRef(digest(data), len(data)), data), *pages]
            for ref, _data in blobs:
                if ref.size > MAX_MANIFEST_BYTES:
                    raise FormatError(f"checkpoint {self.name!r}: a blob of its state tree "
                                      f"would be {ref.size} bytes, more than the "
                                      f"{MAX_MANIFEST_BYTES} a reader accepts; nothing was "
                                      "committed")
            object.__setattr__(self, "_tree_blob_data", blobs)
        return blobs

    def index_blob_data(self) -> list[tuple[IndexBlob, bytes]]:
        """Version 3, in memory (a writer's manifest): each index blob (`index_blobs`, and the
        parts of parted segments) and its bytes; [] for earlier versions. FormatError if one
        would be too large."""
        if self.version < SEGMENTED_VERSION:
            return []
        if getattr(self.tensors, "refs", None) is not None:  # segments already stored (a
            return [*self._tree_blobs()]  # collective save's, written by the ranks)
        return [*(b for encoded in self.segment_blobs() for b in encoded.blobs()),
                *self._tree_blobs()]

    def segment_blobs(self) -> list[EncodedSegment]:
        """Version 3, entries in memory (a writer's manifest): each index segment and its
        bytes, computed once. FormatError if a segment would be too large."""
        blobs = self.__dict__.get("_segment_blobs")
        if blobs is None:
            blobs = segment_blobs(self.tensors, hash_algorithm(self.hash))
            object.__setattr__(self, "_segment_blobs", blobs)
        return blobs

    def to_bytes(self) -> bytes:
        with paused_collector():
            return self._to_bytes()

    def _to_bytes(self) -> bytes:
        """canonical_json of the whole document, assembled from three parts (the keys sort as
        head < "segments" < "tensors" < tail) so that each tensor entry can be written by
        `_entry_json`, then sealed (versions 2 and 3; a version-1 manifest is written
        unsealed, as it was). Version 3 (the root) names its index segments and its tree's
        blob instead of holding the entries and the tree."""
        head = canonical_str({
            "created": self.created, "format": FORMAT_NAME, "hash": self.hash,
            "metadata": self.metadata, "name": self.name, "parent": self.parent})
        if self.version >= SEGMENTED_VERSION:
            parts: dict[str, Any] = {"segments": [r.to_json() for r in self.segment_refs()],
                                     "tree_blob": self.tree_ref().to_json(),
                                     "version": self.version}
            pages = self.tree_page_refs()
            if pages:  # written only where the tree has paged containers
                parts["tree_pages"] = [r.to_json() for r in pages]
            rest = canonical_str(parts)
            body = f'{head[:-1]},{rest[1:]}'.encode()
            return seal(body, hash_algorithm(self.hash).digest)
        tail = canonical_str({"tree": self.tree, "version": self.version})
        tensors = ",".join(_entry_json(t) if ok else canonical_str(t.to_json())
                           for t, ok in zip(self.tensors, self.entries_ok()))
        body = f'{head[:-1]},"tensors":[{tensors}],{tail[1:]}'.encode()
        return seal(body, hash_algorithm(self.hash).digest) if self.version >= 2 else body

    def entries_ok(self) -> list[bool]:
        """`entry_problem(t) is None` for every tensor entry, computed once per Manifest
        (serializing and `parses_back_equal` both need it; entries are frozen)."""
        ok = self.__dict__.get("_entries_ok")
        if ok is None:
            ok = [entry_problem(t) is None for t in self.tensors]
            object.__setattr__(self, "_entries_ok", ok)
        return ok


def fold_extents(ext: dict[str, int], more: dict[str, int]) -> None:
    """Fold blob extents `more` into `ext`: each blob to the furthest byte either uses."""
    for blob, end in more.items():
        if end > ext.get(blob, -1):
            ext[blob] = end


class SegmentExtents:
    """`Manifest.blob_extents` of many checkpoints, each index segment read once however
    many of them name it: a segment is named by its content, so the same digest uses the
    same blobs to the same bytes. For space accounting over a repository (`ckpt ls`, `ckpt
    du`), where checkpoints that froze part of a model share that part's segments. Keeps the
    extents of every distinct segment read; blob names are interned (`name`)."""

    def __init__(self) -> None:
        self._of: dict[str, dict[str, int]] = {}
        self._names: dict[str, str] = {}

    def name(self, blob: str) -> str:
        """The one string kept for `blob`."""
        return self._names.setdefault(blob, blob)

    def read(self) -> Collection[str]:
        """The digests of the segments read so far."""
        return self._of.keys()

    def of(self, manifest: Manifest, on_table: Callable[[ChunkTable], object] | None = None
           ) -> dict[str, int]:
        """{blob: the bytes of it `manifest` uses}, as `blob_extents` gives; `on_table` sees
        the chunk table of each segment this call reads (none that an earlier call read), or
        of all the entries of a manifest without segments read from a store. Raises what
        reading a segment raises."""
        refs = getattr(manifest.tensors, "refs", None)
        if manifest.version < SEGMENTED_VERSION or refs is None:
            tables = list(manifest.chunk_tables())
            for table in tables:
                if on_table is not None:
                    on_table(table)
            return {self.name(b): end for b, end in manifest.blob_extents(tables).items()}
        known = frozenset(self._of)
        new = [r for r in refs if r.digest not in known]
        for ref, table in zip(new, manifest.chunk_tables(known), strict=True):
            self._of[ref.digest] = {self.name(b): end
                                    for b, end in table.parts_and_extents().items()}
            if on_table is not None:
                on_table(table)
        ext = {self.name(r.digest): r.size for r in manifest.index_blobs()}
        for ref in refs:
            fold_extents(ext, self._of[ref.digest])
        return ext


class BlobUnion:
    """The blobs of many checkpoints as one set (`blobs`), each index segment read once
    however many of them name it: a segment is named by its content, so one already read
    names no blob the union lacks. For passes over every checkpoint (gc's references): a
    checkpoint that changed a few tensors since the last shares most of its segments."""

    def __init__(self) -> None:
        self.blobs: set[str] = set()
        self._segments: set[str] = set()

    def add(self, manifest: Manifest) -> None:
        """Add every blob `manifest` needs; raises what reading it raises (nothing of it is
        then added)."""
        self.blobs |= manifest.blob_digests(self._segments)
        self._segments.update(r.digest for r in manifest.segment_refs())

    def add_each(self, manifests: Iterable[Manifest]) -> None:
        """`add` each of `manifests` in turn, the next one's new segments read meanwhile
        (`with_next_read_ahead`). Raises what taking the next manifest or adding one raises."""
        for manifest in with_next_read_ahead(manifests, lambda: self._segments):
            self.add(manifest)


def with_next_read_ahead(manifests: Iterable[Manifest], known: Callable[[], Collection[str]]
                         ) -> Iterator[Manifest]:
    """Each of `manifests` in turn for a pass that reads every distinct index segment once
    (gc's references, space accounting, verify); while the caller uses one, the segments of
    the next that neither it nor `known()` (the segments the pass has read) names are read
    ahead (`Manifest.index_read_ahead`), so a store's round trips overlap from one checkpoint
    to the next. Two parsed manifests are held at a time. Stopping early drops the
    read-ahead and closes `manifests` where it is a generator."""
    following = iter(manifests)
    current = next(following, None)
    current_ahead = ExitStack()  # the read-ahead of `current`, begun a turn before
    try:
        while current is not None:
            after = next(following, None)
            after_ahead = ExitStack()
            try:
                if after is not None:
                    skip = {r.digest for r in current.segment_refs()}.union(known())
                    # 0 workers: the fewest threads a read-ahead uses
                    after_ahead.enter_context(after.index_read_ahead(0, skip=skip))
                yield current
            except BaseException:
                after_ahead.close()
                raise
            current_ahead.close()
            current, current_ahead = after, after_ahead
    finally:
        current_ahead.close()
        close = getattr(following, "close", None)
        if close is not None:  # (a catalog's pass: its manifest reads stop now)
            close()


_HI = 1 << 62  # `_int`'s default upper bound
_HEX_RUN = re.compile(r"[0-9a-f]*")
_ZARR_FIXED = ("zarr_format", "node_type", "data_type", "chunk_key_encoding", "fill_value",
               "codecs")
_zarr_fixed_cache: dict[tuple[str, Codec | None], tuple[Any, ...]] = {}


def _zarr_fixed(dtype: DType, codec: Codec | None) -> tuple[Any, ...]:
    """Values of the `_ZARR_FIXED` fields `to_json` writes for this dtype and codec."""
    key = (dtype.name, codec)
    fixed = _zarr_fixed_cache.get(key)
    if fixed is None:
        doc = TensorEntry("", "numpy", dtype, (), 1, codec, ()).to_json()
        fixed = _zarr_fixed_cache[key] = tuple(doc[f] for f in _ZARR_FIXED)
    return fixed


def _int_problem(value: Any, what: str, lo: int = 0, hi: int = _HI) -> str | None:
    if type(value) is not int or not lo <= value <= hi:
        return f"{what}: expected an integer in [{lo}, {hi}], got {value!r:.80}"
    return None


def entry_problem(e: TensorEntry, rows_checked: bool = False) -> str | None:
    """What is wrong with a tensor entry, or None if nothing is: the one statement of the
    rules a tensor entry obeys (types, ranges, extents, chunk sizes), used by both parsers
    and by `parses_back_equal`. Exact types are required (an int is not a bool or a float),
    as parsing JSON produces them. `rows_checked`: the caller checks the chunk references
    itself, many entries' at once (a segment's decode: `listed_rows_bad` over its columns,
    whose framing gives every field its type and form); their count is still checked
    here."""
    shape, rows, codec, dtype = e.shape, e.chunk_rows, e.codec, e.dtype
    if type(e.key) is not str:
        return "key must be a string"
    if type(e.kind) is not str or e.kind not in TENSOR_KINDS:
        return f"unknown kind {e.kind!r:.40}"
    if type(dtype) is not DType or DTYPES.get(dtype.name) is not dtype:
        return f"unknown dtype {dtype!r:.40}"
    if type(shape) is not tuple:
        return "shape must be a list"
    if len(shape) > MAX_DIMS:
        return f"more than {MAX_DIMS} dimensions"
    for n in shape:
        if type(n) is not int or not 0 <= n <= _HI:
            return _int_problem(n, "shape")
    if not extent_ok(shape, dtype.itemsize):
        return f"shape {list(shape)} of {dtype.name} declares more than {MAX_TENSOR_BYTES} bytes"
    if type(rows) is not int or not (1 if shape else 0) <= rows <= _HI:
        return _int_problem(rows, "chunk_rows", 1 if shape else 0)
    if e.chunk_shape is not None:
        problem = _grid_problem(e)
        if problem is not None:
            return problem
    if codec is not None and (type(codec) is not Codec or type(codec.id) is not str
                              or type(codec.level) is not int
                              or not -100 <= codec.level <= 100):
        return f"invalid codec {codec!r:.60}"
    if type(e.requires_grad) is not bool:
        return f"requires_grad: expected true/false, got {e.requires_grad!r:.80}"
    if type(e.parameter) is not bool:
        return f"parameter: expected true/false, got {e.parameter!r:.80}"
    if e.kind != "torch" and (e.requires_grad or e.parameter or e.storage is not None):
        return "torch-only fields on a non-torch tensor"
    if e.kind == "bytes" and (dtype.name != "uint8" or len(shape) != 1):
        return "bytes must be 1-d uint8"
    if e.storage is not None:
        problem = _storage_problem(e)
        if problem is not None:
            return problem
    return _chunks_problem(e, rows_checked)


def listed_rows_bad(entries: Sequence[TensorEntry], offsets: np.ndarray, sizes: np.ndarray,
                    nbytes: np.ndarray) -> np.ndarray:
    """`rows_bad` of the chunk rows of these entries, all of their chunks in order (columns
    of their offsets, stored sizes and raw sizes): each row against the raw bytes its chunk
    holds and its entry's codec. The entries must obey every rule but their chunks'."""
    want: list[int] = []
    for e in entries:
        n = len(e.chunks)
        if n == 1:  # one chunk: the whole tensor
            want.append(e.nbytes)
        else:
            want.extend(_chunk_sizes(e.shape, e.chunk_rows, e.chunk_shape, e.dtype.itemsize,
                                     n).tolist())
    counts = [len(e.chunks) for e in entries]
    raw = np.repeat(np.array([e.codec is None for e in entries], dtype=bool), counts)
    return rows_bad(offsets, sizes, nbytes, np.array(want, dtype=nbytes.dtype), raw)


def _grid_problem(e: TensorEntry) -> str | None:
    grid = e.chunk_shape
    if type(grid) is not tuple or len(grid) != len(e.shape) or not e.shape:
        return "chunk_shape must list one extent per dimension"
    for c in grid:
        if type(c) is not int or not 1 <= c <= _HI:
            return _int_problem(c, "chunk_shape", 1)
    if grid[0] != e.chunk_rows:
        return "chunk_shape[0] differs from chunk_rows"
    return None


def _storage_problem(e: TensorEntry) -> str | None:
    st = e.storage
    if type(st) is not StorageRef:
        return "storage must be an object"
    for field_name in ("id", "nbytes", "offset"):
        problem = _int_problem(getattr(st, field_name), f"storage.{field_name}")
        if problem is not None:
            return problem
    if type(st.stride) is not tuple:
        return "storage.stride must be a list"
    for x in st.stride:
        if type(x) is not int or not 0 <= x <= _HI:
            return _int_problem(x, "storage.stride")
    if len(st.stride) != len(e.shape):
        return "storage stride rank differs from shape"
    if not extent_ok((), 1, st.nbytes):
        return f"storage declares more than {MAX_TENSOR_BYTES} bytes"
    if math.prod(e.shape):
        extent = st.offset + sum((n - 1) * x for n, x in zip(e.shape, st.stride)) + 1
        if extent * e.dtype.itemsize > st.nbytes:
            return "view reaches past the end of its storage"
    return None


def _chunks_problem(e: TensorEntry, rows_checked: bool = False) -> str | None:
    """The chunk list: count, digests, declared sizes and extents (only the count where
    `rows_checked`: see entry_problem)."""
    shape, rows, codec, chunks = e.shape, e.chunk_rows, e.codec, e.chunks
    itemsize = e.dtype.itemsize
    if (type(chunks) is not tuple and type(chunks) is not ChunkRows
            and not isinstance(chunks, LazyChunks)):
        return "chunks must be a list"
    grid = e.chunk_shape
    want_count = expected_chunk_count(shape, rows, itemsize, grid)
    if len(chunks) != want_count:
        return (f"{len(chunks)} chunks listed, shape and "
                f"{'chunk_rows' if grid is None else 'chunk_shape'} give {want_count}")
    if rows_checked or isinstance(chunks, LazyChunks):  # (LazyChunks: as they are read)
        return None
    if type(chunks) is ChunkRows:  # a segment's columns: the same rules on every row at once
        bad = chunks.first_bad(_chunk_sizes(shape, rows, grid, itemsize, want_count), codec)
        # the first bad chunk's message, as the rules below state it
        return None if bad is None else _chunk_problems(e, [(bad, chunks[bad])])
    return _chunk_problems(e, enumerate(chunks))


def _chunk_problems(e: TensorEntry, chunks: Iterable[tuple[int, Any]]) -> str | None:
    """What is wrong with the first of these (index, chunk) of entry `e`, or None."""
    shape, rows, codec, grid = e.shape, e.chunk_rows, e.codec, e.chunk_shape
    itemsize = e.dtype.itemsize
    row_bytes = math.prod(shape[1:]) * itemsize
    digests = []
    for i, c in chunks:
        if type(c) is not ChunkRef:
            return f"chunk {i} must be an object"
        blob, dg, offset, size, nbytes = c.blob, c.digest, c.offset, c.size, c.nbytes
        if (type(blob) is not str or type(dg) is not str or len(blob) != 32 or len(dg) != 32
                or type(offset) is not int or type(size) is not int or type(nbytes) is not int
                or not (0 <= offset <= _HI and 0 <= size <= 2 * MAX_CHUNK_BYTES
                        and 0 <= nbytes <= MAX_CHUNK_BYTES)):
            return _chunk_field_problem(i, c)
        if grid is not None:
            want = math.prod(b - a for a, b in chunk_region(shape, grid, i)) * itemsize
        elif shape:
            start = i * rows
            want = (min(shape[0], start + rows) - start) * row_bytes
        else:
            want = itemsize
        if nbytes != want:
            return f"chunk {i} declares {nbytes} bytes, its rows hold {want}"
        if codec is None:
            if size != nbytes:
                return f"chunk {i}: stored size differs from raw size without a codec"
        elif offset != 0 or size > 2 * nbytes + 65536:
            return f"chunk {i}: implausible compressed extent"
        digests.append(blob)
        digests.append(dg)
    if _HEX_RUN.fullmatch("".join(digests)) is None:
        bad = next(d for d in digests if _HEX_RUN.fullmatch(d) is None)
        return f"{bad!r:.40} is not an {HASH_NAME} hex digest"
    return None


def _chunk_sizes(shape: tuple[int, ...], rows: int, grid: tuple[int, ...] | None,
                 itemsize: int, count: int) -> np.ndarray:
    """The raw bytes of each of the `count` chunks of a valid shape and grid, in C order of
    their grid position (uint64): what `_chunk_problems` computes chunk by chunk."""
    if not count:
        return np.zeros(0, np.uint64)
    if not shape:
        return np.full(count, itemsize, np.uint64)
    block = grid if grid is not None else (rows, *shape[1:])
    per_dim = []
    for n, c in zip(shape, block):
        starts = np.arange(-(-n // c), dtype=np.int64) * c
        per_dim.append(np.minimum(n, starts + c) - starts)
    sizes = per_dim[0]
    for extents in per_dim[1:]:
        sizes = np.multiply.outer(sizes, extents).ravel()
    return sizes.astype(np.uint64) * np.uint64(itemsize)


def _chunk_field_problem(i: int, c: ChunkRef) -> str:
    """The first bad field of chunk `i` (its types or ranges)."""
    for field_name in ("blob", "digest"):
        value = getattr(c, field_name)
        if type(value) is not str or len(value) != 32:
            return f"chunk {i}.{field_name}: {value!r:.40} is not an {HASH_NAME} hex digest"
    for field_name, hi in (("offset", _HI), ("size", 2 * MAX_CHUNK_BYTES),
                           ("nbytes", MAX_CHUNK_BYTES)):
        problem = _int_problem(getattr(c, field_name), f"chunk {i}.{field_name}", 0, hi)
        if problem is not None:
            return problem
    raise AssertionError("called for a chunk with a bad field")


_fixed_json_cache: dict[tuple[str, Codec | None], tuple[str, str]] = {}


def _fixed_json(dtype: DType, codec: Codec | None) -> tuple[str, str]:
    """(canonical JSON of the codec attribute, canonical JSON of the fixed zarr fields that sort
    between "chunk_grid" and "node_type", without braces) for this dtype and codec."""
    key = (dtype.name, codec)
    fixed = _fixed_json_cache.get(key)
    if fixed is None:
        doc = dict(zip(_ZARR_FIXED, _zarr_fixed(dtype, codec)))
        later = {k: doc[k] for k in ("chunk_key_encoding", "codecs", "data_type", "fill_value")}
        fixed = (canonical_str(None if codec is None else codec.to_json()),
                 canonical_str(later)[1:-1])
        _fixed_json_cache[key] = fixed
    return fixed


def _entry_json(e: TensorEntry) -> str:
    """`canonical_str(e.to_json())`, written directly (a third of the time of `json.dumps`).
    Only for an entry `entry_problem` passes: its digests are hex and its numbers exact ints, so
    they need no escaping; tests/ckptstore/pipeline/test_writer_small_tensors.py checks the
    equality."""
    codec_json, fixed = _fixed_json(e.dtype, e.codec)
    chunks = ",".join(
        f'{{"blob":"{c.blob}","digest":"{c.digest}","nbytes":{c.nbytes},'
        f'"offset":{c.offset},"size":{c.size}}}' for c in e.chunks)
    torch_attrs = ""
    if e.kind == "torch":
        torch_attrs = (f',"parameter":{"true" if e.parameter else "false"}'
                       f',"requires_grad":{"true" if e.requires_grad else "false"}')
    st = e.storage
    if st is not None:
        torch_attrs += (f',"storage":{{"id":{st.id},"nbytes":{st.nbytes},"offset":{st.offset},'
                        f'"stride":[{",".join(map(str, st.stride))}]}}')
    grid = ",".join(map(str, e.zarr_chunk_shape()))
    grid_attr = ("" if e.chunk_shape is None else
                 f'"chunk_shape":[{",".join(map(str, e.chunk_shape))}],')
    return (f'{{"attributes":{{"ckptstore":{{"chunk_rows":{e.chunk_rows},{grid_attr}'
            f'"chunks":[{chunks}],'
            f'"codec":{codec_json},"dtype":"{e.dtype.name}","key":{_json_str(e.key)},'
            f'"kind":"{e.kind}"{torch_attrs}}}}},'
            f'"chunk_grid":{{"configuration":{{"chunk_shape":[{grid}]}},"name":"regular"}},'
            f'{fixed},"node_type":"array","shape":[{",".join(map(str, e.shape))}],'
            f'"zarr_format":3}}')
