"""What items are made of: mixed sources must agree on every field's type, a token field is
1-D, ragged values handed out are read-only views (the blocks behind them are served again),
and MixedLoader's 'first_exhausted' passes resume exactly."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import dataloader


def _write(path, samples, **kw) -> str:
    dataloader.write_dataset(str(path), samples, **kw)
    return str(path)


@pytest.mark.parametrize(
    ("a", "b", "words"),
    [
        (0, 0.5, "field 'x' is int64 scalar in dataset 0 .* but float64 scalar in dataset 1"),
        (0, np.arange(2), "field 'x' is int64 scalar .* but int64 ragged ndim 1"),
        (np.arange(2, dtype=np.int32), np.arange(2), "int32 ragged ndim 1 .* int64 ragged"),
    ],
)
def test_mixed_sources_must_agree_on_field_types(tmp_path, a, b, words) -> None:
    x = _write(tmp_path / "a", [{"x": a}] * 4)
    y = _write(tmp_path / "b", [{"x": b}] * 4)
    with pytest.raises(ValueError, match=words):
        dataloader.MixedLoader(
            [dataloader.StreamingDataset(x), dataloader.StreamingDataset(y)], [1, 1], 2
        )


def test_mixed_token_sources_must_agree_on_seq_len(tmp_path) -> None:
    x = _write(tmp_path / "a", [{"tokens": np.arange(9)}] * 4)
    tok = [dataloader.TokenDataset(x, 4), dataloader.TokenDataset(x, 8)]
    with pytest.raises(ValueError, match="int64 tokens, seq_len 4 .* seq_len 8"):
        dataloader.MixedLoader(tok, [1, 1], 2)
    dataloader.MixedLoader([dataloader.TokenDataset(x, 4), dataloader.TokenDataset(x, 4)],
                           [1, 1], 2)


def test_a_two_dimensional_ragged_field_is_not_a_token_field(tmp_path) -> None:
    x = _write(tmp_path / "a", [{"tokens": np.arange(6).reshape(3, 2)}] * 4)
    with pytest.raises(ValueError, match="not a 1-D integer token field"):
        dataloader.TokenDataset(x, 4)


def test_ragged_values_are_read_only_views(tmp_path) -> None:
    x = _write(tmp_path / "a", [{"id": i, "v": np.full(4, i, np.int32),
                                 "m": np.full((2, 2), i)} for i in range(40)], rows_per_chunk=8)
    ds = dataloader.StreamingDataset(x, shuffle=True, shuffle_mode="full",
                                     block_cache_bytes=1 << 20)
    loader = dataloader.StreamingLoader(ds, batch_size=8, num_workers=0)
    for _ in range(2):  # epoch 1 is served from the blocks kept from epoch 0
        for batch in loader:
            for i, v, m in zip(batch["id"], batch["v"], batch["m"], strict=True):
                assert not v.flags.writeable and not m.flags.writeable
                assert (v == i).all() and (m == i).all()
                with pytest.raises(ValueError, match="read-only"):
                    v *= 2
            batch["id"] *= 2  # stacked columns are fresh arrays: the caller's to change
    with pytest.raises(ValueError, match="read-only"):
        ds[7]["v"][:] = -1
    assert ds[7]["v"].tolist() == [7] * 4
    assert not next(iter(dataloader.StreamingDataset(x)))["v"].flags.writeable
    with warnings.catch_warnings():  # torch copies what it cannot share: no warning
        warnings.simplefilter("error")
        torch_loader = dataloader.StreamingLoader(ds, batch_size=8, collate="torch")
        batch = next(iter(torch_loader))
        batch["v"][0] *= 2
        batch["m"][0] *= 2


def _mix(a: str, b: str, drop_last: bool) -> dataloader.MixedLoader:
    ds = [dataloader.StreamingDataset(a, shuffle=True, seed=0),
          dataloader.StreamingDataset(b, shuffle=True, seed=1)]
    return dataloader.MixedLoader(ds, [1, 1], 4, stopping="first_exhausted", num_workers=0,
                                  drop_last=drop_last)


def _take(loader: dataloader.MixedLoader, n: int) -> list[list[int]]:
    out: list[list[int]] = []
    for _ in range(n):  # passes; every pass yields at least one batch
        for batch in loader:
            out.append(batch["id"].tolist())
            if len(out) == n:
                return out
    return out


@pytest.mark.parametrize("drop_last", [False, True])
def test_first_exhausted_resumes_as_the_uninterrupted_run(tmp_path, drop_last) -> None:
    """Source a (5 items) runs out every few batches; a state taken after any batch resumes
    with exactly the batches the uninterrupted run gives, pass ends included."""
    a = _write(tmp_path / "a", [{"id": i} for i in range(5)], rows_per_chunk=1)
    b = _write(tmp_path / "b", [{"id": 1000 + i} for i in range(200)], rows_per_chunk=10)
    n = 12
    full = _take(_mix(a, b, drop_last), n)
    assert len(full) == n and (drop_last or any(len(x) < 4 for x in full))
    for stop in range(1, n):
        first = _mix(a, b, drop_last)
        head = _take(first, stop)
        second = _mix(a, b, drop_last)
        second.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert head + _take(second, n - stop) == full, stop
