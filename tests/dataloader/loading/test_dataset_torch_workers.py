"""torch DataLoader worker processes: each reads only the windows it serves; exact resume."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dataloader
from dataloader.order import Piece
from dataloader.order.lanes import remaining, schedule, worker_pieces

torch = pytest.importorskip("torch")

BS, NW = 8, 2


def _ds(uri: str, **kw) -> dataloader.StreamingDataset:
    return dataloader.StreamingDataset(uri, shuffle=True, seed=7, shuffle_window=48,
                                       fields=["id"], torch_batch_size=BS, torch_workers=NW,
                                       **kw)


def _windows_of(uri: str, ids: list[int]) -> list[int]:
    """The window each sample id belongs to in epoch 0."""
    ds = _ds(uri)
    order = ds.epoch_order(0)
    starts = ds.index.block_starts()
    window_of_block = np.empty(ds.index.num_blocks, dtype=np.int64)
    window_of_block[order.block_order] = np.arange(len(order.block_order)) // order.window_blocks
    return [int(window_of_block[np.searchsorted(starts, i, side="right") - 1]) for i in ids]


def test_schedule_deals_whole_windows_to_workers() -> None:
    pieces = [Piece(0, 0, 20), Piece(1, 0, 20), Piece(2, 0, 5), Piece(3, 0, 30)]
    runs = schedule(pieces, 2, 8)
    assert [lane for lane, _ in runs][:4] == [0, 1, 0, 1]
    for wid in range(2):
        windows = {p.window for p in worker_pieces(runs, wid, 2)}
        assert windows == ({0, 2} if wid == 0 else {1, 3})
    # resuming after 3 runs: the lane of the next run goes to worker 0
    rest = remaining(runs, 24)
    assert worker_pieces(rest, 0, 2)[0].window == 1
    assert sum(p.stop - p.start for _, ps in runs for p in ps) == 75


def test_each_worker_reads_only_its_windows_and_resumes_exactly(small_uri: str) -> None:
    dl = torch.utils.data.DataLoader(_ds(small_uri), batch_size=BS, num_workers=NW)
    batches = [[int(x) for x in b["id"]] for b in dl]
    full = [i for b in batches for i in b]
    assert sorted(full) == list(range(523))
    # window g (in order) is served by worker g % 2: every batch comes from one worker's
    # windows, and the workers take turns while both have windows left
    lanes = [{w % NW for w in _windows_of(small_uri, b)} for b in batches]
    assert all(len(lane) == 1 for lane in lanes)
    assert [lane.pop() for lane in lanes[:6]] == [0, 1, 0, 1, 0, 1]
    # resume from a count of delivered samples (the main process's view)
    for stop in (3, 10):
        ds = _ds(small_uri)
        state = json.loads(json.dumps(ds.state_dict(consumed=stop * BS)))
        ds2 = _ds(small_uri)
        ds2.load_state_dict(state)
        rest = [int(x) for b in torch.utils.data.DataLoader(ds2, batch_size=BS, num_workers=NW)
                for x in b["id"]]
        assert full[: stop * BS] + rest == full
    # the state records the worker layout: another one is refused, not misread
    with pytest.raises(dataloader.StateMismatchError):
        dataloader.StreamingDataset(small_uri, shuffle=True, seed=7, shuffle_window=48,
                                    fields=["id"], torch_batch_size=BS, torch_workers=3
                                    ).load_state_dict(state)


def test_worker_order_state_folds_into_another_world_size(small_uri: str) -> None:
    """Two ranks (each with two torch workers) stop after 5 batches; one rank resumes: every
    remaining sample comes exactly once."""
    seen: list[int] = []
    state = None
    for rank in range(2):
        ds = _ds(small_uri, rank=rank, world_size=2)
        it = iter(ds)  # in the main process: the same order the workers deliver
        seen += [int(next(it)["id"]) for _ in range(5 * BS)]
        state = ds.state_dict()
    one = _ds(small_uri, rank=0, world_size=1)
    one.load_state_dict(state)
    rest = [int(s["id"]) for s in one]
    assert sorted(seen + rest) == list(range(523))
    with pytest.raises(ValueError, match="own threads"):
        dataloader.StreamingLoader(_ds(small_uri), batch_size=BS)
    with pytest.raises(ValueError, match="own threads"):
        dataloader.MixedLoader([_ds(small_uri)], [1.0], batch_size=BS)
