"""Workers of tests/ckptstore/training/test_rank_save.py (spawned ranks, gloo on the CPU)."""

from __future__ import annotations

import json
import os

import torch

from tests.dist_worker import _init, reporting

#: rows of the uneven row shards of "emb" per rank (3 ranks); "gap" leaves rows 9-10 unheld
ROWS = {"even": [(0, 4), (4, 8), (8, 12)], "uneven": [(0, 5), (5, 8), (8, 12)],
        "gap": [(0, 5), (5, 8), (10, 12)]}


def truth() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"emb": torch.randn(12, 300, generator=g), "rep": torch.randn(2000, 64, generator=g),
            "bias": torch.randn(5, generator=g), "step": torch.tensor(3.0),
            "none": torch.zeros(0, 4)}


def _state(rank: int, rows: list[tuple[int, int]], extra: float = 0.0) -> dict:
    import ckptstore

    t = truth()
    a, b = rows[rank]
    return {"model": {"emb": ckptstore.Shard(t["emb"][a:b] + extra, a, tuple(t["emb"].shape)),
                      "rep": t["rep"], "bias": t["bias"], "none": t["none"]},
            "optim": {"step": t["step"]}, "note": "plain"}


def scenarios_worker(rank: int, world: int, init_file: str, base: str, out_dir: str) -> None:
    """The 3-rank scenarios of test_rank_save.py in one job (one spawn: each costs seconds of
    imports), each with a repository of its own under `base`:

    * gcd: `agree_gcds` of known columns (the gcd, 0 where no rank has a value);
    * saves: four saves (the 2nd changes emb's values, the 3rd nothing, the 4th its values
      and the ranks' rows: uneven, then even); per save, chunks written/reused, parents read
      (`KnownChunks.add_manifest`) and gcd agreements, written to stats-<rank>.json;
    * failures: rank 1's plan raises after the agreement (then a save succeeds on the same
      group), rows no rank holds ("gap"), ranks 1 and 2 holding rows 8-12 with other values
      ("differ"): each must fail on every rank with its message;
    * tiers: three saves into a near and a far tier, the third writing nothing."""
    with reporting(os.path.join(out_dir, f"r{rank}")):
        _init(rank, world, init_file)
        import torch.distributed as dist

        import ckptstore
        from ckptstore.pipeline.writer import KnownChunks
        from ckptstore.training import rank_save

        local = [[12, 6, 0, 7, 9], [8, 0, 0, 7, 6], [20, 9, 0, 7, 4]][rank]
        got = rank_save.agree_gcds(local, dist.group.WORLD)
        assert got == [4, 3, 0, 7, 1], got

        rounds: list[int] = []
        real_agree = rank_save.agree_gcds

        def counting(local, group):
            rounds.append(len(local))
            return real_agree(local, group)

        reads: list[str] = []
        real_add = KnownChunks.add_manifest

        def counting_add(self, manifest):
            reads.append(manifest.name)
            return real_add(self, manifest)

        rank_save.agree_gcds = counting
        KnownChunks.add_manifest = counting_add
        mgr = ckptstore.CheckpointManager(os.path.join(base, "saves"), keep_last=5,
                                          chunk_bytes=16 * 1024)
        report = []
        for step, extra, rows in ((1, 0.0, ROWS["uneven"]), (2, 1.0, ROWS["uneven"]),
                                  (3, 1.0, ROWS["uneven"]), (4, 2.0, ROWS["even"])):
            reads.clear()
            rounds.clear()
            info = mgr.save(step, _state(rank, rows, extra))
            report.append({"written": info.chunks_written, "reused": info.chunks_reused,
                           "reads": list(reads), "rounds": len(rounds)})
        mgr.close()
        with open(os.path.join(out_dir, f"stats-{rank}.json"), "w") as f:
            json.dump(report, f)

        mgr = ckptstore.CheckpointManager(os.path.join(base, "planfail"),
                                          chunk_bytes=16 * 1024)
        real_plan = rank_save.plan_rank

        def failing_plan(*args, **kwargs):
            if rank == 1:
                raise RuntimeError("plan exploded on rank 1")
            return real_plan(*args, **kwargs)

        rank_save.plan_rank = failing_plan
        try:
            mgr.save(1, _state(rank, ROWS["uneven"]))
            raise AssertionError("a save whose plan failed on a rank succeeded")
        except ckptstore.CkptStoreError as exc:
            assert "plan exploded on rank 1" in str(exc), str(exc)
        rank_save.plan_rank = real_plan
        mgr.save(2, _state(rank, ROWS["uneven"]))  # the group is still usable
        mgr.close()

        for mode, rows, want in (("gap", ROWS["gap"], "do not cover"),
                                 ("differ", [(0, 5), (5, 12), (8, 12)],
                                  "hold different values")):
            mgr = ckptstore.CheckpointManager(os.path.join(base, mode), chunk_bytes=16 * 1024)
            try:
                mgr.save(1, _state(rank, rows, float(rank) if mode == "differ" else 0.0))
                raise AssertionError(f"a save whose shards are wrong ({mode}) succeeded")
            except ckptstore.CkptStoreError as exc:
                assert want in str(exc) and "model.emb" in str(exc), str(exc)
            mgr.close()

        mgr = ckptstore.CheckpointManager([os.path.join(base, "near"),
                                           os.path.join(base, "far")],
                                          keep_last=[3, 3], every=[1, 1],
                                          chunk_bytes=16 * 1024)
        for step, extra in ((1, 0.0), (2, 1.0), (3, 1.0)):
            info = mgr.save(step, _state(rank, ROWS["uneven"], extra))
            if step == 3:
                assert info.chunks_written == 0, info  # all remembered from step 2
        mgr.wait()
        mgr.close()


