"""`ckpt-data verify`: check a stored dataset against everything its readers rely on.

The datasets are plain zarr v3, so "its readers" includes zarr-python, which reads none of
``dataset.json``: it opens the group ``zarr.json`` files, takes every array's metadata from its
``zarr.json``, finds each chunk through the index *at the end of the shard object* and decodes
it with the codecs named there. Our own reader instead takes the chunk locations from the shard
tables ``dataset.json`` records and checks every chunk's digest. Verify checks both views
against the index, object by object:

* ``dataset.json`` itself (parsed and validated as the reader does);
* every group ``zarr.json`` the layout implies (the root, or each partition's root, and the
  group of each variable-length field): zarr v3 group metadata, nothing a reader would act on
  that the writer does not write (no consolidated metadata, no unknown keys);
* every array ``zarr.json``: every key a zarr reader uses (shape, data type, fill value, chunk
  grid, chunk key encoding, the complete codec chain, storage transformers) equals what the
  writer stores for the array the index describes; attributes are free, dimension names must
  be well formed, extension keys only with ``must_understand: false`` (zarr ignores those);
* every shard object: its size, and its index tail read from the object's end (as zarr finds
  it) with a valid CRC-32C, the digest ``dataset.json`` records, and the recorded table;
* every stored chunk (also chunks no block reads, such as the last row of an offsets array):
  its digest, and that it decodes to the chunk size; offsets arrays must agree with the
  recorded ``block_bounds`` and never decrease.

Every problem is reported (up to MAX_PROBLEMS), each naming its object. Nothing is written.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import google_crc32c
import numpy as np

from ckptstore.errors import FormatError, ObjectNotFoundError
from ckptstore.stores import Store
from ckptstore.toolkit import digest, merge_ranges

from ..errors import DatasetNotFoundError
from ..format.arrays import ArrayInfo, ShardInfo
from ..format.fields import FieldInfo
from ..format.index import DatasetIndex, load_index
from ..format.spec import INDEX_KEY, MAX_ZARR_JSON_BYTES
from ..format.validate import parse_json, read_capped, same_json, short_repr
from ..format.zarr_encoding import array_metadata

#: Problems listed at most (the count of all of them is always given).
MAX_PROBLEMS = 200
_MAX_READ = 16 << 20  # bytes per ranged read of chunk data
_GROUP_KEYS = ("zarr_format", "node_type", "attributes", "consolidated_metadata")


@dataclass
class VerifyReport:
    """What `verify_dataset` found: the index (None if it is unusable), the problems (each one
    line naming its object), and how much was checked."""

    index: DatasetIndex | None
    problems: list[str] = field(default_factory=list)
    total_problems: int = 0
    shards: int = 0
    chunks: int = 0
    bytes_read: int = 0

    @property
    def ok(self) -> bool:
        return self.total_problems == 0


class _Problems:
    """Thread-safe problem list, capped at MAX_PROBLEMS entries (all are counted)."""

    def __init__(self, report: VerifyReport) -> None:
        self.report = report
        self._lock = threading.Lock()

    def add(self, message: str) -> None:
        with self._lock:
            self.report.total_problems += 1
            if len(self.report.problems) < MAX_PROBLEMS:
                self.report.problems.append(message)

    def counted(self, shards: int = 0, chunks: int = 0, nbytes: int = 0) -> None:
        with self._lock:
            self.report.shards += shards
            self.report.chunks += chunks
            self.report.bytes_read += nbytes


def verify_dataset(
    store: Store, *, threads: int = 4,
    progress: Callable[[int], AbstractContextManager[Callable[[int], None]]] | None = None,
) -> VerifyReport:
    """Check the dataset in `store` (see the module doc). Raises DatasetNotFoundError if there
    is no ``dataset.json``; every other finding is a problem in the report. `progress(total)`
    (optional) gives a context yielding advance(n), called once per shard checked."""
    report = VerifyReport(None)
    found = _Problems(report)
    try:
        index = load_index(store)
    except ObjectNotFoundError:
        raise DatasetNotFoundError(
            f"{store.uri}: no dataset here ({INDEX_KEY} is missing; was the write finished?)"
        ) from None
    except FormatError as exc:
        found.add(str(exc))
        return report
    report.index = index
    for key in group_keys(index):
        _check_group(store, key, found)
    for path in sorted(index.arrays):
        _check_array_json(store, index.arrays[path], found)
    roles = _array_roles(index)
    jobs = [(a, s) for _, a in sorted(index.arrays.items()) for s in range(len(a.shards))]
    bar = progress(len(jobs)) if progress is not None else nullcontext(lambda n: None)
    with bar as advance, ThreadPoolExecutor(max(1, threads),
                                            thread_name_prefix="dataloader-verify") as pool:
        futures = [pool.submit(_check_shard, store, a, s, roles.get(a.path), found)
                   for a, s in jobs]
        for fut in futures:
            fut.result()
            advance(1)
    return report


def group_keys(index: DatasetIndex) -> list[str]:
    """The group ``zarr.json`` keys the layout implies: the root of each stored v1 layout
    (the dataset root, or each partition's prefix) and each variable-length field's group."""
    roots = [f"{k}/" for k, _ in index.partitions] if index.partitions else [""]
    keys = []
    for root, sub in zip(roots, [p for _, p in index.partitions] or [index], strict=True):
        keys.append(f"{root}zarr.json")
        for group in sorted({p.rpartition("/")[0] for p in sub.arrays} - {""}):
            keys.append(f"{root}{group}/zarr.json")
    return keys


def _read_json(store: Store, key: str, found: _Problems) -> Any:
    where = f"{store.uri}/{key}"
    try:
        raw = read_capped(store, key, MAX_ZARR_JSON_BYTES, where)
    except ObjectNotFoundError:
        found.add(f"{where}: missing (a zarr reader needs it)")
        return None
    except FormatError as exc:
        found.add(str(exc))
        return None
    try:
        doc = parse_json(raw, where)
    except FormatError as exc:
        found.add(str(exc) if raw else f"{where}: empty (0 bytes), not zarr metadata")
        return None
    if not isinstance(doc, dict):
        found.add(f"{where}: expected a JSON object, got {type(doc).__name__}")
        return None
    return doc


def _check_group(store: Store, key: str, found: _Problems) -> None:
    doc = _read_json(store, key, found)
    if doc is None:
        return
    where = f"{store.uri}/{key}"
    if doc.get("zarr_format") != 3 or type(doc.get("zarr_format")) is not int:
        found.add(f"{where}: zarr_format is {short_repr(doc.get('zarr_format'))}, expected 3")
    if doc.get("node_type") != "group":
        found.add(f"{where}: node_type is {short_repr(doc.get('node_type'))}, expected 'group'")
    if not isinstance(doc.get("attributes", {}), dict):
        found.add(f"{where}: attributes must be a JSON object")
    if doc.get("consolidated_metadata") is not None:
        # zarr-python would take the arrays' metadata from here instead of their zarr.json
        found.add(f"{where}: consolidated_metadata is not written by the dataloader (a zarr "
                  "reader would use it instead of the arrays' zarr.json)")
    for k in doc:
        if k not in _GROUP_KEYS:
            found.add(f"{where}: unknown key {short_repr(k)}")


def _expected_array_json(a: ArrayInfo) -> dict[str, Any]:
    """What the writer stores as this array's zarr.json, parsed."""
    raw = array_metadata(np.dtype(a.dtype), a.shape, a.chunk_shape[0], a.chunks_per_shard,
                         a.compressor)
    doc: dict[str, Any] = parse_json(raw, a.path)
    return doc


def _normal_codecs(codecs: Any, a: ArrayInfo) -> Any:
    """`codecs` with the variants that decode identically spelled as the writer spells them:
    a one-byte type's ``bytes`` codec with or without its endian, and any valid zstd level and
    checksum flag (both only matter when encoding)."""
    if not (isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict)):
        return codecs
    conf = codecs[0].get("configuration")
    if not isinstance(conf, dict) or not isinstance(conf.get("codecs"), list):
        return codecs
    inner = []
    for c in conf["codecs"]:
        if c == {"name": "bytes"} and np.dtype(a.dtype).itemsize == 1:
            c = {"name": "bytes", "configuration": {"endian": "little"}}
        if isinstance(c, dict) and c.get("name") == "zstd":
            zc = c.get("configuration")
            if (isinstance(zc, dict) and set(zc) == {"level", "checksum"}
                    and type(zc["level"]) is int and -131072 <= zc["level"] <= 22
                    and isinstance(zc["checksum"], bool)):
                c = {"name": "zstd", "configuration": {"level": 1, "checksum": False}}
        inner.append(c)
    return [{**codecs[0], "configuration": {**conf, "codecs": inner}}]


