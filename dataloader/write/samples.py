"""Samples in: checking each sample against its fields' types, and choosing the blocks.

A sample is a dict of field -> value (numpy array, int, float, bool, numpy scalar, bytes, str).
The first sample fixes each field's `Spec` (kind, dtype, shape or ndim; `schema` may declare a
kind); every sample is checked against the specs before anything of it is kept, and a bad one
raises TypeError/ValueError naming the sample index and field. `choose_rows_per_chunk` sizes
a block (the unit of reading) from the first samples (the *probe*: up to PROBE_SAMPLES samples
or PROBE_BYTES of data).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format.spec import KINDS, MAX_NDIM, validate_field_name

PROBE_SAMPLES = 1024
PROBE_BYTES = 32 << 20



@dataclass
class Spec:
    """A field's inferred (or declared) type."""

    name: str
    kind: str
    dtype: np.dtype
    shape: tuple[int, ...] | None = None
    ndim: int = 0


def _bad(i: int, name: str, msg: str, exc: type[Exception] = TypeError) -> Exception:
    return exc(f"sample {i}, field {name!r}: {msg}")


def _infer(i: int, name: str, value: Any, declared: str | None) -> Spec:
    """Infer a field's spec from its first value (and an optional declared kind)."""
    if declared is not None and declared not in KINDS:
        raise ValueError(
            f"schema for field {name!r}: unknown kind {declared!r} (use one of {KINDS})"
        )
    if isinstance(value, bool | int | float | np.generic) or (
        isinstance(value, np.ndarray) and value.ndim == 0
    ):
        if isinstance(value, int) and not isinstance(value, bool):
            if not _fits_int64(value):
                raise _bad(i, name, f"int {value} does not fit in int64", ValueError)
            arr = np.asarray(value, dtype=np.int64)
        else:
            arr = np.asarray(value)
        _check_dtype(i, name, arr.dtype)
        kind = declared or "scalar"
        if kind != "scalar":
            raise _bad(i, name, f"declared {kind!r} but the value is a scalar")
        return Spec(name, "scalar", arr.dtype)
    if isinstance(value, np.ndarray):
        _check_dtype(i, name, value.dtype)
        kind = declared or "ragged"
        if value.ndim > MAX_NDIM:
            raise _bad(i, name, f"{value.ndim} dimensions (at most {MAX_NDIM})", ValueError)
        if kind == "fixed" and 0 in value.shape:
            raise _bad(
                i, name, f"fixed shape {value.shape} is empty (declare it 'ragged')", ValueError
            )
        if kind == "fixed":
            return Spec(name, "fixed", value.dtype, tuple(value.shape), value.ndim)
        if kind == "ragged":
            return Spec(name, "ragged", value.dtype, None, value.ndim)
        raise _bad(i, name, f"declared {kind!r} but the value is a numpy array")
    if isinstance(value, bytes | bytearray | memoryview):
        if declared not in (None, "bytes"):
            raise _bad(i, name, f"declared {declared!r} but the value is bytes")
        return Spec(name, "bytes", np.dtype(np.uint8), None, 1)
    if isinstance(value, str):
        if declared not in (None, "str"):
            raise _bad(i, name, f"declared {declared!r} but the value is a str")
        return Spec(name, "str", np.dtype(np.uint8), None, 1)
    raise _bad(
        i,
        name,
        f"unsupported type {type(value).__name__} (use numpy arrays, int, float, bool, bytes, str)",
    )


def _fits_int64(v: int) -> bool:
    return -(2**63) <= v < 2**63


def _check_dtype(i: int, name: str, dt: np.dtype) -> None:
    if dt.kind not in "biufc" or dt.hasobject or dt.fields is not None:
        raise _bad(i, name, f"unsupported dtype {dt} (numeric and bool dtypes only)")


def _check_fits(i: int, spec: Spec, value: int | float) -> None:
    """A Python int or float must fit the field's dtype: ints within an int field's range,
    and finite numbers must stay finite in a float field (rounding, e.g. 0.1 into float32,
    is accepted; overflow to inf is refused with ValueError)."""
    kind = "int" if isinstance(value, int) else "float"
    if spec.dtype.kind in "iu":
        info = np.iinfo(spec.dtype)
        if not info.min <= value <= info.max:
            raise _bad(i, spec.name, f"int {value} does not fit in {spec.dtype}", ValueError)
        return
    try:
        x = float(value)
    except OverflowError:  # an int beyond every float
        x = math.inf
    else:
        if not math.isfinite(x):
            return  # inf and nan are kept as written
        with np.errstate(over="ignore"):
            x = float(abs(spec.dtype.type(x)))
    if not math.isfinite(x):
        raise _bad(i, spec.name, f"{kind} {value!r:.40} does not fit in {spec.dtype} (it would"
                   " be stored as inf)", ValueError)


