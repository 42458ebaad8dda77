"""Workers for the multi-rank tests (spawned processes, gloo on the CPU)."""

from __future__ import annotations

import os
import traceback

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


def _dtensor(full: torch.Tensor, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return distribute_tensor(full, mesh, [Shard(0)])


def _state(rank: int, world: int, fill_zero: bool):
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


def save_worker(rank: int, world: int, init_file: str, root: str, out_dir: str,
                mode: str) -> None:
    try:
        _init(rank, world, init_file)
        import ckptstore

        mgr = ckptstore.CheckpointManager(root, async_save=(mode == "async"), keep_last=2,
                                          chunk_bytes=64 * 1024)
        torch.manual_seed(1000 + rank)
        state = _state(rank, world, fill_zero=False)
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
        if dist.is_initialized():
            dist.destroy_process_group()


def load_worker(rank: int, world: int, init_file: str, root: str, out_dir: str,
                mode: str) -> None:
    try:
        _init(rank, world, init_file)
        import ckptstore

        mgr = ckptstore.CheckpointManager(root)
        state = _state(rank, world, fill_zero=True)
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
        if dist.is_initialized():
            dist.destroy_process_group()