def _check_array_json(store: Store, a: ArrayInfo, found: _Problems) -> None:
    key = f"{a.path}/zarr.json"
    doc = _read_json(store, key, found)
    if doc is None:
        return
    where = f"{store.uri}/{key}"
    want = _expected_array_json(a)
    want["codecs"] = _normal_codecs(want["codecs"], a)
    for k, value in want.items():
        if k == "attributes":
            if not isinstance(doc.get(k, {}), dict):
                found.add(f"{where}: attributes must be a JSON object")
            continue
        got = doc.get(k, [] if k == "storage_transformers" else None)
        if k == "codecs":
            got = _normal_codecs(got, a)
        if not same_json(got, value):
            found.add(f"{where}: {k} is {short_repr(doc.get(k))}, the index implies "
                      f"{short_repr(value)}")
    names = doc.get("dimension_names")
    if names is not None and not (
        isinstance(names, list) and len(names) == len(a.shape)
        and all(n is None or isinstance(n, str) for n in names)
    ):
        found.add(f"{where}: dimension_names must be null or {len(a.shape)} names")
    for k, v in doc.items():
        if k in want or k == "dimension_names":
            continue
        if not (isinstance(v, dict) and v.get("must_understand") is False):
            found.add(f"{where}: unknown key {short_repr(k)} (zarr refuses extension keys "
                      "without must_understand: false)")


