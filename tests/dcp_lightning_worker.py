"""2-rank worker of tests/ckptstore/dcp/test_trainer_routes.py: a real Lightning `Trainer`
with `ModelParallelStrategy` (FSDP2 through `configure_model`, sharded checkpoints through
DCP) on the CPU over gloo, the ranks launched by us (Lightning sees LOCAL_RANK and launches
nothing).

* The stock strategy: `Trainer.save_checkpoint(path)` calls DCP with `checkpoint_id=path`
  (DCP's FileSystemWriter: a `.metadata` pickle) and `torch.save`s the rest beside it; it
  refuses `storage_options`. No storage writer can be handed to it.
* What the user does instead: `CkptStoreModelParallelStrategy` below overrides
  `save_checkpoint` / `load_checkpoint` to call `ckptstore.dcp.save` / `ckptstore.dcp.load`
  (the model and optimizer states through DCP, the loop state as plain values in the same
  checkpoint). A second Trainer resumes from it (`fit(ckpt_path=...)`)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .dist_worker import reporting

STEPS = 4


def _ckpt_name(path: Any) -> str:
    """A ckptstore checkpoint name for the path Lightning hands the strategy."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", Path(str(path)).name)


def strategy_class() -> type:
    import lightning.pytorch as pl  # noqa: F401  (Lightning first: its own import order)
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import ModelParallelStrategy

    import ckptstore
    import ckptstore.dcp as cdcp

    class CkptStoreModelParallelStrategy(ModelParallelStrategy):
        """ModelParallelStrategy whose sharded checkpoints go to a ckptstore repository."""

        def __init__(self, repo: str, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.repo = repo

        def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
            return [o._optimizer if isinstance(o, LightningOptimizer) else o
                    for o in self.optimizers]

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                            storage_options: Any = None) -> None:
            name = _ckpt_name(self.broadcast(filepath))
            state = {"state_dict": checkpoint.pop("state_dict")}
            for i, optim in enumerate(checkpoint.pop("optimizer_states", [])):
                state[f"optimizer_{i}"] = optim
            state["trainer"] = checkpoint  # epoch, global_step, loops, ...: plain values
            cdcp.save(state, self.repo, name)

        def load_checkpoint(self, checkpoint_path: Any, weights_only: Any = None
                            ) -> dict[str, Any]:
            from torch.distributed.checkpoint.state_dict import (
                get_model_state_dict,
                get_optimizer_state_dict,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            name = _ckpt_name(self.broadcast(checkpoint_path))
            assert self.model is not None
            optims = self._torch_optimizers()
            state: dict[str, Any] = {"state_dict": get_model_state_dict(self.model)}
            for i, optim in enumerate(optims):
                state[f"optimizer_{i}"] = get_optimizer_state_dict(self.model, optim)
            cdcp.load(state, self.repo, name)
            set_model_state_dict(self.model, state["state_dict"])
            for i, optim in enumerate(optims):
                set_optimizer_state_dict(self.model, optim, state[f"optimizer_{i}"])
            with ckptstore.CheckpointStore(self.repo, create=False) as repo:
                rest: dict[str, Any] = repo.load(name, keys=["trainer"])["trainer"]
            return rest

    return CkptStoreModelParallelStrategy


def module_class() -> type:
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(),
                                           torch.nn.Linear(10, 1))

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, _idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(0)
            data = torch.utils.data.TensorDataset(torch.randn(32, 6, generator=g),
                                                  torch.randn(32, 1, generator=g))
            return torch.utils.data.DataLoader(data, batch_size=4)

    return Tiny


def _trainer(strategy: Any, max_steps: int) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)


def _full(module: Any) -> dict[str, np.ndarray]:
    return {k: v.full_tensor().detach().numpy().copy() for k, v in module.net.state_dict().items()}


def lightning_worker(rank: int, world: int, port: int, root: str, out_dir: str) -> None:
    import warnings

    warnings.simplefilter("ignore")  # Lightning's notes on CPU runs and small data
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "NODE_RANK": "0"})
    with reporting(os.path.join(out_dir, f"rank-{rank}")):
        from lightning.pytorch.strategies import ModelParallelStrategy

        torch.manual_seed(0)
        Tiny, Strategy = module_class(), strategy_class()
        stock_dir = Path(out_dir) / "stock.ckpt"
        # the stock strategy: DCP's FileSystemWriter at the path, the rest torch.saved
        stock = _trainer(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), 1)
        stock.fit(Tiny())
        stock.save_checkpoint(stock_dir)
        try:
            stock.strategy.save_checkpoint({}, stock_dir, storage_options={"x": 1})
        except TypeError as exc:
            refused = "storage_options" in str(exc)
        else:
            refused = False
        # ckptstore's route: train, save through ckptstore.dcp, resume in a new Trainer
        torch.manual_seed(0)
        model = Tiny()
        trainer = _trainer(Strategy(root, data_parallel_size=2, tensor_parallel_size=1), STEPS)
        trainer.fit(model)
        saved = _full(model)
        trainer.save_checkpoint(os.path.join(out_dir, "step=4.ckpt"))
        torch.manual_seed(1)
        again = Tiny()
        resumed = _trainer(Strategy(root, data_parallel_size=2, tensor_parallel_size=1), STEPS)
        resumed.fit(again, ckpt_path=os.path.join(out_dir, "step=4.ckpt"))
        loaded = _full(again)
        step = resumed.global_step
        assert step == STEPS, step
        for k in saved:
            assert np.array_equal(saved[k], loaded[k]), k
        opt = resumed.strategy._torch_optimizers()[0]
        assert all(int(s["step"]) == STEPS for s in opt.state.values()), opt.state
        if rank == 0:
            np.savez(os.path.join(out_dir, "saved.npz"), **saved)
            files = sorted(p.name for p in stock_dir.iterdir())
            with open(os.path.join(out_dir, "stock.txt"), "w") as f:
                f.write(f"{refused}\n" + "\n".join(files))
