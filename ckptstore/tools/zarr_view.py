"""A read-only zarr v3 Store over one checkpoint, so zarr-python reads any tensor lazily:

    group = zarr.open_group(store=ckptstore.zarr_store(repo, "step-100"), mode="r")
    group["model.embed.weight"][10:20]

Each tensor is an array named by its dotted key ('%' written as '%25', '/' as '%2F', a key
'_' as '%5F' and 'zarr.json' as 'zarr%2Ejson', so that the root key can be '_' and no array
hides the group's metadata); a tensor saved under several keys (the same object twice) is an
array under each.
Chunks are served decoded and verified against their digests (IntegrityError otherwise), with
the last row block padded to the full chunk shape as zarr expects; so every array's metadata
here lists only the `bytes` codec. bfloat16/float8/complex32 arrays hold raw bits (uint16,
uint8, uint32): the real dtype is in `attributes["ckptstore"]["dtype"]`. A chunk that the
manifest does not list is absent; a listed chunk whose blob is missing raises IntegrityError
instead of reading as the fill value.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING

import numpy as np
from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from ..format.manifest import Manifest, TensorEntry
from ..format.tree import tied_keys
from ..pipeline.reader import CheckpointReader, ReadTarget

if TYPE_CHECKING:
    from ..repository import CheckpointStore


_RESERVED = {"_": "%5F", "zarr.json": "zarr%2Ejson"}


def node_name(key: str) -> str:
    """The zarr array name of a tensor key (one name per key, see the module docstring)."""
    name = key.replace("%", "%25").replace("/", "%2F")
    return _RESERVED.get(name, name) or "_"


class CheckpointZarrStore(Store):
    """Read-only zarr Store view of one committed checkpoint: its manifest, read through a
    CheckpointReader over the store that holds its blobs."""

    def __init__(self, reader: CheckpointReader, manifest: Manifest) -> None:
        super().__init__(read_only=True)
        self._manifest = manifest
        self._reader = reader
        self._arrays: dict[str, TensorEntry] = {}
        entries = self._manifest.tensors
        for entry in entries:
            self._arrays.setdefault(node_name(entry.key), entry)
        for index, keys in tied_keys(self._manifest.tree).items():  # the same object again
            for key in keys:
                self._arrays.setdefault(node_name(key), entries[index])
        self._docs: dict[str, bytes] = {"zarr.json": json.dumps({
            "zarr_format": 3, "node_type": "group",
            "attributes": {"ckptstore": {"checkpoint": self._manifest.name,
                                         "metadata": self._manifest.metadata}},
        }).encode()}
        for node, entry in self._arrays.items():
            doc = entry.to_json()
            doc["codecs"] = doc["codecs"][:1]  # served decoded
            self._docs[f"{node}/zarr.json"] = json.dumps(doc).encode()

    # -------------------------------------------------------------- identity
    def __eq__(self, other: object) -> bool:
        return (isinstance(other, CheckpointZarrStore)
                and other._reader.store is self._reader.store
                and other._manifest.name == self._manifest.name)

    def __hash__(self) -> int:
        return hash((id(self._reader.store), self._manifest.name))

    @property
    def supports_writes(self) -> bool:
        return False

    @property
    def supports_deletes(self) -> bool:
        return False

    @property
    def supports_listing(self) -> bool:
        return True

    async def set(self, key: str, value: Buffer) -> None:
        raise PermissionError("a checkpoint's zarr view is read-only")

    async def delete(self, key: str) -> None:
        raise PermissionError("a checkpoint's zarr view is read-only")

    # -------------------------------------------------------------- reads
    def _chunk(self, key: str) -> tuple[TensorEntry, int] | None:
        node, sep, rest = key.partition("/c")
        entry = self._arrays.get(node)
        if entry is None or not sep:
            return None
        if not entry.shape:
            return (entry, 0) if rest == "" else None
        parts = rest.split("/")
        if len(parts) != len(entry.shape) + 1 or parts[0] != "":
            return None
        try:
            idx = [int(p) for p in parts[1:]]
        except ValueError:
            return None
        grid = _grid(entry)
        if not entry.chunks or any(not 0 <= i < g for i, g in zip(idx, grid)):
            return None
        index = 0
        for i, g in zip(idx, grid):
            index = index * g + i
        return entry, index

    def _read_chunk(self, entry: TensorEntry, index: int) -> bytes:
        """Decoded, verified bytes of one chunk, zero-padded to the full chunk shape."""
        if entry.is_grid:
            extents = tuple(b - a for a, b in entry.chunk_region(index))
            part = np.empty(math.prod(extents) * entry.dtype.itemsize, np.uint8)
            one = entry.chunk_alone(index, extents)
            self._reader.read_tensors([ReadTarget(one, part)])
            block = entry.block_shape()
            full = np.zeros((*block, entry.dtype.itemsize), np.uint8)
            full[tuple(slice(0, n) for n in extents)] = part.reshape(*extents, -1)
            return full.tobytes()
        full_rows = entry.chunk_rows if entry.shape else 1
        start, stop = entry.chunk_rows_range(index)
        row_bytes = entry.row_bytes if entry.shape else entry.dtype.itemsize
        out = np.zeros(full_rows * row_bytes, np.uint8)
        rows = (stop - start) if entry.shape else 1
        one = entry.chunk_alone(index, (rows, *entry.shape[1:]) if entry.shape else ())
        self._reader.read_tensors([ReadTarget(one, out[: rows * row_bytes])])
        return out.tobytes()

    def _get_sync(self, key: str) -> bytes | None:
        doc = self._docs.get(key)
        if doc is not None:
            return doc
        found = self._chunk(key)
        if found is None:
            return None
        return self._read_chunk(*found)

    async def get(self, key: str, prototype: BufferPrototype | None = None,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        prototype = prototype or default_buffer_prototype()
        data = await asyncio.to_thread(self._get_sync, key)
        if data is None:
            return None
        return prototype.buffer.from_bytes(_slice(data, byte_range))

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]
                                 ) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

    async def exists(self, key: str) -> bool:
        return key in self._docs or self._chunk(key) is not None

    # -------------------------------------------------------------- listing
    def _all_keys(self) -> list[str]:
        keys = list(self._docs)
        for node, entry in self._arrays.items():
            if not entry.shape:
                keys.extend(f"{node}/c" for _ in entry.chunks)
            elif entry.chunks:
                keys.extend(f"{node}/c/" + "/".join(map(str, pos))
                            for pos in itertools.product(*(range(g) for g in _grid(entry))))
        return keys

    async def list(self) -> AsyncIterator[str]:
        for key in self._all_keys():
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in self._all_keys():
            if key.startswith(prefix):
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        prefix = prefix.rstrip("/")
        seen: set[str] = set()
        for key in self._all_keys():
            if prefix and not key.startswith(prefix + "/"):
                continue
            head = key[len(prefix) + 1 if prefix else 0 :].split("/", 1)[0]
            if head not in seen:
                seen.add(head)
                yield head


def _grid(entry: TensorEntry) -> list[int]:
    """Chunks per dimension of an entry's (zarr) chunk grid."""
    return [max(1, -(-n // c)) for n, c in zip(entry.shape, entry.zarr_chunk_shape())]


def _slice(data: bytes, byte_range: ByteRequest | None) -> bytes:
    if byte_range is None:
        return data
    if isinstance(byte_range, RangeByteRequest):
        return data[byte_range.start : byte_range.end]
    if isinstance(byte_range, OffsetByteRequest):
        return data[byte_range.offset :]
    if isinstance(byte_range, SuffixByteRequest):
        return data[len(data) - byte_range.suffix :]
    raise ValueError(f"unexpected byte range {byte_range!r}")


def zarr_store(repo: CheckpointStore, name: str) -> CheckpointZarrStore:
    """A read-only zarr v3 Store over checkpoint `name` of `repo`."""
    return CheckpointZarrStore(CheckpointReader(repo.store, repo.load_options),
                               repo.manifest(name))