@dataclass(frozen=True)
class _Role:
    """An offsets array's field and the dataset (or partition) index it belongs to."""

    field: FieldInfo
    num_samples: int
    rows_per_chunk: int


def _array_roles(index: DatasetIndex) -> dict[str, _Role]:
    """Full array path -> role, for the offsets arrays (checked against block_bounds)."""
    out: dict[str, _Role] = {}
    subs = [(f"{k}/", p) for k, p in index.partitions] or [("", index)]
    for prefix, sub in subs:
        for f in sub.fields:
            if f.variable:
                out[prefix + f.arrays["offsets"]] = _Role(f, sub.num_samples, sub.rows_per_chunk)
    return out


def _check_shard(
    store: Store, a: ArrayInfo, s: int, role: _Role | None, found: _Problems
) -> None:
    key = a.shard_key(s)
    info = a.shards[s]
    where = f"{store.uri}/{key} (array {a.path!r}, shard {s})"
    try:
        size = store.stat(key).size
    except ObjectNotFoundError:
        found.add(f"{where}: missing, although dataset.json lists it")
        return
    read = 0
    locations: tuple[tuple[int, int] | None, ...] | None = info.table
    if size != info.nbytes:
        found.add(f"{where}: {size:,} bytes, dataset.json records {info.nbytes:,} (zarr reads "
                  "the shard index from the object's end)")
    if size >= a.index_nbytes:
        tail = store.get_range(key, size - a.index_nbytes, a.index_nbytes)
        read += len(tail)
        pairs, crc = tail[:-4], int.from_bytes(tail[-4:], "little")
        if int(google_crc32c.value(pairs)) != crc:
            found.add(f"{where}: the shard index's CRC-32C does not match (zarr refuses it)")
        if digest(tail) != info.index_digest:
            found.add(f"{where}: the shard index (its last {a.index_nbytes} bytes, where zarr "
                      "reads it) does not match the digest dataset.json records")
        elif info.table is not None and ShardInfo.table_of(tail, a.chunks_per_shard) != info.table:
            found.add(f"{where}: the shard index differs from the table dataset.json records")
        elif info.table is None:
            locations = ShardInfo.table_of(tail, a.chunks_per_shard)
    else:
        found.add(f"{where}: too small to hold its {a.index_nbytes}-byte shard index")
    if locations is None:  # no trustworthy chunk locations: reported above
        found.counted(1, 0, read)
        return
    read += _check_chunks(store, a, s, locations, role, where, found)
    found.counted(1, sum(c is not None for c in info.chunks), read)