def hsdp_truth() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {f"w{i}": torch.randn(64 + 8 * i, 48, generator=g) for i in range(6)}


def strided_rows(n: int, i: int, j: int) -> list[int]:
    """The rows of an n-row tensor that mesh coordinate (i, j) holds under (Shard(0),
    _StridedShard(0, split_factor=2)): half i, cut in 4 pieces, pieces j and j + 2 (rows
    far apart: two boxes per rank), as torch's DTensor places them."""
    q = n // 8
    return [*range(i * n // 2 + j * q, i * n // 2 + (j + 1) * q),
            *range(i * n // 2 + (j + 2) * q, i * n // 2 + (j + 3) * q)]


def hsdp_worker(rank: int, world: int, init_file: str, root: str, out_dir: str) -> None:
    """4 ranks, a 2 x 2 mesh (Replicate, Shard(0)) as HSDP places parameters: each row range
    is held by two ranks. Reports the chunks this rank wrote and its replica index. Then a
    save of strided shards on the same mesh (Shard(0), _StridedShard(0, 2): each rank holds
    two row ranges far apart, as FSDP2 over tensor parallelism can), by rank plans too,
    restored back into strided DTensors."""
    with reporting(os.path.join(out_dir, f"r{rank}")):
        _init(rank, world, init_file)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.placement_types import _StridedShard

        import ckptstore

        mesh = init_device_mesh("cpu", (2, 2))
        state = {k: distribute_tensor(v, mesh, [Replicate(), Shard(0)])
                 for k, v in hsdp_truth().items()}
        mgr = ckptstore.CheckpointManager(root, chunk_bytes=1024)
        info = mgr.save(1, {"model": state})
        written = info.chunks_written

        i, j = mesh.get_coordinate()
        placements = [Shard(0), _StridedShard(0, split_factor=2)]

        def strided(values: dict[str, torch.Tensor]) -> dict[str, DTensor]:
            return {k: DTensor.from_local(v[strided_rows(v.shape[0], i, j)], mesh, placements,
                                          shape=v.shape, stride=v.stride(), run_check=False)
                    for k, v in values.items()}

        truth = hsdp_truth()
        held = strided(truth)
        for k, v in held.items():  # torch agrees on what each rank holds
            assert torch.equal(v.full_tensor(), truth[k]), k
        mgr.save(2, {"model": held})
        by_plans = mgr._rank_memory.committed == "step-2"  # set by a save by rank plans only
        back = strided({k: torch.zeros_like(v) for k, v in truth.items()})
        assert mgr.restore({"model": back}) == 2
        for k, v in back.items():
            assert torch.equal(v.to_local(), truth[k][strided_rows(v.shape[0], i, j)]), k
        mgr.close()
        with open(os.path.join(out_dir, f"stats-{rank}.json"), "w") as f:
            json.dump({"written": written, "coordinate": list(mesh.get_coordinate()),
                       "strided_by_rank_plans": by_plans}, f)


#: where crash_main SIGKILLs its rank during the 2nd save: after this rank's chunks are
#: durable (before it sends their references), after it wrote the segments it builds (before
#: it reports them), or (rank 0) after the tree blob is durable, before the root is created
KILL_POINTS = ("written", "built", "before-root")


def crash_main(rank: int, world: int, init_file: str, root: str, kill_rank: int,
               point: str) -> None:
    """One rank of a 3-rank job (a subprocess): saves step 1, then step 2 (values changed)
    with rank `kill_rank` SIGKILLed at `point` (KILL_POINTS; "none": no kill and no step 1,
    a new job after the crash). Prints "saved 1", then "saved 2" or "failed 2 <error>"."""
    import signal

    import torch.distributed as dist

    import ckptstore
    from ckptstore.training import rank_save

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    armed = [False]

    def die() -> None:
        if armed[0] and rank == kill_rank:
            print("dying", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    real_outgoing, real_build = rank_save.outgoing, rank_save.build_segments

    def outgoing(*args, **kwargs):
        if point == "written":
            die()
        return real_outgoing(*args, **kwargs)

    def build(*args, **kwargs):
        built = real_build(*args, **kwargs)
        if point == "built" and built:
            die()
        return built

    rank_save.outgoing, rank_save.build_segments = outgoing, build
    mgr = ckptstore.CheckpointManager(root, keep_last=5, chunk_bytes=16 * 1024)
    if point == "before-root" and rank == kill_rank:
        real_create = mgr.repo.store.create

        def create(key, data, *args, **kwargs):
            if key.startswith("checkpoints/"):
                die()
            return real_create(key, data, *args, **kwargs)

        mgr.repo.store.create = create
    if point != "none":  # "none": a new job after a crash, saving step 2 only
        mgr.save(1, _state(rank, ROWS["uneven"], 0.0))
        print("saved 1", flush=True)
    armed[0] = True
    try:
        mgr.save(2, _state(rank, ROWS["uneven"], 5.0))
        print("saved 2", flush=True)
    except Exception as exc:  # the survivors: the collective fails, nothing is committed
        print(f"failed 2 {type(exc).__name__}", flush=True)
        os._exit(0)  # the group is broken: leave without its teardown
    mgr.close()
    dist.barrier()
    dist.destroy_process_group()


def s3_worker(rank: int, world: int, init_file: str, uri: str, endpoint: str,
              out_dir: str) -> None:
    """Two saves by rank plans into an S3 bucket (the second reusing each rank's chunks)."""
    with reporting(os.path.join(out_dir, f"r{rank}")):
        _init(rank, world, init_file)
        import ckptstore

        mgr = ckptstore.CheckpointManager(uri, endpoint_url=endpoint, chunk_bytes=16 * 1024)
        mgr.save(1, _state(rank, ROWS["uneven"], 0.0))
        info = mgr.save(2, _state(rank, ROWS["uneven"], 0.0))
        assert info.chunks_written == 0, info
        mgr.close()
