"""The Lightning CheckpointIO plugin: a real Trainer saves to ckptstore and resumes from it."""

from __future__ import annotations

import os
import pickle
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import ckptstore
from ckptstore.format.names import validate_name
from ckptstore.lightning import CkptStoreCheckpointIO, checkpoint_name, load_from_checkpoint

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*isinstance.treespec, LeafSpec.*")
warnings.filterwarnings("ignore", ".*exists and is not empty.*")


def make_module():
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


Tiny = make_module()


def loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    y = x.sum(1, keepdim=True)
    ds = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False)


def trainer(tmp_path, epochs, io):
    return make_trainer(tmp_path, epochs, io, dirpath=tmp_path / "ckpts")


def make_trainer(root: Path, epochs: int, io: Any, callbacks: tuple[Any, ...] = (),
                 **ckpt: Any):
    """A real Trainer on the CPU: 4 steps an epoch, a ModelCheckpoint saving every epoch and
    last (in `root`/checkpoints unless `dirpath=` is given)."""
    options: dict[str, Any] = {"save_last": True, "every_n_epochs": 1, "save_top_k": -1}
    options.update(ckpt)
    return pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      plugins=[io], default_root_dir=root,
                      callbacks=[*callbacks, ModelCheckpoint(**options)])


class Capture(pl.Callback):
    """A callback recording the weights and step the trainer starts training from."""

    start: dict[str, torch.Tensor] | None = None
    step: int | None = None

    def on_train_start(self, trainer, module):
        self.start = {k: v.detach().clone() for k, v in module.state_dict().items()}
        self.step = trainer.global_step


