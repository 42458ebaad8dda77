"""ckptstore.dcp on 4 gloo ranks (issue 25 §5): real torch.distributed.checkpoint, no mocks.

* FSDP2 (`fully_shard`) model and Adam state from `get_state_dict`, saved by `dcp.save` on 4
  ranks, loaded on 2 (DCP reshards 8/8/8/6 rows into 15/15), bit for bit equal to what the 4
  ranks held and to a single-process load of the same checkpoint into a plain model.
* A 2-D ("dp", "tp") 2x2 mesh: tensor parallel (ColwiseParallel, RowwiseParallel) under
  FSDP2, and DTensors placed (Shard(0), Shard(1)) and the like, saved on 4 ranks and loaded
  onto a 1-D mesh of 3 ranks with other placements.
* `dcp.async_save` with DCP's process executor (`AsyncCheckpointerType.PROCESS`) on 2 ranks.

Workers: tests/dcp_multirank_worker.py (spawned by tests.helpers.spawn_ranks); one 4-rank
spawn saves the checkpoints of the first two tests (a module fixture)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckptstore.dcp as cdcp
from ckptstore import CheckpointStore
from tests import dcp_multirank_worker as W
from tests.ckptstore.dcp.test_backend import assert_no_pickle
from tests.helpers import spawn_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _spawn(fn: Any, world: int, tmp: Path, root: Path, tag: str, *extra: Any
           ) -> dict[str, Any]:
    """Run `fn` on `world` gloo ranks over the repository `root`; return the arrays rank 0
    wrote, by file stem."""
    spawn_ranks(fn, world, tmp, tag, lambda init, out: (world, init, str(root), out, *extra),
                lambda r: f"rank-{r}")
    return {p.stem: dict(np.load(p)) for p in (tmp / f"out-{tag}").glob("*.npz")}


@pytest.fixture(scope="module")
def saved_on_4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One spawn of 4 ranks saving both checkpoints: "fsdp-4" (FSDP2 on a 1-D mesh) and
    "mesh-2x2" (tensor parallel under FSDP2); {"root", "fsdp", "mesh2d": the arrays}."""
    tmp = tmp_path_factory.mktemp("multirank")
    root = tmp / "repo"
    out = _spawn(W.worker, 4, tmp, root, "save4", [("fsdp", "save"), ("mesh2d", "save")])
    return {"root": root, "fsdp": out["fsdp-saved"], "mesh2d": out["mesh2d-saved"]}


def _assert_arrays_equal(want: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> None:
    assert sorted(want) == sorted(got)
    for k in want:
        assert want[k].dtype == got[k].dtype and want[k].shape == got[k].shape, k
        assert want[k].tobytes() == got[k].tobytes(), k  # bit for bit


def _single_process_reference(root: Path, name: str) -> dict[str, np.ndarray]:
    """The checkpoint loaded by dcp.load in this process, without a process group, into a
    plain model and Adam of other values (get_state_dict / set_state_dict)."""
    model = W.plain_model(seed=21)
    opt = W.adam(model)
    W.train(model, opt, range(9, 10))
    msd, osd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": msd, "optim": osd, "step": 0}
    assert cdcp.load(state, root, name) == name
    assert state["step"] == W.STEPS
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd, osd = get_state_dict(model, opt)
    return W.full_states(msd, osd)


def test_fsdp2_saved_on_4_ranks_loaded_on_2(saved_on_4: dict[str, Any],
                                            tmp_path: Path) -> None:
    root, saved = saved_on_4["root"], saved_on_4["fsdp"]
    assert any(k.endswith("exp_avg_sq") for k in saved) and any(
        k.endswith(".step") for k in saved)
    loaded = _spawn(W.worker, 2, tmp_path, root, "load2", [("fsdp", "load")])["fsdp-loaded"]
    _assert_arrays_equal(saved, loaded)
    _assert_arrays_equal(saved, _single_process_reference(root, "fsdp-4"))
    with CheckpointStore(root) as repo:  # an ordinary checkpoint of the global tensors
        got = repo.load("fsdp-4")
        assert repo.manifest("fsdp-4").metadata["ranks"] == 4
        assert repo.verify("fsdp-4").ok
    assert got["model"]["0.weight"].shape == (W.HIDDEN, 16)
    assert np.array_equal(got["model"]["0.weight"].numpy(), saved["model.0.weight"])
    assert np.array_equal(got["optim"]["state"]["2.bias"]["exp_avg"].numpy(),
                          saved["optim.state.2.bias.exp_avg"])
    assert got["optim"]["param_groups"][0]["betas"] == (0.8, 0.95)
    assert_no_pickle(root)


def test_2d_mesh_saved_on_4_ranks_loaded_onto_a_1d_mesh_of_3(saved_on_4: dict[str, Any],
                                                              tmp_path: Path) -> None:
    root, saved = saved_on_4["root"], dict(saved_on_4["mesh2d"])
    placements = [str(p) for p in saved.pop("placements")]
    # FSDP2 over tensor parallelism: both dims of the mesh shard the weights
    assert all("Shard" in p and p.count(",") >= 1 for p in placements), placements
    loaded = _spawn(W.worker, 3, tmp_path, root, "load1d",
                    [("mesh2d", "load")])["mesh2d-loaded"]
    _assert_arrays_equal(saved, loaded)
    for name in W.EXTRAS:
        assert np.array_equal(saved[f"extra.{name}"], W.extra_truth(name).numpy()), name
    with CheckpointStore(root) as repo:
        got = repo.load("mesh-2x2", keys=["extra", "model"])
    for name in W.EXTRAS:
        assert torch.equal(got["extra"][name], W.extra_truth(name)), name
    assert np.array_equal(got["model"]["2.weight"].numpy(), saved["model.2.weight"])
    assert_no_pickle(root)


def test_async_save_with_the_process_executor_on_2_ranks(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    out = _spawn(W.async_process_worker, 2, tmp_path, root, "proc")
    # the first checkpoint holds the state at the call, not what the ranks changed after it
    _assert_arrays_equal(out["truth-1"], out["proc-1"])
    _assert_arrays_equal(out["truth-2"], out["proc-2"])
    assert not np.array_equal(out["truth-1"]["model.0.weight"],
                              out["truth-2"]["model.0.weight"])
    with CheckpointStore(root) as repo:
        assert sorted(repo.names()) == ["proc-1", "proc-2"]
        assert repo.verify("proc-1").ok and repo.verify("proc-2").ok
        # the second save, in the same background process, deduplicated against the first:
        # the optimizer state did not change, so its chunks are shared
        m1, m2 = repo.manifest("proc-1"), repo.manifest("proc-2")
        assert m2.parent == "proc-1"
        blobs = {e.key: {c.blob for c in e.chunks} for e in m1.tensors}
        shared = [e.key for e in m2.tensors if {c.blob for c in e.chunks} == blobs.get(e.key)]
        assert any("exp_avg" in k for k in shared), shared
    assert_no_pickle(root)
