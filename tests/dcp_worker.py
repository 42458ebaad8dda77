"""Workers of tests/ckptstore/dcp/test_backend.py: real torch.distributed.checkpoint on gloo ranks
(spawned by `tests.helpers.spawn_ranks`), and the process killed with SIGKILL mid-save."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ckptstore.stores import LocalStore

from .dist_worker import reporting

STEPS = 2
COLS_SHAPE = (12, 10)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(6, 16, generator=torch.Generator().manual_seed(100 + step))


def fsdp_model(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """A small MLP under FSDP2 (`fully_shard`) on a CPU gloo mesh of `world` ranks, Adam."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 7))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), mesh


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        model(_batch(step)).pow(2).mean().backward()
        opt.step()


def cols_truth() -> torch.Tensor:
    return torch.arange(COLS_SHAPE[0] * COLS_SHAPE[1], dtype=torch.float64).reshape(COLS_SHAPE)


def full_states(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter and Adam state as full arrays (collective), keyed by DCP's fqns."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd: Any
    osd: Any
    msd, osd = get_state_dict(model, opt)
    out = {}
    for k, v in msd.items():
        out[f"model.{k}"] = v.full_tensor().detach().numpy().copy()
    for k, st in osd["state"].items():
        for name, v in st.items():
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"optim.state.{k}.{name}"] = full.detach().numpy().copy()
    return out


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, mesh: Any, cols: Any,
           step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"cols": cols, "step": step, "tag": "run-1"}}


def _savez(path: str, arrays: dict[str, Any]) -> None:
    np.savez(path, **arrays)


def fsdp_worker(rank: int, world: int, init_file: str, root: str, out_dir: str,
                mode: str) -> None:
    """mode "save" (2 ranks): train, then dcp.save / async_save (thread) / async_save
    (process) through ckptstore's StorageWriter, and load one back on the same ranks.
    mode "reshard" (3 ranks): load the 2-rank checkpoint (DCP resharding: uneven FSDP2
    shards, and Shard(1) columns into Shard(0) rows), train one step, save on 3 ranks.
    mode "one" (1 rank): load the 3-rank checkpoint, async_save with both executors."""
    with reporting(os.path.join(out_dir, f"dcp-{rank}")):
        os.environ["MASTER_ADDR"] = "127.0.0.1"  # DCP's process executor's own group
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        from concurrent.futures import Future

        from torch.distributed.checkpoint.state_dict import set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
        from torch.distributed.tensor import Shard, distribute_tensor

        import ckptstore.dcp as cdcp

        if mode == "save":
            model, opt, mesh = fsdp_model(world, seed=1)
            train(model, opt, range(STEPS))
            cols = distribute_tensor(cols_truth(), mesh, [Shard(1)])
            state = _state(model, opt, mesh, cols, STEPS)
            writer = cdcp.StorageWriter(root, "fsdp-2", metadata={"step": STEPS})
            dcp_save(state, storage_writer=writer)  # DCP's own default planner
            if rank == 0:
                assert writer.last_save is not None and writer.last_save.written_bytes > 0
                _savez(os.path.join(out_dir, "saved.npz"), full_states(model, opt))
            else:
                full_states(model, opt)
            again = cdcp.StorageWriter(root, "async-thread")
            pending = dcp_async_save(state, storage_writer=again)
            assert isinstance(pending, Future)
            pending.result()
            if rank == 0:  # the same state again: every chunk reused, none written
                info = again.last_save
                assert info is not None and info.written_bytes == 0, info
                assert info.reused_bytes > 0, info
            cdcp.async_save(state, root, "async-proc",
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
            # back on the same ranks, from the checkpoint the background process wrote
            model2, opt2, mesh2 = fsdp_model(world, seed=7)
            train(model2, opt2, range(1))  # Adam state to fill in place
            back = _state(model2, opt2, mesh2,
                          distribute_tensor(torch.zeros(COLS_SHAPE, dtype=torch.float64),
                                            mesh2, [Shard(1)]), 0)
            dcp_load(back, storage_reader=cdcp.StorageReader(root, "async-proc"))
            set_state_dict(model2, opt2, model_state_dict=back["model"],
                           optim_state_dict=back["optim"])
            got = full_states(model2, opt2)
            assert back["extra"]["step"] == STEPS and back["extra"]["tag"] == "run-1"
            assert torch.equal(back["extra"]["cols"].full_tensor(), cols_truth())
            if rank == 0:
                _savez(os.path.join(out_dir, "async.npz"), got)
        elif mode == "one":  # one gloo rank: the 3-rank checkpoint back into FSDP2, both
            model, opt, mesh = fsdp_model(world, seed=5)  # async executors on one rank
            train(model, opt, range(1))
            rows = distribute_tensor(torch.zeros(COLS_SHAPE, dtype=torch.float64), mesh,
                                     [Shard(0)])
            state = _state(model, opt, mesh, rows, 0)
            dcp_load(state, storage_reader=cdcp.StorageReader(root, "fsdp-3"))
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
            assert state["extra"]["step"] == STEPS + 1
            assert torch.equal(state["extra"]["cols"].full_tensor(), cols_truth())
            _savez(os.path.join(out_dir, "one.npz"), full_states(model, opt))
            pending = dcp_async_save(state, storage_writer=cdcp.StorageWriter(root, "one-thread"))
            assert isinstance(pending, Future)
            pending.result()
            cdcp.async_save(state, root, "one-proc",
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
        else:
            model, opt, mesh = fsdp_model(world, seed=3)
            train(model, opt, range(1))
            rows = distribute_tensor(torch.zeros(COLS_SHAPE, dtype=torch.float64), mesh,
                                     [Shard(0)])
            state = _state(model, opt, mesh, rows, 0)
            assert cdcp.load(state, root, "fsdp-2") == "fsdp-2"
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
            loaded = full_states(model, opt)
            assert torch.equal(state["extra"]["cols"].full_tensor(), cols_truth())
            assert state["extra"]["step"] == STEPS
            train(model, opt, range(STEPS, STEPS + 1))
            state = _state(model, opt, mesh, rows, STEPS + 1)
            info = cdcp.save(state, root, "fsdp-3", metadata={"step": STEPS + 1})
            assert (info is not None) == (rank == 0)
            final = full_states(model, opt)
            if rank == 0:
                _savez(os.path.join(out_dir, "loaded.npz"), loaded)
                _savez(os.path.join(out_dir, "final.npz"), final)


class SlowStore(LocalStore):
    """A local folder that says on stdout when it writes a blob and when it is about to
    create a manifest, and then pauses: lets the test kill the save at those instants."""

    def put(self, key: str, data: Any) -> None:
        super().put(key, data)
        if key.startswith("blobs/"):
            print("blob", flush=True)
            time.sleep(0.05)

    def create(self, key: str, data: Any) -> None:
        if key.startswith("checkpoints/"):
            print("commit", flush=True)
            time.sleep(5)
        super().create(key, data)


def crash_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"model": {f"w{i}": torch.randn(256, 256, generator=g) for i in range(12)},
            "step": 9}


def crash_child(root: str) -> None:
    """Save crash_state() through DCP into `root`, slowly (SlowStore): killed by the test."""
    import warnings

    warnings.simplefilter("ignore")
    import ckptstore.dcp as cdcp

    store = SlowStore(root)
    cdcp.save(crash_state(), store, "victim", chunk_bytes=64 << 10)
    print("done", flush=True)


if __name__ == "__main__":
    crash_child(sys.argv[1])
