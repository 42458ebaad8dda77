"""Scalar values into a field of another numeric type: numpy scalars follow numpy's safe
casting, Python numbers are taken by value (rounded into a float field, never overflowing to
inf), and what is accepted reads back as written (up to that rounding)."""

from __future__ import annotations

import re
import uuid
import warnings

import numpy as np
import pytest

import dataloader


def _write(samples: list[dict]) -> dataloader.StreamingDataset:
    uri = f"memory://scalars-{uuid.uuid4().hex}"
    dataloader.write_dataset(uri, samples)
    return dataloader.StreamingDataset(uri)


@pytest.mark.parametrize(
    ("first", "later", "exc", "words"),
    [
        (np.float32(0.5), np.float64(1e300), TypeError, "expected a float32 scalar, got float64"),
        (np.float32(0.5), np.float64(0.1), TypeError, "expected a float32 scalar, got float64"),
        (np.float16(1.0), 70000, ValueError, "int 70000 does not fit in float16"),
        (np.float16(1.0), 1e6, ValueError, "float 1000000.0 does not fit in float16"),
        (np.float32(0.5), 1e300, ValueError, "float 1e+300 does not fit in float32"),
        (0.5, 10**400, ValueError, "int 10000000000"),
        (np.int32(1), np.int64(2), TypeError, "expected a int32 scalar, got int64"),
        (np.int32(1), 2**40, ValueError, "int 1099511627776 does not fit in int32"),
        (1, 0.5, TypeError, "expected a int64 scalar, got float"),
    ],
    ids=range(9),
)
def test_values_that_would_change_are_refused(first, later, exc, words) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy overflow warning on the way
        with pytest.raises(exc, match=re.escape(f"sample 1, field 'x': {words}")):
            _write([{"x": first}, {"x": later}])


def test_python_numbers_round_into_float_fields_and_read_back() -> None:
    values = [np.float32(0.5), 0.1, 3, np.float16(2.0), np.int8(-3), float("inf"), float("nan")]
    ds = _write([{"x": v} for v in values])
    got = [ds[i]["x"] for i in range(len(values))]
    assert all(g.dtype == np.float32 for g in got)
    assert [float(g) for g in got[:5]] == [0.5, float(np.float32(0.1)), 3.0, 2.0, -3.0]
    assert np.isinf(got[5]) and np.isnan(got[6])
