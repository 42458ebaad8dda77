"""Epochs under a real Lightning Trainer and torch's DataLoader: every epoch a new full
permutation, `len()` always the epoch's length, and a mid-epoch resume that continues exactly
and then runs the epochs the uninterrupted run would have run."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

import dataloader

N, B = 40, 4  # 10 batches per epoch
SAVE_AT = (1, 3)  # (epoch, batch): the state is taken after 4 batches of epoch 1


@pytest.fixture(scope="module")
def uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("epochs") / "ds"
    dataloader.write_dataset(str(path), [{"id": i} for i in range(N)], rows_per_chunk=4)
    return str(path)


class Recorder(pl.LightningModule):
    """Records the sample order per epoch; takes `state()` at SAVE_AT; calls `on_epoch` at
    each epoch start (what a caller does where the loader cannot know the epoch)."""

    def __init__(self, state: Callable[[int], dict], on_epoch: Callable[[int], None]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: dict[int, list[int]] = {}
        self.state_fn, self.on_epoch = state, on_epoch
        self.saved: dict | None = None

    def on_train_epoch_start(self) -> None:
        self.on_epoch(self.current_epoch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        got = self.seen.setdefault(self.current_epoch, [])
        got.extend(int(x) for x in batch["_index"])
        if (self.current_epoch, batch_idx) == SAVE_AT:  # through JSON, as a checkpoint keeps it
            self.saved = json.loads(json.dumps(self.state_fn(len(got))))
        return (self.w * batch["id"].float()).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@dataclass
class Kind:
    loader: Any
    state: Callable[[int], dict]  # items delivered in this pass -> state
    load: Callable[[dict], None]
    set_epoch: Callable[[int], None]  # data epoch -> what the caller does at its start


def _make(kind: str, uri: str) -> Kind:
    opts: dict[str, Any] = {"shuffle": True, "seed": 3, "shuffle_window": 8, "fields": ["id"]}
    if kind == "streaming":
        ds = dataloader.StreamingDataset(uri, **opts)
        loader = dataloader.StreamingLoader(ds, batch_size=B, num_workers=1, collate="torch")
        return Kind(loader, lambda n: loader.state_dict(), loader.load_state_dict,
                    lambda e: None)
    if kind == "torch":
        ds = dataloader.StreamingDataset(uri, **opts)
        return Kind(torch.utils.data.DataLoader(ds, batch_size=B), lambda n: ds.state_dict(),
                    ds.load_state_dict, lambda e: None)
    ds = dataloader.StreamingDataset(uri, torch_batch_size=B, torch_workers=2, **opts)
    # worker processes: the main process's dataset cannot see a pass end, so the caller sets
    # the epoch, and counts what it consumed (docs/dataloader.md, "torch's DataLoader")
    return Kind(torch.utils.data.DataLoader(ds, batch_size=B, num_workers=2),
                lambda n: ds.state_dict(consumed=n), ds.load_state_dict, ds.set_epoch)


def _fit(k: Kind, epochs: int, first_epoch: int = 0) -> Recorder:
    module = Recorder(k.state, lambda e: k.set_epoch(first_epoch + e))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs,
                         enable_checkpointing=False, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers).*")
        trainer.fit(module, train_dataloaders=k.loader)
    return module


@pytest.mark.parametrize("kind", ["streaming", "torch", "torch-workers"])
def test_lightning_epochs_reshuffle_and_resume_mid_epoch(uri: str, kind: str) -> None:
    k = _make(kind, uri)
    assert len(k.loader) == N // B
    run = _fit(k, 3)
    epochs = [run.seen[e] for e in range(3)]
    assert all(sorted(e) == list(range(N)) for e in epochs)  # each a full permutation
    assert len({tuple(e) for e in epochs}) == 3  # every epoch its own order
    assert run.saved is not None and run.saved["epoch"] == 1
    # a new loader resumes from the state taken in epoch 1, under a new Trainer
    k2 = _make(kind, uri)
    k2.load(run.saved)
    assert len(k2.loader) == N // B  # the epoch's length, not the 6 batches left
    rest = _fit(k2, 2, first_epoch=run.saved["epoch"])
    done = (SAVE_AT[1] + 1) * B
    assert rest.seen[0] == epochs[1][done:]  # exactly the rest of epoch 1
    assert rest.seen[1] == epochs[2]  # then epoch 2 in full, as the uninterrupted run had it


def test_state_at_the_end_of_an_epoch_is_the_next_epoch(uri: str) -> None:
    """A pass that delivered everything is complete even without StopIteration: its state,
    `len()` and the next iteration all move to the next epoch."""
    ds = dataloader.StreamingDataset(uri, shuffle=True, seed=3, shuffle_window=8)
    it = iter(ds)
    first = [int(next(it)["_index"]) for _ in range(N)]  # all of epoch 0, no StopIteration
    st = ds.state_dict()
    assert (st["epoch"], st["consumed"]) == (1, 0) and len(ds) == N
    second = [int(s["_index"]) for s in ds]
    assert sorted(second) == list(range(N)) and second != first and ds.epoch == 1
    loader = dataloader.StreamingLoader(
        dataloader.StreamingDataset(uri, shuffle=True, seed=3, shuffle_window=8), batch_size=B)
    it2 = iter(loader)
    got = [int(x) for _ in range(N // B) for x in next(it2)["_index"]]
    assert got == first and loader.state_dict()["epoch"] == 1
    assert [int(x) for b in loader for x in b["_index"]] == second


def test_torch_workers_len_and_persistent_workers(uri: str) -> None:
    opts: dict[str, Any] = {"shuffle": True, "seed": 3, "shuffle_window": 8,
                            "torch_batch_size": B, "torch_workers": 2}
    ds = dataloader.StreamingDataset(uri, **opts)
    ds.load_state_dict(ds.state_dict(consumed=3 * B))
    dl = torch.utils.data.DataLoader(ds, batch_size=B, num_workers=2)
    assert len(dl) == N // B and ds.remaining() == N - 3 * B
    assert len([b for b in dl]) == N // B - 3
    ds2 = dataloader.StreamingDataset(uri, **opts)
    assert ds2.state_dict(consumed=N) == {**ds2.state_dict(), "epoch": 1}  # the end: next epoch
    keep = torch.utils.data.DataLoader(ds2, batch_size=B, num_workers=2, persistent_workers=True)
    assert sorted(int(x) for b in keep for x in b["_index"]) == list(range(N))
    try:
        with pytest.raises(ValueError, match="persistent_workers=True"):
            list(keep)
    finally:
        # its workers stay up for the next epoch; stop them now (torch's own cleanup), or the
        # garbage collector does it in a later test, waiting 5 s for each worker
        keep._iterator._shutdown_workers()  # type: ignore[union-attr]
