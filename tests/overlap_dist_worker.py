"""Ranks of the multi-rank overlapped-save tests (spawned processes, gloo on the CPU)."""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from tests.dist_worker import leave_process_group

ROWS = 6  # rows of the sharded table per rank
WIDTH = 16


def expected_table(step: int, world: int) -> torch.Tensor:
    """The whole sharded table after `step`: row i holds i * 1000 + step."""
    rows = torch.arange(ROWS * world, dtype=torch.float32).unsqueeze(1)
    return (rows * 1000 + step).expand(ROWS * world, WIDTH).contiguous()


def _init(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)


def _finish(out_dir: str, rank: int, text: str) -> None:
    (Path(out_dir) / f"rank-{rank}").write_text(text)


def train_worker(rank: int, world: int, init_file: str, root: str, out_dir: str,
                 writer: str) -> None:
    """A replicated model and its optimizer (guarded), a Shard entry (copied at the call),
    saved every other step with staging="overlap"; every checkpoint must hold its step."""
    try:
        _init(rank, world, init_file)
        import ckptstore

        torch.manual_seed(0)  # the same model and data on every rank: replicated
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        table = torch.zeros(ROWS, WIDTH)
        shard = ckptstore.Shard(table, rank * ROWS, (ROWS * world, WIDTH))
        mgr = ckptstore.CheckpointManager(root, async_save=True, staging="overlap",
                                          max_host_bytes=64 * 1024, chunk_bytes=16 * 1024,
                                          async_writer=writer)
        gen = torch.Generator().manual_seed(5)
        snapshots = {}
        for step in range(1, 9):
            loss = model(torch.randn(16, 64, generator=gen)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()  # waits for the save in flight to stage what it changes
            table.copy_(expected_table(step, world)[rank * ROWS : (rank + 1) * ROWS])
            if step % 2 == 0:
                snapshots[step] = {k: v.clone() for k, v in model.state_dict().items()}
                mgr.save(step, {"model": model, "optim": opt, "table": shard})
        mgr.wait()
        for step, snap in snapshots.items():
            loaded = mgr.repo.load(mgr.name_of(step), keys=["model"])["model"]
            for k, v in snap.items():
                assert torch.equal(loaded[k], v), f"step {step}: {k}"
        mgr.close()
        leave_process_group()
        _finish(out_dir, rank, "ok")
    except BaseException:
        _finish(out_dir, rank, traceback.format_exc())
        raise


def change_worker(rank: int, world: int, init_file: str, root: str, out_dir: str,
                  writer: str) -> None:
    """Rank 1 changes its Shard in place right after the call, before the save could stage
    it (rank 0 joins the collective 0.3 s late): every rank must fail the save and nothing
    be committed; the next save commits the new values."""
    try:
        _init(rank, world, init_file)
        import ckptstore
        from ckptstore.training.distributed import CollectiveCommitter, checkpoint_group

        group = checkpoint_group()
        repo = ckptstore.CheckpointStore(root, chunk_bytes=16 * 1024, async_writer=writer)
        rows = 256
        table = torch.full((rows, 64), float(rank))  # 64 KiB: 4 chunks per rank
        state = {"table": ckptstore.Shard(table, rank * rows, (rows * world, 64)),
                 "w": torch.ones(128, 64)}
        if rank == 0:
            time.sleep(0.3)
        handle = repo.save_async("a", state, committer=CollectiveCommitter(group),
                                 staging="overlap", max_host_bytes=32 * 1024)
        if rank == 1:
            table.add_(1.0)  # unguarded, before the save could stage it
        try:
            handle.wait()
            outcome = "committed"
        except ckptstore.CkptStoreError as exc:
            outcome = f"failed: {exc}"
        committed = repo.exists("a")
        repo.save_async("b", state, committer=CollectiveCommitter(group),
                        staging="overlap", max_host_bytes=32 * 1024).wait()
        repo.close()
        leave_process_group()
        _finish(out_dir, rank, f"ok\n{committed}\n{outcome}")
    except BaseException:
        _finish(out_dir, rank, traceback.format_exc())
        raise
