"""Trainers that call DCP themselves (issue 25 §4), tested with the real trainer on 2 gloo
ranks on the CPU.

* Lightning's `ModelParallelStrategy` (FSDP2 through `configure_model`; Lightning's sharded
  checkpoints): its `save_checkpoint` hands DCP only a path (`checkpoint_id=path`: DCP picks
  its FileSystemWriter, whose `.metadata` is a pickle, and Lightning `torch.save`s the rest
  into `meta.pt`) and refuses `storage_options`. The route to ckptstore is a subclass that
  overrides `save_checkpoint` / `load_checkpoint` (tests/dcp_lightning_worker.py,
  docs/dcp.md): trained, saved, resumed by a new Trainer with `fit(ckpt_path=...)`.
* Lightning's `FSDPStrategy` (FSDP1) refuses a CPU accelerator, and accelerate enables its
  FSDP plugin only for GPU-like devices: neither runs here; the tests say so (below)."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest

from ckptstore import CheckpointStore
from tests import dcp_lightning_worker as W
from tests.ckptstore.dcp.test_backend import assert_no_pickle
from tests.helpers import spawn_ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_lightning_model_parallel_strategy_through_ckptstore(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    port = _free_port()
    spawn_ranks(W.lightning_worker, 2, tmp_path, "lightning",
                lambda _init, out: (2, port, str(root), out), lambda r: f"rank-{r}")
    out = tmp_path / "out-lightning"
    refused, *stock_files = (out / "stock.txt").read_text().split("\n")
    # the stock strategy: DCP's own files at the path (a pickled .metadata) and meta.pt
    assert refused == "True"
    assert ".metadata" in stock_files and "meta.pt" in stock_files, stock_files
    assert any(f.endswith(".distcp") for f in stock_files), stock_files
    # the subclass: one ckptstore checkpoint holding the model, Adam and the loop state
    saved = dict(np.load(out / "saved.npz"))
    with CheckpointStore(root) as repo:
        assert repo.names() == ["step-4.ckpt"]
        got = repo.load("step-4.ckpt")
        assert repo.verify("step-4.ckpt").ok
    # 4 steps are the whole epoch (32 samples, 2 ranks, batches of 4): saved after it ended
    assert got["trainer"]["global_step"] == W.STEPS and got["trainer"]["epoch"] == 1
    for k, v in saved.items():
        assert np.array_equal(got["state_dict"][f"net.{k}"].numpy(), v), k
    adam = got["optimizer_0"]["state"]["net.0.weight"]
    assert adam["exp_avg"].shape == (10, 6) and int(adam["step"]) == W.STEPS
    assert_no_pickle(root)


def test_lightning_fsdp_strategy_needs_a_gpu() -> None:
    """FSDPStrategy (FSDP1 with state_dict_type="sharded") refuses the CPU accelerator."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import FSDPStrategy

    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        pl.Trainer(accelerator="cpu", devices=2,
                   strategy=FSDPStrategy(state_dict_type="sharded"))
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        pl.Trainer(accelerator="cpu", devices=2, strategy="fsdp")


def test_accelerate_fsdp_plugin_hard_codes_file_system_storage() -> None:
    """accelerate's FSDP checkpointing builds DCP's FileSystemWriter / FileSystemReader
    itself (no parameter for a storage writer), and its state turns FSDP on only for
    GPU-like multi-device types, never for multi-CPU."""
    import inspect

    from accelerate.state import AcceleratorState
    from accelerate.utils import fsdp_utils

    for fn, cls in ((fsdp_utils.save_fsdp_model, "FileSystemWriter"),
                    (fsdp_utils.save_fsdp_optimizer, "FileSystemWriter"),
                    (fsdp_utils.load_fsdp_model, "FileSystemReader"),
                    (fsdp_utils.load_fsdp_optimizer, "FileSystemReader")):
        params = inspect.signature(fn).parameters
        assert not any("storage" in p for p in params), (fn.__name__, list(params))
        assert f"dist_cp.{cls}(" in inspect.getsource(fn), fn.__name__
    source = inspect.getsource(AcceleratorState.__init__)
    assert "self.distributed_type = DistributedType.FSDP" in source
