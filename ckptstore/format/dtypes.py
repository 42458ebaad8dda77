"""The element types ckptstore stores, by name, with the numpy type their raw bytes are held in.

Types numpy lacks (bfloat16, float8 variants, complex32, float4 pairs) are stored as raw bits in
an unsigned integer of the same width; the real type is kept by name in the manifest, and the
zarr metadata says `uint16`/`uint8`/`uint32` so zarr-python can still read the bits.
All data is stored little-endian.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..errors import FormatError


@dataclass(frozen=True)
class DType:
    """One storable element type."""

    name: str  # ckptstore's name, equal to torch's attribute name (torch.<name>)
    storage: str  # numpy dtype string of the stored bits ('<f4', '|u1', ...)
    numpy_native: bool  # True if numpy has this type itself (so numpy arrays may use it)

    # derived values are cached: they sit on hot paths (every tensor entry, every chunk)
    @cached_property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.storage)

    @cached_property
    def itemsize(self) -> int:
        return self.numpy_dtype.itemsize

    @cached_property
    def zarr_data_type(self) -> str:
        return "bool" if self.numpy_dtype.kind == "b" else self.numpy_dtype.name


_TABLE = [
    DType("bool", "|b1", True),
    DType("uint8", "|u1", True),
    DType("int8", "|i1", True),
    DType("int16", "<i2", True),
    DType("uint16", "<u2", True),
    DType("int32", "<i4", True),
    DType("uint32", "<u4", True),
    DType("int64", "<i8", True),
    DType("uint64", "<u8", True),
    DType("float16", "<f2", True),
    DType("float32", "<f4", True),
    DType("float64", "<f8", True),
    DType("complex64", "<c8", True),
    DType("complex128", "<c16", True),
    DType("bfloat16", "<u2", False),
    DType("complex32", "<u4", False),
    DType("float8_e4m3fn", "|u1", False),
    DType("float8_e5m2", "|u1", False),
    DType("float8_e4m3fnuz", "|u1", False),
    DType("float8_e5m2fnuz", "|u1", False),
    DType("float8_e8m0fnu", "|u1", False),
    DType("float4_e2m1fn_x2", "|u1", False),
]
DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}
_BY_NUMPY: dict[str, DType] = {d.numpy_dtype.name: d for d in _TABLE if d.numpy_native}


def by_name(name: object) -> DType:
    """Look up a stored dtype name; FormatError for anything unknown."""
    if not isinstance(name, str) or name not in DTYPES:
        raise FormatError(f"unknown dtype {name!r}")
    return DTYPES[name]


def from_numpy(dtype: np.dtype) -> DType | None:
    """The DType for a numpy dtype (any byte order), or None if numpy's type is not storable."""
    if dtype.fields is not None or dtype.subdtype is not None:
        return None
    return _BY_NUMPY.get(dtype.name)  # the name ignores byte order: '>f4' is 'float32'