def _check_chunks(
    store: Store, a: ArrayInfo, s: int, locations: tuple[tuple[int, int] | None, ...],
    role: _Role | None, where: str, found: _Problems,
) -> int:
    """Read every chunk of shard `s` at `locations`: digest, decoded size, offsets rules.
    Returns the bytes read."""
    info = a.shards[s]
    end = info.nbytes - a.index_nbytes
    items = []
    for i, (loc, want) in enumerate(zip(locations, info.chunks, strict=True)):
        chunk = s * a.chunks_per_shard + i
        if (loc is None) != (want is None):
            found.add(f"{where}: chunk {chunk} is {'absent' if loc is None else 'present'} in "
                      "the shard index, unlike dataset.json")
        elif loc is not None and (loc[0] + loc[1] > end or loc[1] > a.max_stored_nbytes):
            found.add(f"{where}: chunk {chunk} at {loc} lies outside the shard's chunk data")
        elif loc is not None and want is not None:
            items.append((loc[0], loc[1], (chunk, want)))
    read = 0
    zstd: Any = None
    for req in merge_ranges(items, 0, _MAX_READ):
        try:
            data = store.get_range(a.shard_key(s), req.start, req.length)
        except ObjectNotFoundError:
            found.add(f"{where}: disappeared while being read")
            return read
        read += len(data)
        for start, n, (chunk, want) in req.parts:
            raw = memoryview(data)[start - req.start : start - req.start + n]
            span = f"chunk {chunk} (bytes {start}..{start + n})"
            if len(raw) != n or digest(raw) != want:
                found.add(f"{where}: {span} does not match its digest in dataset.json")
                continue
            if a.compressor is None:
                decoded = np.frombuffer(raw, dtype=np.uint8)
            else:
                if zstd is None:
                    from numcodecs import Zstd

                    zstd = Zstd()
                try:
                    decoded = np.frombuffer(zstd.decode(bytes(raw)), dtype=np.uint8)
                except (ValueError, RuntimeError) as exc:
                    found.add(f"{where}: {span} does not decode ({exc})")
                    continue
            if decoded.nbytes != a.chunk_nbytes:
                found.add(f"{where}: {span} decodes to {decoded.nbytes:,} bytes, a chunk holds "
                          f"{a.chunk_nbytes:,}")
                continue
            if role is not None:
                for problem in _offsets_problems(chunk, decoded.view("<i8"), role):
                    found.add(f"{where}: {span}: {problem}")
    return read


def _offsets_problems(chunk: int, values: np.ndarray, role: _Role) -> Iterator[str]:
    """Offsets chunk `chunk` (rows [chunk*R, ...)) against the field's block_bounds: each
    block's first row holds its bound, the row after the last sample the data length, and
    values never decrease (so every sample is a valid slice of the data array)."""
    bounds = role.field.block_bounds
    assert bounds is not None
    r, n = role.rows_per_chunk, role.num_samples
    first = chunk * r
    rows = values[: max(0, min(r, n + 1 - first))]
    if not len(rows):
        return
    if np.any(np.diff(rows) < 0):
        yield "offsets decrease"
    block = first // r
    want = bounds[block] if first < n else bounds[-1]
    if int(rows[0]) != want:
        yield f"offset of row {first} is {int(rows[0])}, block_bounds says {want}"
    if first <= n < first + len(rows) and int(rows[n - first]) != bounds[-1]:
        yield f"the last offset is {int(rows[n - first])}, the data holds {bounds[-1]} elements"
    nxt = bounds[min(block + 1, len(bounds) - 1)]
    if int(rows[-1]) > nxt or int(rows[0]) < 0:
        yield f"offsets leave the block's data range [{bounds[block]}, {nxt}]"


__all__ = ["MAX_PROBLEMS", "VerifyReport", "group_keys", "verify_dataset"]
