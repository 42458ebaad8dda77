"""Arrow record batches -> samples (Parquet and Hugging Face datasets share it).

Column types: integers, floats and bools become scalars; strings become str; binary becomes
bytes; a list (or fixed-size list) of numbers or bools becomes a 1-d array per row, a list of
such lists a 2-d array (rows of equal length). Nulls, structs, maps, dictionaries of other
types, dates and the like are refused with a TypeError naming the column: convert them to
one of these types first."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from ..format.spec import validate_field_name
from .base import Sample

Column = Callable[[int], Any]  # row number in the batch -> value


def require_pyarrow(what: str) -> Any:
    try:
        import pyarrow
    except ImportError:
        raise ImportError(
            f"reading {what} needs pyarrow: pip install 'ckptstore[parquet]'"
        ) from None
    return pyarrow


def _is_number(pa: Any, t: Any) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


def _list_column(pa: Any, arr: Any, name: str, where: str) -> Column:
    t = arr.type
    inner = t.value_type
    if pa.types.is_fixed_size_list(t):  # values ignore a slice's offset; offsets do not
        offsets = (arr.offset + np.arange(len(arr) + 1, dtype=np.int64)) * t.list_size
    else:
        offsets = arr.offsets.to_numpy()
    values = arr.values
    if values.null_count:
        raise ValueError(f"{where}: column {name!r} has null values inside its lists")
    if _is_number(pa, inner):
        flat = values.to_numpy(zero_copy_only=False)
        return lambda i: flat[offsets[i] : offsets[i + 1]]
    if pa.types.is_list(inner) or pa.types.is_large_list(inner) or pa.types.is_fixed_size_list(
        inner
    ):
        if not _is_number(pa, inner.value_type):
            raise TypeError(f"{where}: column {name!r} has type {t} (nested lists of numbers only)")
        sub = _list_column(pa, values, name, where)

        def rows2d(i: int) -> np.ndarray:
            parts = [sub(j) for j in range(int(offsets[i]), int(offsets[i + 1]))]
            if not parts:
                return np.zeros((0, 0), dtype=flat_dtype(pa, inner.value_type))
            if len({len(p) for p in parts}) > 1:
                raise ValueError(f"{where}: column {name!r}, row {i}: inner lists differ in length")
            return np.stack(parts)

        return rows2d
    raise TypeError(f"{where}: column {name!r} has type {t} (lists of numbers or bools only)")


def flat_dtype(pa: Any, t: Any) -> np.dtype:
    return np.dtype(t.to_pandas_dtype())  # type: ignore[no-any-return]


def _column(pa: Any, arr: Any, name: str, where: str) -> Column:
    if arr.null_count:
        raise ValueError(
            f"{where}: column {name!r} has {arr.null_count} null value(s) (fill or drop them)"
        )
    t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    if _is_number(pa, t):
        values = arr.to_numpy(zero_copy_only=False)
        return lambda i: values[i]
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        strs = arr.to_pylist()
        return lambda i: strs[i]
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        blobs = arr.to_pylist()
        return lambda i: blobs[i]
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _list_column(pa, arr, name, where)
    raise TypeError(
        f"{where}: column {name!r} has type {t}, which does not convert (use numbers, bools,"
        " strings, binary or lists of numbers)"
    )


def check_schema(schema: Any, where: str) -> None:
    """Field names must be usable as dataset fields (ValueError naming the column)."""
    if not len(schema.names):
        raise ValueError(f"{where}: no columns")
    for name in schema.names:
        try:
            validate_field_name(name)
        except ValueError as exc:
            raise ValueError(f"{where}: column {name!r}: {exc}") from None


def batch_samples(batch: Any, where: str) -> Iterator[Sample]:
    """The rows of a pyarrow RecordBatch as samples."""
    pa = require_pyarrow("Arrow data")
    names = list(batch.schema.names)
    columns = [_column(pa, batch.column(k), name, where) for k, name in enumerate(names)]
    for i in range(batch.num_rows):
        yield {name: col(i) for name, col in zip(names, columns)}


def file_samples(path: Any, schema: Any, batches: Iterable[Any]) -> Iterator[Sample]:
    """The samples of one Arrow-backed file: `schema` checked, then its record `batches` in
    order. A batch that cannot be read raises ValueError naming the file and the row where
    reading stopped."""
    pa = require_pyarrow("Arrow data")
    check_schema(schema, str(path))
    row = 0
    try:
        for batch in batches:
            yield from batch_samples(batch, f"{path}, rows {row}-{row + batch.num_rows - 1}")
            row += batch.num_rows
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: unreadable after row {row} ({exc})") from None