def _coerce(i: int, spec: Spec, value: Any) -> Any:
    """Check one value against its field's spec; return what the column buffer keeps.
    Scalars: bools only into bool fields; numpy scalars by numpy's safe casting (np.float64
    into a float32 field is refused, as np.int64 into int32 is); Python ints and floats by
    value (see `_check_fits`)."""
    name, kind = spec.name, spec.kind
    if kind == "scalar":
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value[()]
        if isinstance(value, bool | np.bool_):
            ok = spec.dtype.kind == "b"
        elif isinstance(value, np.generic):  # before float: np.float64 is a float
            ok = np.can_cast(value.dtype, spec.dtype, "safe")
        elif isinstance(value, int | float):
            ok = spec.dtype.kind in ("iuf" if isinstance(value, int) else "fc")
            if ok:
                _check_fits(i, spec, value)
        else:
            ok = False
        if not ok:
            raise _bad(
                i, name, f"expected a {spec.dtype} scalar, got {type(value).__name__} {value!r:.40}"
            )
        return value
    if kind in ("fixed", "ragged"):
        if not isinstance(value, np.ndarray):
            raise _bad(
                i, name, f"expected a numpy array of {spec.dtype}, got {type(value).__name__}"
            )
        if not np.can_cast(value.dtype, spec.dtype, "safe"):
            raise _bad(i, name, f"expected dtype {spec.dtype}, got {value.dtype}")
        if kind == "fixed" and value.shape != spec.shape:
            raise _bad(
                i,
                name,
                f"expected shape {spec.shape}, got {value.shape} (declare the field "
                "'ragged' in schema= for variable shapes)",
                ValueError,
            )
        if kind == "ragged" and value.ndim != spec.ndim:
            raise _bad(
                i, name, f"expected {spec.ndim} dimensions, got shape {value.shape}", ValueError
            )
        return value
    if kind == "bytes":
        if not isinstance(value, bytes | bytearray | memoryview):
            raise _bad(i, name, f"expected bytes, got {type(value).__name__}")
        return bytes(value)
    if not isinstance(value, str):
        raise _bad(i, name, f"expected str, got {type(value).__name__}")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad(i, name, f"str is not encodable as UTF-8 ({exc.reason})", ValueError) from None


def as_stored(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`value`'s elements in the field's (little-endian) dtype, C-contiguous: a view when
    they already are."""
    return np.ascontiguousarray(value, dtype=np.dtype(dtype).newbyteorder("<"))


def value_nbytes(spec: Spec, v: Any) -> int:
    if spec.kind == "scalar":
        return spec.dtype.itemsize
    if spec.kind in ("fixed", "ragged"):
        return int(v.size) * spec.dtype.itemsize + (8 if spec.kind == "ragged" else 0)
    return len(v) + 8



def infer_specs(i: int, sample: Mapping[str, Any], schema: Mapping[str, str]) -> dict[str, Spec]:
    """The fields' specs, from sample `i` (the first) and the declared kinds."""
    if not sample:
        raise ValueError(f"sample {i}: a sample needs at least one field")
    specs = {}
    for name, value in sample.items():
        validate_field_name(name)
        specs[name] = _infer(i, name, value, schema.get(name))
    unknown = set(schema) - set(specs)
    if unknown:
        raise ValueError(f"sample {i}: schema names fields {sorted(unknown)} not in the sample")
    return specs


def check_sample(i: int, sample: Mapping[str, Any], specs: dict[str, Spec]) -> dict[str, Any]:
    """Check sample `i` against the specs; return its values as the writer keeps them."""
    keys = set(sample)
    if keys != set(specs):
        missing, extra = sorted(set(specs) - keys), sorted(keys - set(specs))
        parts = ([f"missing field(s) {missing}"] if missing else []) + (
            [f"unexpected field(s) {extra}"] if extra else []
        )
        raise ValueError(f"sample {i}: {', '.join(parts)} (fields are {sorted(specs)})")
    return {name: _coerce(i, spec, sample[name]) for name, spec in specs.items()}


def choose_rows_per_chunk(
    specs: Mapping[str, Spec], probe: list[dict[str, Any]], chunk_bytes: int, final: bool
) -> int:
    """Samples per block: about `chunk_bytes` of the probe's average row, at most 65,536, and
    (when the probe is the whole dataset) at most the number of samples."""
    n = max(1, len(probe))
    per_field = {k: sum(value_nbytes(s, r[k]) for r in probe) / n for k, s in specs.items()}
    row_bytes = max(1.0, sum(per_field.values()))
    R = int(min(max(1, chunk_bytes // row_bytes), 1 << 16))
    return max(1, min(R, len(probe))) if final else R




def probe_samples(
    it: Iterator[Mapping[str, Any]], schema: Mapping[str, str]
) -> tuple[list[Mapping[str, Any]], dict[str, Spec], list[dict[str, Any]], bool]:
    """Read and check the first samples (as DatasetWriter's probe does, with the same
    messages): the samples, their specs, their values as the writer keeps them, and whether
    that was every sample."""
    probe: list[Mapping[str, Any]] = []
    rows: list[dict[str, Any]] = []
    specs: dict[str, Spec] = {}
    size = 0
    for sample in it:
        i = len(probe)
        if not isinstance(sample, Mapping):
            raise TypeError(
                f"sample {i}: expected a dict of field -> value, got {type(sample).__name__}"
            )
        if not specs:
            specs = infer_specs(i, sample, schema)
        rows.append(check_sample(i, sample, specs))
        probe.append(sample)
        size += sum(value_nbytes(specs[k], v) for k, v in rows[-1].items())
        if len(probe) >= PROBE_SAMPLES or size >= PROBE_BYTES:
            return probe, specs, rows, False
    return probe, specs, rows, True
