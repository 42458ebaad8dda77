"""Workers for the multi-rank tests (spawned processes, gloo on the CPU)."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

GLOBAL_ROWS = 10


def truth() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(42)
    return {"rep": torch.randn(300, 257, generator=g), "bias": torch.randn(7, generator=g),
            "emb": torch.randn(GLOBAL_ROWS, 33, generator=g),
            "dt": torch.randn(13, 64, generator=g)}


def split(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Uneven contiguous split (the last rank gets the remainder)."""
    per = -(-rows // world)
    return min(rows, rank * per), min(rows, (rank + 1) * per)


def _init(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)


def leave_process_group(succeeded: bool | None = None) -> None:
    """Destroy the default group (call in a worker's `finally`). When the worker succeeded
    (default: no exception is being handled), wait at a barrier first until every rank is
    done with the group: a rank that closes its sockets while a peer still uses them can
    make gloo abort that peer at exit ("terminate called without an active exception").
    After a failure, the others may never arrive."""
    if not dist.is_initialized():
        return
    if succeeded if succeeded is not None else sys.exc_info()[0] is None:
        dist.barrier()
    dist.destroy_process_group()


@contextlib.contextmanager
def reporting(path: str) -> Iterator[None]:
    """The body of one spawned rank (tests.helpers.spawn_ranks reads its report): "ok" is
    written to `path` when the body ends, its traceback when it raises (then re-raised), and
    the process group is left either way (leave_process_group)."""
    text = "(interrupted)"
    try:
        yield
        text = "ok"
    except BaseException:
        text = traceback.format_exc()
        raise
    finally:
        Path(path).write_text(text)
        leave_process_group(succeeded=text == "ok")


def _dtensor(full: torch.Tensor, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return distribute_tensor(full, mesh, [Shard(0)])


#: mode "many": this many more small replicated tensors, so that the manifest is version 3
MANY = 1500


def _state(rank: int, world: int, fill_zero: bool, many: bool = False):
    import ckptstore

    t = truth()
    a, b = split(GLOBAL_ROWS, world, rank)
    emb = torch.zeros(b - a, 33) if fill_zero else t["emb"][a:b].clone()
    dt = _dtensor(torch.zeros_like(t["dt"]) if fill_zero else t["dt"], world)
    return {
        "model": {"rep": torch.zeros_like(t["rep"]) if fill_zero else t["rep"].clone(),
                  "bias": torch.zeros(7) if fill_zero else t["bias"].clone()},
        "emb": ckptstore.Shard(emb, a, (GLOBAL_ROWS, 33)),
        "dt": dt,
        "rng": ckptstore.RNGState(),
        "meta": {"note": "hello"},
        **({"many": {f"t{i}": torch.full((3,), 0.0 if fill_zero else float(i))
                     for i in range(MANY)}} if many else {}),
    }


def _check(state) -> None:
    t = truth()
    assert torch.equal(state["model"]["rep"], t["rep"])
    assert torch.equal(state["model"]["bias"], t["bias"])
    a, b = state["emb"].rows
    assert torch.equal(state["emb"].data, t["emb"][a:b])
    from torch.distributed.tensor import Shard as DShard  # noqa: F401

    local = state["dt"].to_local()
    full = state["dt"].full_tensor()
    assert torch.equal(full, t["dt"]), "dtensor"
    assert local.shape[0] <= t["dt"].shape[0]
    assert state["meta"] == {"note": "hello"}
    for i, v in enumerate(state.get("many", {}).values()):
        assert torch.equal(v, torch.full((3,), float(i))), f"many.t{i}"


def save_worker(rank: int, world: int, init_file: str, root: str, out_dir: str,
                mode: str) -> None:
    try:
        _init(rank, world, init_file)
        import ckptstore

        mgr = ckptstore.CheckpointManager(root, async_save=(mode == "async"), keep_last=2,
                                          chunk_bytes=64 * 1024)
        torch.manual_seed(1000 + rank)
        state = _state(rank, world, fill_zero=False, many=(mode == "many"))
        for step in (1, 2, 3):
            result = mgr.save(step, state)
            state["model"]["rep"].add_(0.0)  # trainer goes on (values unchanged: see truth)
        if mode == "async":
            result.wait()
        mgr.wait()
        # a failing rank: nothing is committed and every rank sees the error
        if mode == "sync":
            bad = dict(state)
            if rank == 1:
                bad["oops"] = object()
            else:
                bad["oops"] = 1
            try:
                mgr.save(4, bad)
                raise AssertionError("collective save with a failing rank succeeded")
            except ckptstore.CkptStoreError as exc:
                assert "rank 1" in str(exc) or "oops" in str(exc), str(exc)
            class Broken:  # a Stateful whose state_dict fails on one rank only
                def state_dict(self):
                    if rank == 1:
                        raise RuntimeError("state_dict exploded on rank 1")
                    return {"ok": 1}

                def load_state_dict(self, sd):
                    pass

            try:
                mgr.save(6, {**state, "broken": Broken()})
                raise AssertionError("collective save with a failing state_dict succeeded")
            except (ckptstore.CkptStoreError, RuntimeError) as exc:
                assert "exploded" in str(exc), str(exc)
            if rank == 1:
                real_put = mgr.repo.store.put

                def failing_put(key, data, _real=real_put):
                    if key.startswith("blobs/"):
                        raise ckptstore.StoreError("injected write failure on rank 1")
                    return _real(key, data)

                mgr.repo.store.put = failing_put
            state["model"]["rep"].mul_(2)  # new bytes so rank 1 must write
            try:
                mgr.save(5, state)
                raise AssertionError("collective save with a failing store succeeded")
            except ckptstore.CkptStoreError as exc:
                assert "injected" in str(exc), str(exc)
        mgr.close()
        with open(os.path.join(out_dir, f"save-{rank}"), "w") as f:
            f.write("ok")
    except BaseException:
        with open(os.path.join(out_dir, f"save-{rank}"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        leave_process_group()


def load_worker(rank: int, world: int, init_file: str, root: str, out_dir: str,
                mode: str) -> None:
    try:
        _init(rank, world, init_file)
        import ckptstore

        mgr = ckptstore.CheckpointManager(root)
        state = _state(rank, world, fill_zero=True, many=(mode == "many"))
        step = mgr.restore(state)
        assert step == 3, step
        _check(state)
        assert sorted(mgr.steps()) == [2, 3], mgr.steps()  # keep_last=2
        mgr.close()
        with open(os.path.join(out_dir, f"load-{rank}"), "w") as f:
            f.write("ok")
    except BaseException:
        with open(os.path.join(out_dir, f"load-{rank}"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        leave_process_group()


# ---------------------------------------------------------------- DTensor resharding
# Each tensor: (shape, dtype, placements on the 2x2 save mesh). Placement codes: "S<d>" is
# Shard(d), "R" is Replicate().
DT_SPECS: dict[str, tuple[tuple[int, ...], str, list[str]]] = {
    "a": ((16, 12), "float32", ["S0", "S1"]),
    "b": ((7, 5), "float64", ["S0", "S1"]),  # uneven on both dims
    "c": ((10, 6), "bfloat16", ["S1", "S0"]),
    "d": ((9, 8), "uint8", ["S0", "S0"]),  # two mesh dims shard dim 0
    "f": ((7, 4), "float32", ["S0", "S0"]),  # 7 rows on 4 ranks: 2, 2, 2, 1
    "r": ((300, 20), "float32", ["R", "R"]),  # replicated: chunks balanced over ranks
    "h": ((6, 40), "float32", ["R", "S1"]),  # replicated over mesh dim 0
}
# how the 2-rank and 3-rank jobs ask for them back (1-D meshes)
DT_LOAD = {2: {"a": ["S1"], "b": ["S1"], "c": ["S0"], "d": ["S1"], "f": ["S0"], "r": ["R"],
               "h": ["S0"]},
           3: {"a": ["S0"], "b": ["S0"], "c": ["S1"], "d": ["R"], "f": ["S1"], "r": ["S0"],
               "h": ["S1"]}}
# saved by the 2-rank job with a 1-D mesh and Shard(1), read back by 3 ranks as Shard(2)/R
DT_3D = {"x": ((5, 6, 9), "float32", ["S1"], ["S2"]), "y": ((4, 7, 3), "float64", ["S1"], ["R"])}


def dt_truth(name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if dtype == "uint8":
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(getattr(torch, dtype))


def _placements(codes: list[str]) -> list:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard

    return [Replicate() if c == "R" else DShard(int(c[1:])) for c in codes]


def _dt(full: torch.Tensor, mesh, codes: list[str]):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, mesh, _placements(codes))


def _load_measured(root: str, name: str, into) -> tuple[int, int]:
    """Load `name` into `into` (in place); (bytes read, bytes the local parts hold)."""
    import ckptstore
    from ckptstore.pipeline.loading import load_state
    from ckptstore.pipeline.reader import CheckpointReader

    repo = ckptstore.CheckpointStore(root, create=False)
    reader = CheckpointReader(repo.store, repo.load_options)
    load_state(reader, repo.manifest(name), into=into)
    needed = sum(v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes
                 for v in into.values())
    repo.close()
    return reader.bytes_read, needed


def dtensor_worker(rank: int, world: int, init_file: str, root: str, out_dir: str,
                   mode: str) -> None:
    """mode "save4": 2x2 mesh saves DT_SPECS. "load2": 1-D mesh of 2 reads them back with
    DT_LOAD[2] and saves DT_3D with Shard(1). "load3": reads both back on a mesh of 3.
    Writes a JSON line of bytes read/needed per rank to out_dir."""
    import json

    try:
        _init(rank, world, init_file)
        from torch.distributed.device_mesh import init_device_mesh

        import ckptstore

        report: dict = {}
        if mode == "save4":
            mesh = init_device_mesh("cpu", (2, 2))
            state = {k: _dt(dt_truth(k, s, d), mesh, p) for k, (s, d, p) in DT_SPECS.items()}
            state["step"] = torch.tensor(5)
            mgr = ckptstore.CheckpointManager(root, chunk_bytes=4096)
            mgr.save(1, state)
            # the same state by an async save that copies blocks in the background
            amgr = ckptstore.CheckpointManager(root + "-overlap", async_save=True,
                                               staging="overlap", max_host_bytes=1 << 16,
                                               chunk_bytes=4096)
            info = amgr.save(1, state).wait()
            assert info.staging == "overlap", info.staging
            amgr.close()
            from torch.distributed.tensor import DTensor, Partial, Replicate

            partial = DTensor.from_local(torch.ones(3), mesh, [Partial(), Replicate()])
            try:
                mgr.save(2, {"p": partial})
                raise AssertionError("a Partial() DTensor was saved")
            except (ckptstore.CkptStoreError, TypeError) as exc:
                assert "redistribute" in str(exc), str(exc)
            mgr.close()
        else:
            mesh = init_device_mesh("cpu", (world,))
            into = {k: _dt(torch.zeros(s, dtype=getattr(torch, d)), mesh, DT_LOAD[world][k])
                    for k, (s, d, _p) in DT_SPECS.items()}
            read, needed = _load_measured(root, "step-1", into)
            report["read"], report["needed"] = read, needed
            for k, (s, d, _p) in DT_SPECS.items():
                want = _dt(dt_truth(k, s, d), mesh, DT_LOAD[world][k]).to_local()
                assert torch.equal(into[k].to_local(), want), k
            if mode == "load2":
                mgr = ckptstore.CheckpointManager(root, chunk_bytes=4096)
                mgr.save(2, {k: _dt(dt_truth(k, s, d), mesh, p)
                             for k, (s, d, p, _q) in DT_3D.items()})
                mgr.close()
            else:
                into3 = {k: _dt(torch.zeros(s, dtype=getattr(torch, d)), mesh, q)
                         for k, (s, d, _p, q) in DT_3D.items()}
                mgr = ckptstore.CheckpointManager(root)
                assert mgr.restore(into3, step=2) == 2
                mgr.close()
                for k, (s, d, _p, _q) in DT_3D.items():
                    assert torch.equal(into3[k].full_tensor(), dt_truth(k, s, d)), k
        with open(os.path.join(out_dir, f"dt-{rank}"), "w") as f:
            f.write("ok " + json.dumps(report))
    except BaseException:
        with open(os.path.join(out_dir, f"dt-{rank}"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        leave_process_group()


# ---------------------------------------------------------------- FSDP2 + TP and Adam
TP_STEPS, TP_MORE = 3, 2  # steps before the checkpoint, steps after it


class TPNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 32, dtype=torch.float64)  # column-wise parallel
        self.down = torch.nn.Linear(32, 6, dtype=torch.float64)  # row-wise parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _tp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return (torch.randn(8, 8, generator=g, dtype=torch.float64),
            torch.randn(8, 6, generator=g, dtype=torch.float64))


def _tp_model(world: int, seed: int):
    """world 4: 2x2 mesh, tensor parallel on "tp" and FSDP2 on "dp" (strided shards);
    world 2: tensor parallel only. Returns (model, optimizer, this rank's batch slice)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(seed)
    model = TPNet()
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(),
                                               "down": RowwiseParallel()})
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh["dp"])
        dp = mesh["dp"].get_local_rank()
        rows = slice(4 * dp, 4 * dp + 4)  # the global batch of 8, split over dp
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        rows = slice(0, 8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, rows


def _tp_train(model, opt, rows: slice, steps: range) -> None:
    for step in steps:
        x, y = _tp_batch(step)
        opt.zero_grad()
        loss = ((model(x[rows]) - y[rows]) ** 2).mean()
        loss.backward()
        opt.step()


def _full_states(model, opt) -> dict[str, np.ndarray]:
    """Every parameter and Adam state as full numpy arrays (collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {}
    for k, v in msd.items():
        out[f"model.{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v
                             ).detach().numpy().copy()  # a copy: the values move on
    for k, st in osd["state"].items():
        for name, v in st.items():
            out[f"optim.{k}.{name}"] = (v.full_tensor() if hasattr(v, "full_tensor")
                                        else v).detach().numpy().copy()
    return out


def tp_worker(rank: int, world: int, init_file: str, root: str, out_dir: str,
              mode: str) -> None:
    """mode "train4": FSDP2+TP on 4 ranks, TP_STEPS steps, save, then TP_MORE more steps
    (the uninterrupted run). "resume2": TP on 2 ranks from a different init, restore, train
    TP_MORE steps, save. "resume4": FSDP2+TP on 4 ranks restores that. Rank 0 writes .npz
    files of the full states."""
    try:
        _init(rank, world, init_file)
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        import ckptstore

        if mode != "resume4":
            model, opt, rows = _tp_model(world, seed=1 if mode == "train4" else 2)
        mgr = ckptstore.CheckpointManager(root, chunk_bytes=512)
        if mode == "train4":
            _tp_train(model, opt, rows, range(TP_STEPS))
            msd, osd = get_state_dict(model, opt)
            mgr.save(TP_STEPS, {"model": msd, "optim": osd})
            # strided shards (several boxes per rank) are planned by each rank too
            assert mgr._rank_memory.committed == f"step-{TP_STEPS}", "not by rank plans"
            saved = _full_states(model, opt)
            _tp_train(model, opt, rows, range(TP_STEPS, TP_STEPS + TP_MORE))
            final = _full_states(model, opt)
        elif mode == "resume2":
            msd, osd = get_state_dict(model, opt)  # initialised states to fill in place
            assert mgr.restore({"model": msd, "optim": osd}) == TP_STEPS
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            saved = _full_states(model, opt)
            _tp_train(model, opt, rows, range(TP_STEPS, TP_STEPS + TP_MORE))
            final = _full_states(model, opt)
            msd, osd = get_state_dict(model, opt)
            mgr.save(TP_STEPS + TP_MORE, {"model": msd, "optim": osd})
        else:  # "resume4": the 2-rank checkpoint back into FSDP2 + TP (strided shards)
            model, opt, rows = _tp_model(4, seed=3)
            msd, osd = get_state_dict(model, opt)
            assert mgr.restore({"model": msd, "optim": osd}) == TP_STEPS + TP_MORE
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            saved = final = _full_states(model, opt)
        mgr.close()
        if rank == 0:
            np.savez(os.path.join(out_dir, "saved.npz"), **saved)
            np.savez(os.path.join(out_dir, "final.npz"), **final)
        with open(os.path.join(out_dir, f"tp-{rank}"), "w") as f:
            f.write("ok")
    except BaseException:
        with open(os.path.join(out_dir, f"tp-{rank}"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        leave_process_group()


def ema_overlap_worker(rank: int, world: int, init_file: str, root: str, out_dir: str) -> None:
    """An FSDP2 EMA model saved by an overlapped async save, then updated at once, unguarded,
    with torch._foreach_lerp_ (as EMA helpers do): that op moves no DTensor's version
    counter, so the manager must have copied those parameters at the call. The checkpoint
    must hold the call's values."""
    with reporting(os.path.join(out_dir, f"ema-{rank}")):
        _init(rank, world, init_file)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import ckptstore

        model = torch.nn.Linear(2048, 8192, bias=False)  # 64 MiB: 32 MiB a rank
        with torch.no_grad():
            model.weight.fill_(1.0)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        mgr = ckptstore.CheckpointManager(root, async_save=True, staging="overlap",
                                          max_host_bytes=1 << 20, chunk_bytes=256 << 10)
        mgr.save(1, {"ema_model": model})
        time.sleep(0.02)  # the save's copies under way
        params = list(model.parameters())
        with torch.no_grad():
            torch._foreach_lerp_(params, [torch.full_like(p, 7.0) for p in params], 1.0)
        mgr.wait()
        mgr.close()
        if rank == 0:
            stored = ckptstore.CheckpointStore(root).load("step-1")["ema_model"]["weight"]
            assert bool((stored == 1.0).all()), stored.unique()


def unshared_worker(rank: int, world: int, init_file: str, base: str, out_dir: str,
                    how: str) -> None:
    """Each rank saves to a folder of its own (a node-local path on every node): the
    collective save (`how` "manager") or a DCP save ("dcp") must fail on every rank, naming
    the cause, and commit nothing."""
    with reporting(os.path.join(out_dir, f"unshared-{rank}")):
        _init(rank, world, init_file)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        import ckptstore
        import ckptstore.dcp

        mesh = init_device_mesh("cpu", (world,))
        state = {"w": distribute_tensor(torch.arange(4096 * 16.0).reshape(4096, 16), mesh,
                                        [Shard(0)])}
        mine = os.path.join(base, f"node{rank}")
        try:
            if how == "manager":
                mgr = ckptstore.CheckpointManager(mine, chunk_bytes=64 << 10)
                try:
                    mgr.save(1, state)
                finally:
                    mgr.close()
            else:
                ckptstore.dcp.save(state, mine, "step-1")
        except ckptstore.CkptStoreError as exc:
            assert "same" in str(exc) and "not in" in str(exc), exc
        else:
            raise AssertionError("a save to storage the ranks do not share succeeded")
        assert ckptstore.CheckpointStore(mine).names() == []


def _rows(world: int, value: float) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(8 * 4096.0).reshape(8, 4096) * value
    return {"w": distribute_tensor(full, init_device_mesh("cpu", (world,)), [Shard(0)])}


def agreed_restore_worker(rank: int, world: int, init_file: str, root: str, out_dir: str,
                          phase: str) -> None:
    """phase "save": steps 1 and 2 of a row-sharded tensor. phase "restore" (after the test
    damaged a chunk of step 2 that only the last rank reads): every rank takes step 1
    together, with the warning; then restore(step=...) asking different steps per rank is
    refused on every rank."""
    with reporting(os.path.join(out_dir, f"agreed-{phase}-{rank}")):
        _init(rank, world, init_file)
        import warnings

        import ckptstore

        mgr = ckptstore.CheckpointManager(root, chunk_bytes=16 << 10)
        try:
            if phase == "save":
                mgr.save(1, _rows(world, 1.0))
                mgr.save(2, _rows(world, 2.0))
                return
            state = _rows(world, 0.0)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert mgr.restore(state) == 1
            assert any("step 2 is damaged" in str(w.message) for w in caught), caught
            assert torch.equal(state["w"].full_tensor(), _rows(world, 1.0)["w"].full_tensor())
            for mine in (1 + rank, None if rank == 0 else 2):  # (also: one asks none)
                try:
                    mgr.restore(state, step=mine)
                except ckptstore.CkptStoreError as exc:
                    assert "different steps" in str(exc), exc
                else:
                    raise AssertionError("ranks restored different steps")
        finally:
            mgr.close()


def different_copies_worker(rank: int, world: int, init_file: str, root: str,
                            out_dir: str) -> None:
    """Every rank holds `w` whole but with its own values (a tensor not synchronized, or a
    per-rank value): the collective save must fail on every rank naming it, not commit each
    chunk from whichever rank owns it. Equal copies (`b`, large: sampled) still save."""
    with reporting(os.path.join(out_dir, f"copies-{rank}")):
        _init(rank, world, init_file)
        import ckptstore

        mgr = ckptstore.CheckpointManager(root, chunk_bytes=4096)
        try:
            big = torch.arange(1 << 20, dtype=torch.float32)
            try:
                mgr.save(1, {"w": torch.full((4096,), float(rank)), "b": big})
            except ckptstore.CkptStoreError as exc:
                assert "different values in 'w'" in str(exc), exc
            else:
                raise AssertionError("copies that differ were committed")
            mgr.save(2, {"w": torch.ones(4096), "b": big})
            assert mgr.latest_step() == 2
        finally:
            mgr.close()


def value_keys_worker(rank: int, world: int, init_file: str, root: str, out_dir: str) -> None:
    """Values that are not tensors come from rank 0's state: a key only rank 1 holds fails
    the save on every rank (it would be lost); the same keys with per-rank values save, and
    every rank restores rank 0's."""
    with reporting(os.path.join(out_dir, f"keys-{rank}")):
        _init(rank, world, init_file)
        import ckptstore

        mgr = ckptstore.CheckpointManager(root)
        try:
            extra = {"only_rank1": 5} if rank == 1 else {}
            try:
                mgr.save(1, {"w": torch.ones(4), "meta": {"seen": 100 + rank, **extra}})
            except ckptstore.CkptStoreError as exc:
                assert "different keys" in str(exc), exc
            else:
                raise AssertionError("a key only rank 1 held was dropped without an error")
            mgr.save(2, {"w": torch.ones(4), "meta": {"seen": 100 + rank}})
            state = {"w": torch.zeros(4), "meta": {"seen": -1}}
            assert mgr.restore(state) == 2 and state["meta"]["seen"] == 100
        finally:
            mgr.close()