def weights(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def fit(root: Path, epochs: int, io: Any, seed: int = 0, ckpt_path: Any = None,
        callbacks: tuple[Any, ...] = (), **ckpt: Any):
    pl.seed_everything(seed)
    module = Tiny()
    make_trainer(root, epochs, io, callbacks, **ckpt).fit(module, loader(), ckpt_path=ckpt_path)
    return module


def test_trainer_saves_to_ckptstore_and_resumes_exactly(tmp_path):
    pl.seed_everything(0)
    ref = Tiny()
    trainer(tmp_path / "ref", 4, CkptStoreCheckpointIO(str(tmp_path / "ref-repo"))).fit(
        ref, loader())

    pl.seed_everything(0)
    io = CkptStoreCheckpointIO(str(tmp_path / "repo"))
    first = Tiny()
    trainer(tmp_path / "a", 2, io).fit(first, loader())
    ckpts = tmp_path / "a" / "ckpts"
    paths = io.checkpoints()
    assert set(paths) == {str(ckpts / f) for f in
                          ("epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt")}
    assert len(io.repo.names()) == 3  # the older versions of last.ckpt are gone
    for f in ckpts.rglob("*.ckpt"):  # nothing pickled on disk: small text pointers only
        assert f.read_bytes().startswith(b"# ckptstore pointer") and f.stat().st_size < 4096

    pl.seed_everything(123)
    second = Tiny()
    io2 = CkptStoreCheckpointIO(str(tmp_path / "repo"))
    trainer(tmp_path / "a", 4, io2).fit(second, loader(), ckpt_path=str(ckpts / "last.ckpt"))
    assert first.losses + second.losses == ref.losses
    for a, b in zip(ref.state_dict().values(), second.state_dict().values()):
        assert torch.equal(a, b)


def test_two_runs_in_one_repository_keep_their_checkpoints(tmp_path):
    """Runs in two folders save the same file names: neither deletes or replaces the other's
    (b keeps its top 1: removing its epoch 0 leaves a's), and each resumes from its own
    weights, bit for bit."""
    repo = str(tmp_path / "repo")
    a = fit(tmp_path / "a", 2, CkptStoreCheckpointIO(repo), seed=0)
    a_epoch0 = CkptStoreCheckpointIO(repo).load_checkpoint(
        tmp_path / "a" / "checkpoints" / "epoch=0-step=4.ckpt")["state_dict"]
    b = fit(tmp_path / "b", 2, CkptStoreCheckpointIO(repo), seed=1, save_top_k=1)
    io = CkptStoreCheckpointIO(repo)
    assert not torch.equal(a.net.weight, b.net.weight)
    for root, module in (("a", a), ("b", b)):
        last = tmp_path / root / "checkpoints" / "last.ckpt"
        assert_same(io.load_checkpoint(last)["state_dict"], weights(module))
    assert_same(io.load_checkpoint(tmp_path / "a" / "checkpoints" / "epoch=0-step=4.ckpt")[
        "state_dict"], a_epoch0)
    assert not (tmp_path / "b" / "checkpoints" / "epoch=0-step=4.ckpt").exists()
    files = {"a": ("epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"),
             "b": ("epoch=1-step=8.ckpt", "last.ckpt")}
    assert set(io.checkpoints()) == {str(tmp_path / r / "checkpoints" / f)
                                     for r in "ab" for f in files[r]}
    for root, module in (("a", a), ("b", b)):
        last = tmp_path / root / "checkpoints" / "last.ckpt"
        capture = Capture()
        fit(tmp_path / root, 3, CkptStoreCheckpointIO(repo), seed=7, ckpt_path=str(last),
            callbacks=(capture,))
        assert capture.step == 8
        assert capture.start is not None
        assert_same(capture.start, weights(module))


def test_second_run_in_the_same_folder_gets_new_file_names(tmp_path):
    """Lightning's own guard against name clashes sees the plugin's checkpoints: a fresh run in
    the same folder saves 'epoch=0-step=4-v1.ckpt', and the first run's files stay intact."""
    repo = str(tmp_path / "repo")
    fit(tmp_path / "r", 2, CkptStoreCheckpointIO(repo), seed=0)
    io = CkptStoreCheckpointIO(repo)
    ckpts = tmp_path / "r" / "checkpoints"
    before = {f: io.load_checkpoint(ckpts / f)["state_dict"]
              for f in ("epoch=0-step=4.ckpt", "last.ckpt")}
    fit(tmp_path / "r", 1, CkptStoreCheckpointIO(repo), seed=1)
    for f, state in before.items():
        assert_same(CkptStoreCheckpointIO(repo).load_checkpoint(ckpts / f)["state_dict"], state)
    assert {"epoch=0-step=4-v1.ckpt", "last-v1.ckpt"} <= {Path(p).name for p in io.checkpoints()}


def test_remote_lightning_paths(tmp_path):
    """Checkpoint folders that are fsspec URLs (here `memory://`) get their pointer files
    through fsspec: Lightning's clash guard works there too, and a resume by path."""
    repo = str(tmp_path / "repo")
    folder = f"memory://ckptstore-test-{uuid.uuid4().hex}/ckpts"
    first = fit(tmp_path / "r", 2, CkptStoreCheckpointIO(repo), dirpath=folder)
    fit(tmp_path / "r", 1, CkptStoreCheckpointIO(repo), seed=1, dirpath=folder)
    capture = Capture()
    fit(tmp_path / "r", 3, CkptStoreCheckpointIO(repo), seed=2, dirpath=folder,
        ckpt_path=f"{folder}/last.ckpt", callbacks=(capture,))
    assert capture.step == 8
    assert capture.start is not None
    assert_same(capture.start, weights(first))
    assert sorted(p.rsplit("/", 1)[1] for p in CkptStoreCheckpointIO(repo).checkpoints()) == [
        "epoch=0-step=4-v1.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt",
        "epoch=2-step=12.ckpt", "last-v1.ckpt", "last.ckpt"]


def test_resume_with_ckpt_path_last(tmp_path):
    """`ckpt_path="last"` finds the plugin's last checkpoint and continues from its step."""
    ref = fit(tmp_path / "ref", 4, CkptStoreCheckpointIO(str(tmp_path / "ref-repo")))
    repo = str(tmp_path / "repo")
    first = fit(tmp_path / "r", 2, CkptStoreCheckpointIO(repo))
    capture = Capture()
    second = fit(tmp_path / "r", 4, CkptStoreCheckpointIO(repo), seed=5, ckpt_path="last",
                 callbacks=(capture,))
    assert capture.step == 8
    assert first.losses + second.losses == ref.losses
    io = CkptStoreCheckpointIO(repo)
    ckpts = tmp_path / "r" / "checkpoints"
    assert io.load_checkpoint(ckpts / "last.ckpt")["global_step"] == 16
    assert io.load_checkpoint(ckpts / "epoch=1-step=8.ckpt")["global_step"] == 8
    assert_same(io.load_checkpoint(ckpts / "last.ckpt")["state_dict"], weights(ref))


def test_lost_pointer_files_refuse_before_replacing_then_restore(tmp_path):
    """On a machine without the pointer files (a fresh host, a deleted folder) Lightning cannot
    see the repository's checkpoints: the first save refuses to replace one, nothing is
    written, and `restore_pointers` makes `ckpt_path="last"` find them again."""
    repo = str(tmp_path / "repo")
    first = fit(tmp_path / "r", 2, CkptStoreCheckpointIO(repo))
    shutil.rmtree(tmp_path / "r" / "checkpoints", ignore_errors=True)
    names = sorted(ckptstore.CheckpointStore(repo).names())
    with pytest.raises(ckptstore.CheckpointExistsError, match="restore_pointers"):
        fit(tmp_path / "r", 4, CkptStoreCheckpointIO(repo), seed=3, ckpt_path="last")
    assert sorted(ckptstore.CheckpointStore(repo).names()) == names
    io = CkptStoreCheckpointIO(repo)
    restored = io.restore_pointers(tmp_path / "r")
    assert sorted(Path(p).name for p in restored) == ["epoch=0-step=4.ckpt",
                                                       "epoch=1-step=8.ckpt", "last.ckpt"]
    assert io.restore_pointers(tmp_path / "r") == []  # present: not written again
    capture = Capture()
    fit(tmp_path / "r", 3, CkptStoreCheckpointIO(repo), seed=3, ckpt_path="last",
        callbacks=(capture,))
    assert capture.step == 8
    assert capture.start is not None
    assert_same(capture.start, weights(first))


def test_save_last_link(tmp_path):
    """`ModelCheckpoint(save_last="link")`: last.ckpt is a symlink to the newest top-k pointer;
    loading and resuming through it read that checkpoint."""
    repo = str(tmp_path / "repo")
    first = fit(tmp_path / "r", 2, CkptStoreCheckpointIO(repo), save_last="link")
    ckpts = tmp_path / "r" / "checkpoints"
    assert (ckpts / "last.ckpt").is_symlink()
    io = CkptStoreCheckpointIO(repo)
    assert_same(io.load_checkpoint(ckpts / "last.ckpt")["state_dict"], weights(first))
    assert str(ckpts / "last.ckpt") not in io.checkpoints()  # a link, not a checkpoint
    capture = Capture()
    fit(tmp_path / "r", 3, CkptStoreCheckpointIO(repo), seed=4, ckpt_path="last",
        callbacks=(capture,), save_last="link")
    assert capture.step == 8
    assert os.readlink(ckpts / "last.ckpt") == "epoch=2-step=12.ckpt"
    assert io.load_checkpoint(ckpts / "last.ckpt")["global_step"] == 12
    assert io.load_checkpoint(ckpts / "epoch=1-step=8.ckpt")["global_step"] == 8


def test_load_from_checkpoint_helper(tmp_path):
    """`ckptstore.lightning.load_from_checkpoint` is `LightningModule.load_from_checkpoint` for
    the plugin's checkpoints; Lightning's own refuses the pointer (it never unpickles it)."""
    pl.seed_everything(0)
    module = Tiny(lr=0.01)
    repo = str(tmp_path / "repo")
    make_trainer(tmp_path / "r", 1, CkptStoreCheckpointIO(repo)).fit(module, loader())
    last = tmp_path / "r" / "checkpoints" / "last.ckpt"
    loaded = load_from_checkpoint(Tiny, last, repo)
    assert isinstance(loaded, Tiny) and loaded.hparams.lr == 0.01
    assert_same(weights(loaded), weights(module))
    again = load_from_checkpoint(Tiny, str(last), CkptStoreCheckpointIO(repo), lr=0.5)
    assert again.hparams.lr == 0.5
    with pytest.raises(pickle.UnpicklingError):
        Tiny.load_from_checkpoint(last)
    with pytest.raises(ckptstore.CheckpointNotFoundError, match="no checkpoint"):
        load_from_checkpoint(Tiny, tmp_path / "r" / "checkpoints" / "none.ckpt", repo)


def test_legacy_checkpoints_load_from_their_path_only(tmp_path):
    """Checkpoints named by the old scheme (the file name alone) still load from the path they
    were saved under, not from another path with the same file name; a re-save of that path
    supersedes them, and another path's legacy checkpoint is kept."""
    repo = str(tmp_path / "repo")
    module = fit(tmp_path / "src", 2, CkptStoreCheckpointIO(repo))
    io = CkptStoreCheckpointIO(repo)
    state = io.load_checkpoint(tmp_path / "src" / "checkpoints" / "last.ckpt")
    old = tmp_path / "old" / "checkpoints"
    other = tmp_path / "other" / "checkpoints"
    store = ckptstore.CheckpointStore(repo)
    for name in store.names():
        store.delete(name)
    # what the old plugin wrote: run `other` first, then `old`'s re-save as version 2
    store.save("last.ckpt", state, metadata={"lightning_path": str(other / "last.ckpt"),
                                             "step": 8, "epoch": 1})
    store.save("epoch_1-step_8.ckpt", state,
               metadata={"lightning_path": str(old / "epoch=1-step=8.ckpt"), "step": 8,
                         "epoch": 1})
    store.save("last.ckpt.v2", state, metadata={"lightning_path": str(old / "last.ckpt"),
                                                "step": 8, "epoch": 1})
    io = CkptStoreCheckpointIO(repo)
    with pytest.raises(ckptstore.CheckpointNotFoundError,
                       match="with that file name were saved under .*other"):
        io.load_checkpoint(tmp_path / "elsewhere" / "last.ckpt")
    assert_same(io.load_checkpoint(old / "last.ckpt")["state_dict"], weights(module))
    assert io.checkpoints() == {str(other / "last.ckpt"): "last.ckpt",
                                str(old / "epoch=1-step=8.ckpt"): "epoch_1-step_8.ckpt",
                                str(old / "last.ckpt"): "last.ckpt.v2"}
    capture = Capture()
    fit(tmp_path / "old", 3, CkptStoreCheckpointIO(repo), seed=9,
        ckpt_path=str(old / "last.ckpt"), callbacks=(capture,))
    assert capture.step == 8
    assert capture.start is not None
    assert_same(capture.start, weights(module))
    names = set(ckptstore.CheckpointStore(repo).names())
    assert "last.ckpt" in names and "epoch_1-step_8.ckpt" in names  # other paths' checkpoints
    assert "last.ckpt.v2" not in names  # superseded by the new last.ckpt of the same path
    assert io.load_checkpoint(old / "last.ckpt")["global_step"] == 12


def test_checkpoint_names(tmp_path, monkeypatch):
    a = checkpoint_name("/x/a/epoch=1-step=20.ckpt")
    b = checkpoint_name("/x/b/epoch=1-step=20.ckpt")
    assert a != b and a.startswith("epoch_1-step_20.ckpt-") and b.startswith("epoch_1-step_20")
    assert checkpoint_name("/x/a/../a/./epoch=1-step=20.ckpt") == a
    monkeypatch.chdir(tmp_path)
    assert checkpoint_name("last.ckpt") == checkpoint_name(tmp_path / "last.ckpt")
    long = checkpoint_name("/" + "d" * 300 + "/" + "f" * 300 + ".ckpt")
    assert len(long) <= 120 and long != checkpoint_name("/" + "e" * 300 + "/" + "f" * 300 + ".ckpt")
    for name in (a, long, checkpoint_name("/x/..."), checkpoint_name("/x/ü é.ckpt")):
        assert validate_name(name) == name
    for bad in ("", None, 3):
        with pytest.raises((TypeError, ValueError), match="Lightning checkpoint path"):
            checkpoint_name(bad)  # type: ignore[arg-type]


def test_bad_paths_fail_clearly(tmp_path):
    io = CkptStoreCheckpointIO(str(tmp_path / "repo"))
    real = tmp_path / "real.ckpt"
    real.write_bytes(b"PK\x03\x04 a torch file, say")
    with pytest.raises(ckptstore.CheckpointExistsError, match="not a ckptstore pointer"):
        io.save_checkpoint({"state_dict": {}}, real)
    with pytest.raises(ckptstore.CheckpointNotFoundError, match="not a ckptstore pointer"):
        io.load_checkpoint(real)
    with pytest.raises(ckptstore.CheckpointNotFoundError, match="no checkpoint"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    (tmp_path / "dir.ckpt").mkdir()
    with pytest.raises(ckptstore.CheckpointExistsError, match="directory"):
        io.save_checkpoint({"state_dict": {}}, tmp_path / "dir.ckpt")
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"state_dict": {}}, tmp_path / "s.ckpt", storage_options={"a": 1})
    with pytest.raises(TypeError, match="LightningModule"):
        load_from_checkpoint(dict, tmp_path / "s.ckpt", io)  # type: ignore[type-var]
    assert io.repo.names() == []
    assert real.read_bytes()[:2] == b"PK"  # untouched
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(b"# ckptstore pointer\n{not json")
    with pytest.raises(ckptstore.FormatError, match="damaged"):
        io.load_checkpoint(damaged)
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, damaged)  # a save replaces it
    assert torch.equal(io.load_checkpoint(damaged)["state_dict"]["w"], torch.ones(2))
    io.remove_checkpoint(damaged)
    assert not damaged.exists() and io.repo.names() == []


