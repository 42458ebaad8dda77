"""The layout's names, kinds, dtypes and limits: what a dataset may hold and where.

Layout of a dataset under its store root::

    zarr.json                    zarr v3 group (root)
    <field>/...                  fixed/scalar field: one zarr array, rows along dim 0
    <field>/data, <field>/offsets[, <field>/shapes]
                                 variable-length field: flat data + int64 offsets (N+1)
    dataset.json                 the index (index.py), written last and create-only (the commit)

A partitioned dataset (format version 2) holds that layout once per partition, under
``parts/<index>/``. The limits bound everything a reader sizes from an index; they are
documented in docs/dataloader.md ("Integrity and limits of dataset.json").
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ckptstore.errors import FormatError

from .validate import short_repr

FORMAT_NAME = "ckptstore.dataloader"
FORMAT_VERSION = 1
#: Version of an index made of partitions (`commit_dataset`): each partition is a v1-shaped
#: set of arrays under ``parts/<index>/``; the index lists them in order.
PARTITIONED_VERSION = 2
PARTITION_PREFIX = "parts/"
INDEX_KEY = "dataset.json"
KINDS = ("scalar", "fixed", "ragged", "bytes", "str")
COMPRESSORS = (None, "zstd")
EMPTY = 2**64 - 1  # zarr's marker for an absent chunk in a shard index
_FIELD_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")

# -- limits (documented in docs/dataloader.md) -------------------------------------------
#: A dataset.json larger than this is refused from its size alone, before it is read.
MAX_INDEX_BYTES = 256 << 20
#: Likewise for an array's zarr.json (a few hundred bytes in practice).
MAX_ZARR_JSON_BYTES = 1 << 20
#: Nesting depth of the free-form `metadata` object.
MAX_METADATA_DEPTH = 32
#: Dimensions of one sample of a field.
MAX_NDIM = 32
#: Samples per block (the writer's own default is at most 65,536).
MAX_ROWS_PER_CHUNK = 1 << 20
#: Decoded bytes of one chunk: bounds every buffer the reader sizes from the index.
MAX_CHUNK_NBYTES = 1 << 30
#: The dtypes a dataset may hold, spelled as the index spells them (little endian), mapped to
#: their zarr v3 `data_type` names. Anything else, other byte orders included, is refused.
DTYPES: dict[str, str] = {
    np.dtype(name).newbyteorder("<").str: name
    for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
}  # fmt: skip
OFFSETS_DTYPE = "<i8"  # offsets and shapes arrays
BYTES_DTYPE = "|u1"  # bytes and str fields

def partition_prefix(index: int) -> str:
    """Key prefix (no trailing slash) of partition `index`."""
    return f"{PARTITION_PREFIX}{index:06d}"


def validate_field_name(name: object) -> str:
    """Return `name` if usable as a field (and store key part), else raise ValueError."""
    if not isinstance(name, str) or _FIELD_RE.fullmatch(name) is None:
        raise ValueError(
            f"invalid field name {short_repr(name)}: use 1-64 characters [A-Za-z0-9_-],"
            " starting with a letter"
        )
    return name


def field_array_paths(name: str, kind: str, ndim: int) -> dict[str, str]:
    """role -> array path of a field, as the layout fixes them."""
    if kind in ("scalar", "fixed"):
        return {"values": name}
    roles = ("data", "offsets", "shapes") if kind == "ragged" and ndim > 1 else ("data", "offsets")
    return {role: f"{name}/{role}" for role in roles}


def check_dtype(v: Any, where: str) -> str:
    """One of DTYPES, spelled exactly (no byte-order variants, no numpy parsing)."""
    if not isinstance(v, str) or v not in DTYPES:
        raise FormatError(
            f"{where}: unsupported dtype {short_repr(v)} (want one of {', '.join(DTYPES)})"
        )
    return v
