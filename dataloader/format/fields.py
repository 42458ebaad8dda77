"""One sample field as the index records it: name, kind, dtype, shape and its arrays.

A field's arrays sit at the paths the layout fixes (spec.field_array_paths): 'values' for a
scalar or fixed field; 'data', 'offsets' (and 'shapes' for ragged ndim > 1) for a
variable-length one, whose `block_bounds` give the data element index at each block start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptstore.errors import FormatError

from .spec import (
    BYTES_DTYPE,
    KINDS,
    MAX_NDIM,
    OFFSETS_DTYPE,
    check_dtype,
    field_array_paths,
    validate_field_name,
)
from .validate import check_int, check_keys, get_ints, get_typed, short_repr


@dataclass(frozen=True)
class FieldInfo:
    """One sample field. `arrays` maps role -> array path: 'values' for scalar/fixed fields;
    'data', 'offsets' (and 'shapes' for ragged ndim > 1) for variable-length ones."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...] | None  # fixed: per-sample shape
    ndim: int  # per-sample number of dimensions (0 for scalar; 1 for bytes/str)
    arrays: dict[str, str]
    block_bounds: tuple[int, ...] | None  # variable: data element index at each block start

    @property
    def variable(self) -> bool:
        return self.kind in ("ragged", "bytes", "str")

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "dtype": self.dtype,
            "ndim": self.ndim,
            "arrays": dict(self.arrays),
        }
        if self.shape is not None:
            d["shape"] = list(self.shape)
        if self.block_bounds is not None:
            d["block_bounds"] = list(self.block_bounds)
        return d

    @classmethod
    def from_json(cls, d: Any, where: str) -> FieldInfo:
        check_keys(d, where, ("name", "kind", "dtype", "ndim", "arrays"), ("shape", "block_bounds"))
        try:
            name = validate_field_name(d["name"])
        except ValueError as exc:
            raise FormatError(f"{where}.name: {exc}") from None
        where = f"{where} (field {name!r})"
        kind = d["kind"]
        if not isinstance(kind, str) or kind not in KINDS:
            raise FormatError(f"{where}.kind: unknown field kind {short_repr(kind)}")
        dtype = check_dtype(d["dtype"], f"{where}.dtype")
        ndim = check_int(d["ndim"], f"{where}.ndim", 0, MAX_NDIM)
        want_ndim = {"scalar": (0, 0), "bytes": (1, 1), "str": (1, 1)}.get(kind, (1, MAX_NDIM))
        if not want_ndim[0] <= ndim <= want_ndim[1]:
            raise FormatError(f"{where}.ndim: {ndim} is not valid for a {kind} field")
        if kind in ("bytes", "str") and dtype != BYTES_DTYPE:
            raise FormatError(f"{where}.dtype: a {kind} field holds {BYTES_DTYPE}, not {dtype}")
        if ("shape" in d) != (kind == "fixed"):
            raise FormatError(f"{where}: 'shape' is given for fixed fields, and only for them")
        if ("block_bounds" in d) != (kind in ("ragged", "bytes", "str")):
            raise FormatError(
                f"{where}: 'block_bounds' is given for variable-length fields, and only for them"
            )
        shape = get_ints(d, "shape", where, 1, 1, MAX_NDIM) if kind == "fixed" else None
        if shape is not None and len(shape) != ndim:
            raise FormatError(f"{where}.ndim: {ndim}, but 'shape' has {len(shape)} dimensions")
        bounds = get_ints(d, "block_bounds", where, 0, 1) if "block_bounds" in d else None
        arrays = get_typed(d, "arrays", dict, where)
        want = field_array_paths(name, kind, ndim)
        if arrays != want:
            raise FormatError(
                f"{where}.arrays: expected {want}, got {short_repr(arrays)} (array path "
                "and role names are fixed by the layout)"
            )
        return cls(
            name=name,
            kind=kind,
            dtype=dtype,
            shape=None if shape is None else tuple(shape),
            ndim=ndim,
            arrays=dict(arrays),
            block_bounds=None if bounds is None else tuple(bounds),
        )

    def array_layout(self, n: int, rows_per_chunk: int) -> dict[str, tuple[Any, ...]]:
        """role -> (dtype, shape, chunk_shape) the field's arrays must have for n samples in
        blocks of rows_per_chunk (None: not fixed by the field; the data array's length and
        chunking are checked against block_bounds instead)."""
        r = rows_per_chunk
        if not self.variable:
            inner = self.shape or ()
            return {"values": (self.dtype, (n, *inner), (r, *inner))}
        out: dict[str, tuple[Any, ...]] = {
            "data": (self.dtype, None, None),
            "offsets": (OFFSETS_DTYPE, (n + 1,), (r,)),
        }
        if "shapes" in self.arrays:
            out["shapes"] = (OFFSETS_DTYPE, (n, self.ndim), (r, self.ndim))
        return out
