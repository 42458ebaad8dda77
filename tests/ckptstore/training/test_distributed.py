"""Multi-rank saves and resharding loads on gloo process groups (spawned CPU processes)."""

from __future__ import annotations

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.format.manifest import SEGMENTED_VERSION
from tests import dist_worker
from tests.helpers import spawn_ranks


def run(fn, world: int, tmp_path, root, mode: str, tag: str) -> None:
    kind = "save" if fn is dist_worker.save_worker else "load"
    spawn_ranks(fn, world, tmp_path, tag, lambda init, out: (world, init, str(root), out, mode),
                lambda rank: f"{kind}-{rank}")


def check_single_process(root) -> None:
    """A multi-rank checkpoint is an ordinary checkpoint: load it whole in one process."""
    repo = CheckpointStore(root, create=False)
    state = repo.load("step-3")
    t = dist_worker.truth()
    assert torch.equal(state["model"]["rep"], t["rep"])
    assert torch.equal(state["emb"], t["emb"])
    assert torch.equal(state["dt"], t["dt"])
    assert state["rng"]["torch_cpu"].shape[0] in (2, 3)  # one row per saving rank
    assert repo.verify("step-3").ok
    repo.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_save_on_2_load_on_1_and_3(tmp_path, mode):
    root = tmp_path / "repo"
    run(dist_worker.save_worker, 2, tmp_path, root, mode, "save")
    check_single_process(root)
    if mode == "sync":
        run(dist_worker.load_worker, 3, tmp_path, root, mode, "load3")
        manifest = CheckpointStore(root).manifest("step-3")
        assert not any(n.startswith("step-4") or n.startswith("step-5")
                       for n in CheckpointStore(root).names())
        assert manifest.metadata["world_size"] == 2


@pytest.mark.slow
def test_many_tensors_commit_a_segmented_manifest_on_2_and_load_on_3(tmp_path):
    """A collective save of more than 1,024 tensors commits a version-3 manifest (root plus
    index segments); it loads whole in one process and resharded on 3 ranks."""
    root = tmp_path / "repo"
    run(dist_worker.save_worker, 2, tmp_path, root, "many", "save")
    check_single_process(root)
    manifest = CheckpointStore(root).manifest("step-3")
    assert manifest.version == SEGMENTED_VERSION and len(manifest.segment_refs()) > 1
    state = CheckpointStore(root).load("step-3", keys=["many.t1234"])
    assert torch.equal(state["many"]["t1234"], torch.full((3,), 1234.0))
    run(dist_worker.load_worker, 3, tmp_path, root, "many", "load3")


def test_save_on_3_load_on_2(tmp_path):
    root = tmp_path / "repo"
    run(dist_worker.save_worker, 3, tmp_path, root, "plain", "save")
    check_single_process(root)
    run(dist_worker.load_worker, 2, tmp_path, root, "plain", "load2")
