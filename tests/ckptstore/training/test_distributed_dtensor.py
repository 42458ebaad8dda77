"""DTensors on any mesh and placement, saved on N ranks and read back on M (gloo, CPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ckptstore import CheckpointStore, Shard
from tests import dist_worker as W
from tests.helpers import spawn_ranks


def run(world: int, tmp_path, root, mode: str) -> list[dict]:
    reports = spawn_ranks(W.dtensor_worker, world, tmp_path, mode,
                          lambda init, out: (world, init, str(root), out, mode),
                          lambda rank: f"dt-{rank}")
    return [json.loads(text[3:]) for text in reports]


@pytest.mark.slow
def test_2x2_mesh_to_2_and_3_ranks_and_back_to_one_process(tmp_path):
    root = tmp_path / "repo"
    run(4, tmp_path, root, "save4")
    repo = CheckpointStore(root, create=False)
    manifest = repo.manifest("step-1")
    entries = {e.key: e for e in manifest.tensors}
    # the manifest describes the global tensor: dim-1 shards give an N-D chunk grid
    assert entries["a"].shape == (16, 12) and entries["a"].chunk_shape == (8, 6)
    assert entries["f"].chunk_shape is None  # only dim 0 sharded: row blocks as before
    assert repo.verify("step-1").ok

    for world in (2, 3):
        reports = run(world, tmp_path, root, f"load{world}")
        for r in reports:  # each rank reads what overlaps its shard, not whole rows
            assert r["read"] <= 1.25 * r["needed"] + 4096 * 2, reports

    # a single process reads the multi-rank checkpoint as plain tensors
    state = repo.load("step-1")
    for k, (s, d, _p) in W.DT_SPECS.items():
        assert state[k].dtype == getattr(torch, d) and torch.equal(state[k], W.dt_truth(k, s, d))
    assert int(state["step"]) == 5
    overlapped = CheckpointStore(str(root) + "-overlap", create=False).load("step-1")
    assert all(torch.equal(overlapped[k], state[k]) for k in W.DT_SPECS)
    # ... and into a ckptstore.Shard (rows of dim 0) of a grid-chunked tensor
    part = Shard(torch.zeros(5, 12), offset=9, global_shape=(16, 12))
    repo.load("step-1", into={"a": part}, keys=["a"])
    assert torch.equal(part.data, W.dt_truth("a", (16, 12), "float32")[9:14])
    # the zarr view stays correct on an N-D chunk grid
    zarr = pytest.importorskip("zarr")
    import ckptstore

    group = zarr.open_group(store=ckptstore.zarr_store(repo, "step-1"), mode="r")
    got = np.asarray(group["b"][1:6, 2:5])
    np.testing.assert_array_equal(got, W.dt_truth("b", (7, 5), "float64")[1:6, 2:5].numpy())
    repo.close()


def test_an_unguarded_foreach_update_of_fsdp2_parameters_after_an_overlapped_save(tmp_path):
    # torch._foreach_* ops move no DTensor's version counter: the save committed a mix of
    # the call's values and the update's without an error
    spawn_ranks(W.ema_overlap_worker, 2, tmp_path, "ema",
                lambda init, out: (2, init, str(tmp_path / "repo"), out),
                lambda rank: f"ema-{rank}")


@pytest.mark.parametrize("how", ["manager", "dcp"])
def test_a_save_to_storage_the_ranks_do_not_share_fails_on_every_rank(tmp_path, how):
    # each rank's own folder, as a node-local path: rank 0 committed a checkpoint naming
    # blobs only the other ranks' folders held, every rank reported success, and latest()
    # named a checkpoint that could not load
    spawn_ranks(W.unshared_worker, 2, tmp_path, how,
                lambda init, out: (2, init, str(tmp_path / "nodes"), out, how),
                lambda rank: f"unshared-{rank}")


def test_ranks_restore_the_same_step_when_one_finds_its_part_damaged(tmp_path):
    # one rank raised IntegrityError while the other returned step 2: a restarted job met
    # the same damaged checkpoint every time; and restore(step=N) used rank 0's N everywhere
    root = tmp_path / "repo"

    def args(phase):
        return lambda init, out: (2, init, str(root), out, phase)

    spawn_ranks(W.agreed_restore_worker, 2, tmp_path, "save", args("save"),
                lambda rank: f"agreed-save-{rank}")
    repo = CheckpointStore(root)
    (entry,) = [t for t in repo.manifest("step-2").tensors if t.key == "w"]
    last = entry.chunks[-1]  # the last rows: only the last rank reads them
    path = root / "blobs" / last.blob[:2] / last.blob
    raw = bytearray(path.read_bytes())
    raw[last.offset] ^= 0xFF
    path.write_bytes(bytes(raw))
    spawn_ranks(W.agreed_restore_worker, 2, tmp_path, "restore", args("restore"),
                lambda rank: f"agreed-restore-{rank}")


def test_copies_of_a_tensor_every_rank_holds_must_be_the_same(tmp_path):
    # each chunk of a tensor held whole by every rank is written by one rank: copies that
    # differed were committed as a mix of the ranks' values, chunk by chunk
    spawn_ranks(W.different_copies_worker, 2, tmp_path, "copies",
                lambda init, out: (2, init, str(tmp_path / "repo"), out),
                lambda rank: f"copies-{rank}")


def test_values_that_are_not_tensors_must_have_the_same_keys_on_every_rank(tmp_path):
    # the checkpoint keeps rank 0's non-tensor values: a key only another rank held was
    # dropped without an error, and restore left that rank's value as it was
    spawn_ranks(W.value_keys_worker, 2, tmp_path, "keys",
                lambda init, out: (2, init, str(tmp_path / "repo"), out),
                lambda rank: f"keys-{rank}")
