"""Peer replicas on real gloo process groups (spawned CPU processes, one folder per rank
standing for one node each) with moto S3 as the far tier: a rank that lost its folder gets
its checkpoint back from its peer, bit-exact, without reading a blob from the far tier; the
checkpoint restored is the newest in commit order (not the largest step). With many tensors
the manifests are version 3 (root + index segments): the segments travel between peers as
the blobs they are."""

from __future__ import annotations

import json
import shutil
import traceback
from pathlib import Path

import pytest
import torch

from ckptstore.format.manifest import FORMAT_VERSION, SEGMENTED_VERSION
from ckptstore.format.segment_encoding import SEGMENTED_ABOVE_TENSORS
from tests.dist_worker import leave_process_group
from tests.helpers import spawn_ranks
from tests.reliability.s3chaos import ChaosServer, moto_app


def truth(rank: int, step: int, extra: int = 0) -> dict[str, torch.Tensor]:
    """The model of `rank` at `step`, with `extra` small tensors more (a many-tensor model)."""
    g = torch.Generator().manual_seed(100 * rank + step)
    model = {"w": torch.randn(256, 512, generator=g), "b": torch.randn(64, generator=g)}
    model.update((f"e{i}", torch.randn(4, generator=g)) for i in range(extra))
    return model


def worker(rank: int, world: int, init: str, root: str, far: str, endpoint: str,
           phase: str, out: str, extra: int) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                                world_size=world)
        import ckptstore

        tiers = [f"{root}/node{{rank}}", f"{far}/{{rank}}"]
        mgr = ckptstore.CheckpointManager(tiers, peer_replicas=1, keep_last=[2, 5],
                                          every=[1, 2], endpoint_url=endpoint)
        if phase == "save":
            for step in (1, 5, 3):  # 3 after 5 (a rollback): the latest in commit order
                mgr.save(step, {"model": truth(rank, step, extra)})
        else:
            dest = {"model": {k: torch.zeros_like(v)
                              for k, v in truth(rank, 0, extra).items()}}
            assert mgr.restore(dest) == 3
            want = truth(rank, 3, extra)
            for k, v in want.items():
                assert torch.equal(dest["model"][k], v), k
            assert mgr.repo.last_load is not None
            served = mgr.repo.last_load.bytes_by_tier
            assert served[mgr.repo.tiers[1].uri] == 0, served  # nothing read from S3
            from_peer = sum(n for uri, n in served.items() if uri.startswith("peer://"))
            if rank == world - 1:  # the lost rank loaded straight from the received bytes
                assert from_peer > 0 and served[mgr.repo.tiers[0].uri] == 0, served
            else:
                assert from_peer == 0, served
        mgr.close()
        Path(out, f"{phase}-{rank}").write_text("ok")
    except BaseException:
        Path(out, f"{phase}-{rank}").write_text(traceback.format_exc())
        raise
    finally:
        leave_process_group()


def run(world: int, tmp: Path, far: str, endpoint: str, phase: str, extra: int) -> None:
    spawn_ranks(worker, world, tmp, phase,
                lambda init, out: (world, init, str(tmp / "nodes"), far, endpoint, phase, out,
                                   extra),
                lambda rank: f"{phase}-{rank}")


@pytest.mark.slow
@pytest.mark.parametrize("world,extra", [(2, 0), (3, 0), (2, SEGMENTED_ABOVE_TENSORS + 500)])
def test_lost_rank_folder_restores_from_peer_not_far(tmp_path: Path, s3_uri: str,
                                                     world: int, extra: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptstore

    server = ChaosServer(moto_app())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one folder per rank stands for a node
    try:
        run(world, tmp_path, s3_uri, server.endpoint, "save", extra)
        lost = world - 1
        peer_copy = tmp_path / "nodes" / "node0" / "peers" / f"rank-{lost}"
        assert sorted(p.name for p in (peer_copy / "checkpoints").iterdir()) == [
            "step-3.json", "step-5.json"]  # the peer keeps what tier 0's keep_last keeps
        shutil.rmtree(tmp_path / "nodes" / f"node{lost}")  # the node is gone
        server.plan.reset()
        run(world, tmp_path, s3_uri, server.endpoint, "restore", extra)
        blob_gets = [r for r in server.plan.requests("GET") if "/blobs/" in r["path"]]
        assert blob_gets == []  # the far tier served no chunk: the peer did
        restored = tmp_path / "nodes" / f"node{lost}" / "checkpoints" / "step-3.json"
        assert restored.exists()  # tier 0 of the lost rank is whole again: written after
        version = json.loads(restored.read_bytes())["version"]
        assert version == (SEGMENTED_VERSION if extra else FORMAT_VERSION)
        with ckptstore.CheckpointStore(str(tmp_path / "nodes" / f"node{lost}")) as near:
            assert near.verify("step-3").ok  # the load, in the background, before close
    finally:
        server.close()


def test_peer_replicas_need_distributed(tmp_path: Path) -> None:
    import ckptstore

    with pytest.raises(ValueError, match="torch.distributed"):
        ckptstore.CheckpointManager(str(tmp_path), peer_replicas=1)
    with pytest.raises(ValueError, match="peer_replicas"):
        ckptstore.CheckpointManager(str(tmp_path), peer_replicas=-1)
