"""Workers of tests/ckptstore/dcp/test_multirank.py: real torch.distributed.checkpoint on 4
gloo ranks (FSDP2 and a 2-D FSDP + tensor-parallel mesh), and the process executor of
`dcp.async_save` on 2, all through ckptstore's StorageWriter / StorageReader. Spawned by
`tests.helpers.spawn_ranks`; each rank writes its report (`ok` or its traceback), rank 0
the full arrays the test compares (`np.savez`, no pickle)."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .dist_worker import reporting

#: Linear(16, 30): 30 rows split 8/8/8/6 on 4 ranks, 15/15 on 2, 10/10/10 on 3
HIDDEN = 30
STEPS = 2
#: extra DTensors of the 2-D test: name -> (shape, placements on the 2x2 mesh, on the 1-D mesh)
EXTRAS = {"a": ((12, 10), ("S0", "S1"), ("S1",)),
          "b": ((9, 14), ("S1", "S0"), ("S0",)),
          "c": ((10,), ("R", "S0"), ("R",)),
          "d": ((7, 6), ("S0", "R"), ("S0",))}


def _init(rank: int, world: int, init_file: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # DCP's process executor builds its own group
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=90))


def batch(step: int) -> torch.Tensor:
    return torch.randn(5, 16, generator=torch.Generator().manual_seed(200 + step))


def plain_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, 8))


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        model(batch(step)).pow(2).mean().backward()
        opt.step()


def fsdp(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """FSDP2 as recipes apply it: each Linear, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.95))


def full(v: Any) -> np.ndarray:
    t = v.full_tensor() if hasattr(v, "full_tensor") else v
    return np.ascontiguousarray(t.detach().numpy())


def full_states(model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every tensor of get_state_dict's pair as a full array (collective), keyed by DCP's
    flattened names."""
    out = {f"model.{k}": full(v) for k, v in model_sd.items()}
    for fqn, st in optim_sd["state"].items():
        for name, v in st.items():
            out[f"optim.state.{fqn}.{name}"] = full(v)
    return out


def placements(spec: tuple[str, ...]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec]


def extra_truth(name: str) -> torch.Tensor:
    shape = EXTRAS[name][0]
    n = int(np.prod(shape))
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * 1.5 + ord(name))


def extras(mesh: Any, which: int, zero: bool) -> dict[str, Any]:
    """The extra DTensors on `mesh` with their placements number `which` (1: 2-D, 2: 1-D)."""
    from torch.distributed.tensor import distribute_tensor

    out = {}
    for name, spec in EXTRAS.items():
        t = extra_truth(name)
        out[name] = distribute_tensor(torch.zeros_like(t) if zero else t, mesh,
                                      placements(spec[which]))
    return out


def _check_local_rows(model_sd: dict[str, Any], world: int) -> None:
    """Each rank holds its FSDP2 share of the rows (torch.chunk's split)."""
    w = model_sd["0.weight"]
    rows = [len(c) for c in torch.arange(HIDDEN).chunk(world)]
    assert tuple(w.to_local().shape) == (rows[dist.get_rank()], 16), w.to_local().shape


# ---------------------------------------------------------------------- (a) FSDP2 4 -> 2
def fsdp_part(rank: int, world: int, root: str, out_dir: str, mode: str) -> None:
    """mode "save" (4 ranks): FSDP2 + Adam trained STEPS steps, get_state_dict, dcp.save
    through ckptstore's StorageWriter; rank 0 writes the gathered arrays (fsdp-saved.npz).
    mode "load" (2 ranks): a model of other values and a fresh Adam state, dcp.load (DCP
    reshards 8/8/8/6 rows into 15/15), set_state_dict; rank 0 writes fsdp-loaded.npz."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
    from torch.distributed.device_mesh import init_device_mesh

    import ckptstore.dcp as cdcp

    mesh = init_device_mesh("cpu", (world,))
    if mode == "save":
        model = fsdp(plain_model(seed=1), mesh)
        opt = adam(model)
        train(model, opt, range(STEPS))
        msd, osd = get_state_dict(model, opt)
        _check_local_rows(msd, world)
        state = {"model": msd, "optim": osd, "step": STEPS}
        with cdcp.StorageWriter(root, "fsdp-4", metadata={"ranks": world}) as writer:
            dcp_save(state, storage_writer=writer)
            if rank == 0:
                info = writer.last_save
                assert info is not None and info.written_bytes > 0, info
        arrays = full_states(msd, osd)
        if rank == 0:
            np.savez(os.path.join(out_dir, "fsdp-saved.npz"), **arrays)
    else:
        model = fsdp(plain_model(seed=9), mesh)
        opt = adam(model)
        train(model, opt, range(5, 6))  # an Adam state of other values, to overwrite
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": 0}
        dcp_load(state, storage_reader=cdcp.StorageReader(root, "fsdp-4"))
        assert state["step"] == STEPS
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        msd, osd = get_state_dict(model, opt)  # read back from the model and optimizer
        _check_local_rows(msd, world)
        assert osd["param_groups"][0]["betas"] == (0.8, 0.95)
        arrays = full_states(msd, osd)
        if rank == 0:
            np.savez(os.path.join(out_dir, "fsdp-loaded.npz"), **arrays)


# ------------------------------------------------------------- (b) 2-D mesh 2x2 -> 1-D 3
def mesh2d_part(rank: int, world: int, root: str, out_dir: str, mode: str) -> None:
    """mode "save" (4 ranks): a 2x2 ("dp", "tp") mesh; the model tensor-parallel on "tp"
    (ColwiseParallel, RowwiseParallel) and FSDP2 on "dp", Adam, trained; beside it DTensors
    placed (Shard(0), Shard(1)), (Shard(1), Shard(0)), (Replicate(), Shard(0)),
    (Shard(0), Replicate()); dcp.save. mode "load" (3 ranks): a 1-D mesh, the model under
    FSDP2 only, the extras Shard(1) / Shard(0) / Replicate(); dcp.load, set_state_dict.
    Rank 0 writes mesh2d-saved.npz / mesh2d-loaded.npz."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
    from torch.distributed.device_mesh import init_device_mesh

    import ckptstore.dcp as cdcp

    if mode == "save":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = plain_model(seed=2)
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(),
                                               "2": RowwiseParallel()})
        model = fsdp(model, mesh["dp"])
        opt = adam(model)
        train(model, opt, range(STEPS))
        msd, osd = get_state_dict(model, opt)
        w = msd["0.weight"]
        assert w.device_mesh.ndim == 2 and w.to_local().numel() < w.numel()
        ex = extras(mesh, 1, zero=False)
        for name, t in ex.items():  # the 2-D placements are as intended
            assert len(t.placements) == 2, (name, t.placements)
        state = {"model": msd, "optim": osd, "extra": ex, "step": STEPS}
        dcp_save(state, storage_writer=cdcp.StorageWriter(root, "mesh-2x2"))
        arrays = full_states(msd, osd)
        arrays.update({f"extra.{k}": full(v) for k, v in ex.items()})  # collective
        if rank == 0:
            arrays["placements"] = np.array(
                [str(msd["0.weight"].placements), str(msd["2.weight"].placements)])
            np.savez(os.path.join(out_dir, "mesh2d-saved.npz"), **arrays)
    else:
        mesh = init_device_mesh("cpu", (world,))
        model = fsdp(plain_model(seed=8), mesh)
        opt = adam(model)
        train(model, opt, range(5, 6))
        msd, osd = get_state_dict(model, opt)
        ex = extras(mesh, 2, zero=True)
        state = {"model": msd, "optim": osd, "extra": ex, "step": 0}
        cdcp.load(state, root, "mesh-2x2")  # ckptstore's one-call form (its planner)
        assert state["step"] == STEPS
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        msd, osd = get_state_dict(model, opt)
        arrays = full_states(msd, osd)
        for name, t in state["extra"].items():
            assert t.device_mesh.ndim == 1 and list(t.placements) == placements(
                EXTRAS[name][2]), (name, t.placements)
            arrays[f"extra.{name}"] = full(t)
        if rank == 0:
            np.savez(os.path.join(out_dir, "mesh2d-loaded.npz"), **arrays)


