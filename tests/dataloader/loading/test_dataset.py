"""Order, partition and exact resume: the heart of the loader's contract."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dataloader
from dataloader.order import advance, complement, merge_intervals, rank_plan
from tests.dataloader.conftest import ids_of


def _ds(uri, **kw):
    kw.setdefault("shuffle", True)
    kw.setdefault("seed", 7)
    kw.setdefault("shuffle_window", 64)
    return dataloader.StreamingDataset(uri, fields=["id"], **kw)


def _run(
    uri, world, *, state=None, take=None, batch_size=8, num_workers=2, balance="none", epoch=None
):
    """Per rank: (ids delivered, state after them)."""
    out = []
    for r in range(world):
        loader = dataloader.StreamingLoader(
            _ds(uri, rank=r, world_size=world, balance=balance),
            batch_size=batch_size,
            num_workers=num_workers,
        )
        if state is not None:
            loader.load_state_dict(state)
        if epoch is not None:
            loader.set_epoch(epoch)
        got: list[int] = []
        for b in loader:
            got.extend(int(x) for x in b["_index"])
            if take is not None and len(got) >= take:
                break
        out.append((got, loader.state_dict()))
    return out


def test_order_depends_only_on_seed_epoch_dataset(small_uri):
    a = ids_of(dataloader.StreamingLoader(_ds(small_uri), batch_size=10, num_workers=0))
    b = ids_of(dataloader.StreamingLoader(_ds(small_uri), batch_size=3, num_workers=4))
    c = [int(s["_index"]) for s in _ds(small_uri, io_threads=1)]
    assert a == b == c
    assert sorted(a) == list(range(523)) and a != sorted(a)
    d = ids_of(dataloader.StreamingLoader(_ds(small_uri, seed=8), batch_size=10))
    assert d != a and sorted(d) == sorted(a)
    ds = _ds(small_uri)
    ds.set_epoch(1)
    e = ids_of(dataloader.StreamingLoader(ds, batch_size=10))
    assert e != a and sorted(e) == sorted(a)


def test_no_shuffle_is_sequential(small_uri):
    ids = ids_of(dataloader.StreamingLoader(_ds(small_uri, shuffle=False), batch_size=64))
    assert ids == list(range(523))


def test_loader_advances_epochs(small_uri):
    loader = dataloader.StreamingLoader(_ds(small_uri), batch_size=100)
    e0, e1 = ids_of(loader), ids_of(loader)
    assert loader.epoch == 1 and e0 != e1 and sorted(e0) == sorted(e1)
    assert loader.state_dict()["epoch"] == 2


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("balance", ["none", "drop", "pad"])
def test_ranks_partition_the_epoch(small_uri, world, balance):
    runs = [got for got, _ in _run(small_uri, world, balance=balance)]
    counts = [len(g) for g in runs]
    flat = [x for g in runs for x in g]
    if balance == "none":
        assert sorted(flat) == list(range(523)) and max(counts) - min(counts) <= 1
    elif balance == "drop":
        assert len(set(flat)) == len(flat) == world * (523 // world)
        assert len(set(counts)) == 1
    else:
        assert set(flat) == set(range(523)) and len(set(counts)) == 1
        assert len(flat) == world * -(-523 // world)


@pytest.mark.parametrize(
    ("w1", "w2", "nw2"), [(1, 1, 0), (2, 2, 3), (1, 3, 1), (3, 2, 2), (4, 1, 0), (2, 5, 2)]
)
def test_exact_resume_any_topology(small_uri, w1, w2, nw2):
    full = [got for got, _ in _run(small_uri, w1)]
    first = _run(small_uri, w1, take=40)
    states = [st for _, st in first]
    assert all(st == {**states[0], "rank": st["rank"]} for st in states)  # lockstep: same state
    state = json.loads(json.dumps(states[0]))  # survives JSON
    rest = [got for got, _ in _run(small_uri, w2, state=state, num_workers=nw2, batch_size=5)]
    consumed = [x for got, _ in first for x in got]
    remaining = [x for g in rest for x in g]
    assert sorted(consumed + remaining) == list(range(523))  # each sample exactly once
    if w1 == w2:  # same topology: the continuation is the uninterrupted run's
        for r in range(w1):
            assert first[r][0] + rest[r] == full[r]


def test_resume_twice_through_topology_changes(small_uri):
    a = _run(small_uri, 2, take=24)
    b = _run(small_uri, 3, state=a[0][1], take=16)
    c = _run(small_uri, 1, state=b[0][1])
    seen = [x for run in (a, b, c) for got, _ in run for x in got]
    assert sorted(seen) == list(range(523))


def test_resume_does_not_read_consumed_data(small_uri):
    ds = _ds(small_uri, shuffle=False, shuffle_window=16)
    loader = dataloader.StreamingLoader(ds, batch_size=16, num_workers=0)
    it = iter(loader)
    for _ in range(20):
        next(it)
    state = loader.state_dict()
    it.close()
    ds2 = _ds(small_uri, shuffle=False, shuffle_window=16)
    loader2 = dataloader.StreamingLoader(ds2, batch_size=16, num_workers=0)
    loader2.load_state_dict(state)
    first = next(iter(loader2))
    assert int(first["_index"][0]) == 320
    assert ds2.metrics.requests <= 4  # one block's worth of chunks, not 20 blocks


def test_state_mid_epoch_and_resume_after_epoch_end(small_uri):
    loader = dataloader.StreamingLoader(_ds(small_uri), batch_size=100)
    list(loader)
    st = loader.state_dict()
    assert st["epoch"] == 1 and st["consumed"] == 0
    l2 = dataloader.StreamingLoader(_ds(small_uri), batch_size=100)
    l2.load_state_dict(st)
    ref = _ds(small_uri)
    ref.set_epoch(1)
    assert ids_of(l2) == ids_of(dataloader.StreamingLoader(ref, batch_size=7))


def test_foreign_state_is_refused(small_uri, tmp_path, small_samples):
    other = str(tmp_path / "other")
    dataloader.write_dataset(other, small_samples[:100], rows_per_chunk=16)
    loader = dataloader.StreamingLoader(_ds(other), batch_size=4)
    next(iter(loader))
    state = loader.state_dict()
    mine = dataloader.StreamingLoader(_ds(small_uri), batch_size=4)
    with pytest.raises(dataloader.StateMismatchError, match="another dataset"):
        mine.load_state_dict(state)
    own = dataloader.StreamingLoader(_ds(small_uri), batch_size=4).state_dict()
    with pytest.raises(dataloader.StateMismatchError, match="seed"):
        dataloader.StreamingLoader(_ds(small_uri, seed=99), batch_size=4).load_state_dict(own)
    with pytest.raises(dataloader.StateMismatchError, match="version"):
        mine.load_state_dict({**own, "version": 99})
    with pytest.raises(dataloader.StateMismatchError):
        mine.load_state_dict({"hello": 1})


def test_state_is_small_and_plain(small_uri):
    loader = dataloader.StreamingLoader(_ds(small_uri, rank=1, world_size=3), batch_size=4)
    it = iter(loader)
    next(it)
    st = loader.state_dict()
    it.close()
    text = json.dumps(st)
    assert len(text) < 1000
    assert st["version"] == 1 and st["fingerprint"] == loader.dataset.fingerprint


def test_torch_distributed_topology_is_detected(small_uri, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    ds = _ds(small_uri)
    assert ds.topology() == (1, 4)
    assert len(ds) in (130, 131)
    assert _ds(small_uri, rank=0, world_size=1).topology() == (0, 1)


def test_interval_helpers():
    iv = merge_intervals(np.array([[5, 7], [0, 2], [2, 3], [6, 9], [4, 4]]))
    assert iv.tolist() == [[0, 3], [5, 9]]
    assert complement(iv, 12).tolist() == [[3, 5], [9, 12]]
    plan = rank_plan(10, np.zeros((0, 2)), 3, 2, "pad")
    assert plan.segments == ((7, 10),) and plan.pads == 1 and plan.pad_item == 7
    plan = rank_plan(10, np.zeros((0, 2)), 3, 1, "pad")
    assert plan.total == 4 and plan.after(3) == [(4, 5)]
    assert rank_plan(10, np.zeros((0, 2)), 3, 0, "drop").segments == ((0, 3),)
    done = advance(10, np.zeros((0, 2)), 3, "none", 2)
    assert done.tolist() == [[0, 2], [4, 6], [7, 9]]


def test_old_names_of_the_torch_worker_options_still_work(small_uri):
    """StreamingDataset's `num_workers` and `batch_size` (the DataLoader's, for torch worker
    processes) are now `torch_workers` and `torch_batch_size`, since for the loaders those words
    mean request threads and batch size: the old keywords still work, with a DeprecationWarning
    attributed to the caller, and make the same dataset."""
    new = _ds(small_uri, torch_workers=2, torch_batch_size=8)
    with pytest.warns(DeprecationWarning, match="is deprecated") as caught:
        old = _ds(small_uri, num_workers=2, batch_size=8)
    assert len(caught) == 2 and {w.filename for w in caught} == {__file__}
    assert (old.torch_workers, old.torch_batch_size) == (2, 8)
    assert old.order_options() == new.order_options()
    assert old.state_dict(consumed=16) == new.state_dict(consumed=16)
    assert [int(s["_index"]) for s in old] == [int(s["_index"]) for s in new]
    with pytest.warns(DeprecationWarning, match="torch_workers"):
        assert old.num_workers == 2
    with pytest.warns(DeprecationWarning, match="torch_batch_size"):
        assert old.batch_size == 8
    with pytest.raises(TypeError, match="not both"):
        _ds(small_uri, num_workers=2, torch_workers=2)
    with pytest.raises(ValueError, match="own threads"):
        with pytest.warns(DeprecationWarning):
            dataloader.StreamingLoader(_ds(small_uri, num_workers=2, batch_size=8))
