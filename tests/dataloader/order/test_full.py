"""Full-permutation shuffle, random access `ds[i]` and `len(ds)`."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dataloader
from dataloader.errors import StateMismatchError
from dataloader.order.full import FeistelPermutation
from tests.dataloader.conftest import make_samples
from tests.dataloader.resume_contract import assert_resumes_exactly


def _ids(ds: dataloader.StreamingDataset) -> list[int]:
    return [int(s["_index"]) for s in ds]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_feistel_is_a_permutation(n: int) -> None:
    p = FeistelPermutation.make(n, seed=3, epoch=1)
    out = p(np.arange(n))
    assert sorted(out.tolist()) == list(range(n))
    assert p(np.arange(n)).tolist() == out.tolist()  # deterministic
    if n > 5:
        assert out.tolist() != FeistelPermutation.make(n, seed=3, epoch=2)(np.arange(n)).tolist()


def test_full_order_mixes_what_the_window_shuffle_keeps_together(small_uri: str) -> None:
    def run(mode: str, epoch: int = 0) -> list[int]:
        ds = dataloader.StreamingDataset(small_uri, shuffle=True, seed=1, shuffle_mode=mode,
                                         shuffle_window=48, fields=["id"])
        ds.set_epoch(epoch)
        return _ids(ds)

    full, window = run("full"), run("window")
    assert sorted(full) == list(range(523)) and full == run("full")
    assert full != run("full", epoch=1)
    # originally adjacent samples: in window mode they stay within a 48-sample window of each
    # other; in full mode they are as far apart as in a uniform permutation (mean N/3)
    def spread(order: list[int]) -> float:
        pos = np.empty(len(order), dtype=np.int64)
        pos[np.asarray(order)] = np.arange(len(order))
        return float(np.abs(np.diff(pos)).mean()) / (len(order) / 3)

    assert spread(window) < 0.2 and 0.8 < spread(full) < 1.2
    assert abs(np.corrcoef(np.arange(523), full)[0, 1]) < 0.15


def test_full_order_resumes_exactly_and_splits_ranks(small_uri: str) -> None:
    def make() -> dataloader.StreamingLoader:
        ds = dataloader.StreamingDataset(small_uri, shuffle=True, seed=4, shuffle_mode="full",
                                         shuffle_window=40)
        return dataloader.StreamingLoader(ds, batch_size=9, num_workers=2)

    assert_resumes_exactly(make, lambda b: b["id"].tolist(), stops=[0, 5, 30])
    shares = []
    for rank in range(3):
        ds = dataloader.StreamingDataset(small_uri, shuffle=True, seed=4, shuffle_mode="full",
                                         shuffle_window=40, rank=rank, world_size=3)
        shares.append(_ids(ds))
    whole = _ids(dataloader.StreamingDataset(small_uri, shuffle=True, seed=4,
                                             shuffle_mode="full", shuffle_window=40))
    assert shares[0] + shares[1] + shares[2] == whole


def test_full_order_values_and_bounded_block_cache(small_uri: str, small_samples) -> None:
    ds = dataloader.StreamingDataset(small_uri, shuffle=True, shuffle_mode="full",
                                     shuffle_window=32, block_cache_bytes=3000)
    for batch in dataloader.StreamingLoader(ds, batch_size=16):
        for j, i in enumerate(batch["_index"].tolist()):
            want = small_samples[i]
            assert batch["text"][j] == want["text"] and batch["blob"][j] == want["blob"]
            np.testing.assert_array_equal(batch["tokens"][j], want["tokens"])
            np.testing.assert_array_equal(batch["image"][j], want["image"])
        assert ds._blocks.nbytes <= 3000


def test_full_and_window_states_are_not_interchangeable(small_uri: str) -> None:
    full = dataloader.StreamingDataset(small_uri, shuffle=True, shuffle_mode="full")
    state = json.loads(json.dumps(full.state_dict(consumed=10)))
    with pytest.raises(StateMismatchError):
        dataloader.StreamingDataset(small_uri, shuffle=True).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle_mode"):
        dataloader.StreamingDataset(small_uri, shuffle_mode="global")
    with pytest.raises(ValueError, match="window"):
        dataloader.TokenDataset(small_uri, field="tokens", seq_len=8, shuffle_mode="full")


def test_random_access_and_len(tmp_path) -> None:
    samples = make_samples(300, seed=9)
    for workers in (None, 2):  # single stream and partitioned
        uri = str(tmp_path / f"ds-{workers}")
        dataloader.write_dataset(uri, samples, rows_per_chunk=32, workers=workers,
                                 partition_rows=96 if workers else None)
        ds = dataloader.StreamingDataset(uri, shuffle=True, fields=["id", "text", "tokens"])
        assert len(ds) == 300
        for i in (0, 31, 32, 95, 96, 299, 7, 200):
            s = ds[i]
            assert int(s["_index"]) == i and int(s["id"]) == i and s["text"] == samples[i]["text"]
            np.testing.assert_array_equal(s["tokens"], samples[i]["tokens"])
        assert int(ds[-1]["id"]) == 299
        with pytest.raises(IndexError):
            ds[300]
        with pytest.raises(TypeError):
            ds[1.5]  # type: ignore[index]
        half = dataloader.StreamingDataset(uri, rank=1, world_size=2)
        assert len(half) == 150
