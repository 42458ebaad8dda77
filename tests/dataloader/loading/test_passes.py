"""Passes of StreamingLoader: how a pass ends (complete, `break`, `close()`, a newer
`iter()`), where the next one starts (also after a resume), that an explicit epoch wins, and
that any rank's state resumes every rank without losing an item."""

from __future__ import annotations

import json

import pytest

import dataloader

N = 40


@pytest.fixture(scope="module")
def uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("passes") / "ds"
    dataloader.write_dataset(str(path), [{"id": i} for i in range(N)], rows_per_chunk=4)
    return str(path)


def _loader(uri: str, nw: int = 0, **kw: object) -> dataloader.StreamingLoader:
    ds = dataloader.StreamingDataset(uri, shuffle=True, seed=1, **kw)
    return dataloader.StreamingLoader(ds, batch_size=5, num_workers=nw)


def _ids(batches: object) -> list[int]:
    return [int(x) for b in batches for x in b["id"]]


@pytest.mark.parametrize("nw", [0, 2])
def test_close_mid_pass_interrupts_it_and_never_completes_it(uri: str, nw: int) -> None:
    loader = _loader(uri, nw)
    epoch0 = _ids(_loader(uri))
    seen = []
    for i, batch in enumerate(loader):
        seen += [int(x) for x in batch["id"]]
        if i == 1:
            loader.close()  # the loop then ends, as after `break`
    assert seen == epoch0[:10]
    st = loader.state_dict()
    assert (st["epoch"], st["consumed"]) == (0, 10)
    assert loader.epoch == 0 and _ids(loader) == epoch0  # the pass restarts at its start


def test_a_newer_iter_stops_the_running_pass_with_a_clear_error(uri: str) -> None:
    loader = _loader(uri, 2)
    epoch0 = _ids(_loader(uri))
    outer = iter(loader)
    next(outer)
    inner = iter(loader)
    assert _ids([next(inner)]) == epoch0[:5]  # restarted from the pass's start point
    with pytest.raises(RuntimeError, match="newer iter"):
        next(outer)
    assert _ids(inner) == epoch0[5:]
    assert loader.state_dict()["epoch"] == 1


def test_an_interrupted_resumed_pass_restarts_at_the_resumed_point(uri: str) -> None:
    a = _loader(uri)
    it = iter(a)
    head = _ids([next(it) for _ in range(3)])
    state = json.loads(json.dumps(a.state_dict()))
    it.close()
    b = _loader(uri)
    b.load_state_dict(state)
    it = iter(b)
    first = _ids([next(it)])
    it.close()
    assert b.state_dict() == {**state, "consumed": 20}
    again = _ids(b)
    assert again[:5] == first and head + again == _ids(_loader(uri))
    assert b.epoch == 0 and b.state_dict()["epoch"] == 1


def test_direct_iteration_restarts_at_the_resumed_point_too(uri: str) -> None:
    ds = dataloader.StreamingDataset(uri, shuffle=True, seed=1)
    ds.load_state_dict(ds.state_dict(consumed=7))
    for n, _ in enumerate(ds):
        if n == 2:
            break
    assert ds.remaining() == N - 7
    assert len([s for s in ds]) == N - 7


def test_explicit_dataset_epoch_wins_after_a_complete_pass(uri: str) -> None:
    loader = _loader(uri)
    for epoch in (0, 1, 3, 3):
        loader.dataset.set_epoch(epoch)
        ref = _loader(uri)
        ref.set_epoch(epoch)
        assert _ids(loader) == _ids(ref) and loader.epoch == epoch
        assert loader.state_dict()["epoch"] == epoch + 1


def test_any_ranks_state_keeps_the_other_ranks_last_item(tmp_path) -> None:
    """2 ranks, 21 items (shares 11 and 10), batches of 5: after two steps rank 1 is done but
    rank 0 is not, so rank 1's state must not say 'next epoch'."""
    uri = str(tmp_path / "ds")
    dataloader.write_dataset(uri, [{"id": i} for i in range(21)], rows_per_chunk=4)

    def make(rank: int, **kw: object) -> dataloader.StreamingLoader:
        ds = dataloader.StreamingDataset(uri, shuffle=True, seed=3, rank=rank, world_size=2)
        return dataloader.StreamingLoader(ds, batch_size=5, num_workers=0, **kw)

    loaders = [make(0), make(1)]
    its = [iter(x) for x in loaders]
    seen = _ids([next(it) for _ in range(2) for it in its])
    states = [x.state_dict() for x in loaders]
    assert [(s["epoch"], s["consumed"]) for s in states] == [(0, 10), (0, 10)]
    for st in states:
        rest = []
        for r in (0, 1):
            x = make(r)
            x.load_state_dict(st)
            rest += _ids(x)
        assert sorted(seen + rest) == list(range(21))
    # with drop_last both ranks are done after two steps: the next epoch, from either rank
    dropped = [make(0, drop_last=True), make(1, drop_last=True)]
    for x in dropped:
        assert len(_ids(x)) == 10 and x.state_dict()["epoch"] == 1


def test_arguments_are_checked_with_clear_errors(uri: str) -> None:
    with pytest.raises(TypeError, match="takes a StreamingDataset.*got str"):
        dataloader.StreamingLoader(uri)
    with pytest.raises(TypeError, match="takes StreamingDatasets.*got str"):
        dataloader.MixedLoader([uri], [1], 4)
    with pytest.raises(ValueError, match="io_threads: expected an int >= 0, got -1"):
        dataloader.StreamingDataset(uri, io_threads=-1)
    with pytest.raises(ValueError, match="io_threads: expected an int >= 0, got '2'"):
        dataloader.StreamingDataset(uri, io_threads="2")
    ds = dataloader.StreamingDataset(uri)
    with pytest.raises(ValueError, match="num_workers: expected an int >= 0"):
        dataloader.StreamingLoader(ds, num_workers=-1)
    with pytest.raises(ValueError, match="prefetch_batches: expected an int >= 1"):
        dataloader.StreamingLoader(ds, prefetch_batches=0)
