"""The Lightning CheckpointIO plugin: a real Trainer saves to ckptstore and resumes from it."""

from __future__ import annotations

import warnings

import torch

import ckptstore
from ckptstore.lightning import CkptStoreCheckpointIO, checkpoint_name

warnings.filterwarnings("ignore", ".*does not have many workers.*")


def make_module():
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self, lr: float = 0.05) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(4, 1)
            self.losses: list[float] = []

        def training_step(self, batch, _idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)]

    return Tiny


def loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    y = x.sum(1, keepdim=True)
    ds = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False)


def trainer(tmp_path, epochs, io):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    return pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      plugins=[io], default_root_dir=tmp_path,
                      callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True,
                                                 every_n_epochs=1, save_top_k=-1)])


def test_trainer_saves_to_ckptstore_and_resumes_exactly(tmp_path):
    import lightning.pytorch as pl

    Tiny = make_module()
    pl.seed_everything(0)
    ref = Tiny()
    trainer(tmp_path / "ref", 4, CkptStoreCheckpointIO(str(tmp_path / "ref-repo"))).fit(
        ref, loader())

    pl.seed_everything(0)
    io = CkptStoreCheckpointIO(str(tmp_path / "repo"))
    first = Tiny()
    trainer(tmp_path / "a", 2, io).fit(first, loader())
    names = io.repo.names()
    assert any(n.startswith("last.ckpt") for n in names)
    assert "epoch_0-step_4.ckpt" in names and "epoch_1-step_8.ckpt" in names
    assert len([n for n in names if n.startswith("last.ckpt")]) == 1  # old versions removed
    assert not list((tmp_path / "a").rglob("*.ckpt"))  # nothing pickled on disk

    pl.seed_everything(123)
    second = Tiny()
    io2 = CkptStoreCheckpointIO(str(tmp_path / "repo"))
    trainer(tmp_path / "a", 4, io2).fit(second, loader(),
                                        ckpt_path=str(tmp_path / "ckpts" / "last.ckpt"))
    assert first.losses + second.losses == ref.losses
    for a, b in zip(ref.state_dict().values(), second.state_dict().values()):
        assert torch.equal(a, b)


def test_checkpoint_names():
    assert checkpoint_name("/x/epoch=1-step=20.ckpt") == "epoch_1-step_20.ckpt"
    assert checkpoint_name("last.ckpt") == "last.ckpt"


def test_plain_conversion_refuses_unknown_objects(tmp_path):
    io = CkptStoreCheckpointIO(str(tmp_path / "repo"))
    try:
        io.save_checkpoint({"x": object()}, tmp_path / "bad.ckpt")
    except TypeError as exc:
        assert "x" in str(exc)
    else:
        raise AssertionError("unsupported object accepted")
    assert io.repo.names() == []
    assert isinstance(ckptstore.CheckpointStore(str(tmp_path / "repo")).list(), list)