def test_plain_conversion_refuses_unknown_objects(tmp_path):
    io = CkptStoreCheckpointIO(str(tmp_path / "repo"))
    try:
        io.save_checkpoint({"x": object()}, tmp_path / "bad.ckpt")
    except TypeError as exc:
        assert "x" in str(exc)
    else:
        raise AssertionError("unsupported object accepted")
    assert io.repo.names() == []
    assert not (tmp_path / "bad.ckpt").exists()
    assert isinstance(ckptstore.CheckpointStore(str(tmp_path / "repo")).list(), list)


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
        self.loaded_step: int | None = None

    def training_step(self, batch: Any, _i: int) -> Any:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded_step = checkpoint["global_step"]


def test_restored_pointers_keep_the_newest_commit_last(tmp_path):
    # Lightning takes "last" by modification time; restore_pointers wrote the pointers in
    # path order, so last-v1.ckpt (a later run's) came before last.ckpt and a fresh host
    # resumed the older checkpoint
    folder, repo = tmp_path / "ck", str(tmp_path / "repo")

    def run(steps: int, ckpt_path: str | None = None) -> int | None:
        model = _Tiny()
        data = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.randn(16, 2)), batch_size=4)
        trainer = pl.Trainer(max_steps=steps, plugins=[CkptStoreCheckpointIO(repo)],
                             logger=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=tmp_path,
                             callbacks=[ModelCheckpoint(dirpath=folder, save_last=True,
                                                        save_top_k=0, every_n_train_steps=1)])
        trainer.fit(model, data, ckpt_path=ckpt_path)
        return model.loaded_step

    run(4)  # last.ckpt, step 4 (an epoch is 4 steps)
    run(8)  # a new run in the same folder: last-v1.ckpt, step 8
    shutil.rmtree(folder)  # a fresh host
    written = CkptStoreCheckpointIO(repo).restore_pointers(folder)
    assert sorted(Path(p).name for p in written) == ["last-v1.ckpt", "last.ckpt"]
    assert run(12, "last") == 8