PARTS: dict[str, Callable[[int, int, str, str, str], None]] = {"fsdp": fsdp_part,
                                                               "mesh2d": mesh2d_part}


def worker(rank: int, world: int, init_file: str, root: str, out_dir: str,
           parts: list[tuple[str, str]]) -> None:
    """Run `PARTS[name](..., mode)` for each (name, mode) of `parts`, in order, on one
    gloo group of `world` ranks (one spawn for the 4-rank saves of both tests)."""
    with reporting(os.path.join(out_dir, f"rank-{rank}")):
        _init(rank, world, init_file)
        for name, mode in parts:
            PARTS[name](rank, world, root, out_dir, mode)


# ------------------------------------------------------- (c) async_save, process executor
def async_process_worker(rank: int, world: int, init_file: str, root: str,
                         out_dir: str) -> None:
    """2 ranks: FSDP2 + Adam; dcp.async_save with AsyncCheckpointerType.PROCESS and
    ckptstore's StorageWriter (DCP pickles it into its background process, which opens the
    repository itself). The state is changed in place as soon as async_save returns (DCP
    staged a copy): the checkpoint holds the values at the call. A second process-executor
    save (the same background process, another writer) of the changed state, then both are
    loaded back on these ranks."""
    with reporting(os.path.join(out_dir, f"rank-{rank}")):
        _init(rank, world, init_file)
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
        from torch.distributed.device_mesh import init_device_mesh

        import ckptstore.dcp as cdcp

        mesh = init_device_mesh("cpu", (world,))
        model = fsdp(plain_model(seed=3), mesh)
        opt = adam(model)
        train(model, opt, range(STEPS))
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": STEPS}
        first = full_states(msd, osd)
        pending = dcp_async_save(state, storage_writer=cdcp.StorageWriter(root, "proc-1"),
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        done = getattr(pending, "upload_completion", pending)
        with torch.no_grad():  # DCP staged the state: changing it now is safe
            for v in msd.values():
                v.to_local().add_(1.0)
        state["step"] = STEPS + 1
        done.result(timeout=120)
        second = full_states(msd, osd)
        pending = dcp_async_save(state, storage_writer=cdcp.StorageWriter(root, "proc-2"),
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        getattr(pending, "upload_completion", pending).result(timeout=120)
        got = {}
        for name in ("proc-1", "proc-2"):
            back = fsdp(plain_model(seed=11), init_device_mesh("cpu", (world,)))
            bopt = adam(back)
            train(back, bopt, range(7, 8))
            bm, bo = get_state_dict(back, bopt)
            dest = {"model": bm, "optim": bo, "step": -1}
            dcp_load(dest, storage_reader=cdcp.StorageReader(root, name))
            got[name] = (full_states(dest["model"], dest["optim"]), dest["step"])
        assert got["proc-1"][1] == STEPS and got["proc-2"][1] == STEPS + 1, got
        if rank == 0:
            np.savez(os.path.join(out_dir, "truth-1.npz"), **first)
            np.savez(os.path.join(out_dir, "truth-2.npz"), **second)
            np.savez(os.path.join(out_dir, "proc-1.npz"), **got["proc-1"][0])
            np.savez(os.path.join(out_dir, "proc-2.npz"), **got["proc-2"][0])
