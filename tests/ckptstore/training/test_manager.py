"""CheckpointManager on one process: Stateful objects, plain state, retention, async, RNG."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore import CheckpointManager, CheckpointStore


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)
    return model, opt, sched


def step_fn(model, opt, sched, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean() + 0.01 * torch.rand(()).item()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def test_restore_returns_none_without_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path / "run")
    model, opt, sched = make()
    assert mgr.restore({"model": model, "optim": opt}) is None
    mgr.close()


@pytest.mark.parametrize("async_save", [False, True])
def test_exact_resume_with_stateful_objects_and_rng(tmp_path, async_save):
    model, opt, sched = make()
    torch.manual_seed(5)
    reference = [step_fn(model, opt, sched, s) for s in range(12)]

    model, opt, sched = make()
    torch.manual_seed(5)
    mgr = CheckpointManager(tmp_path / "run", async_save=async_save, keep_last=2)
    extra = {"seen": [], "epoch": 0}
    losses = []
    for s in range(7):
        losses.append(step_fn(model, opt, sched, s))
        extra["seen"].append(s)
        mgr.save(s + 1, {"model": model, "optim": opt, "sched": sched,
                         "rng": ckptstore.RNGState(), "extra": extra})
    mgr.close()
    assert mgr.steps() == [6, 7]

    model2, opt2, sched2 = make()
    torch.manual_seed(999)
    random.seed(1)
    np.random.seed(1)
    extra2 = {"seen": [], "epoch": -1}
    mgr2 = CheckpointManager(tmp_path / "run")
    ptr = model2[0].weight.data_ptr()
    step = mgr2.restore({"model": model2, "optim": opt2, "sched": sched2,
                         "rng": ckptstore.RNGState(), "extra": extra2})
    assert step == 7
    assert model2[0].weight.data_ptr() == ptr  # restored in place
    assert extra2 == {"seen": list(range(7)), "epoch": 0}
    rest = [step_fn(model2, opt2, sched2, s) for s in range(7, 12)]
    assert losses[:7] + rest == reference
    mgr2.close()


def test_rng_state_roundtrip(tmp_path):
    repo = CheckpointStore(tmp_path / "r")
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    repo.save("rng", {"rng": ckptstore.RNGState().state_dict()})
    expected = (random.random(), np.random.rand(), torch.rand(()).item(), random.gauss(0, 1))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    ckptstore.RNGState().load_state_dict(repo.load("rng")["rng"])
    assert (random.random(), np.random.rand(), torch.rand(()).item(),
            random.gauss(0, 1)) == expected


def test_rng_state_of_several_ranks_restored_in_one_process_is_left_alone(tmp_path):
    # rows of (world, ...) arrays, as a 2-rank save stores them: a raw TypeError before
    repo = CheckpointStore(tmp_path / "r")
    one = ckptstore.RNGState().state_dict()
    repo.save("rng", {"rng": {k: np.stack([np.asarray(v), np.asarray(v)]) for k, v in one.items()}})
    torch.manual_seed(9)
    expected = torch.rand(()).item()
    torch.manual_seed(9)
    ckptstore.RNGState().load_state_dict(repo.load("rng")["rng"])
    assert torch.rand(()).item() == expected  # the generators keep their state


def test_retention_keeps_last_and_every_and_frees_blobs(tmp_path):
    mgr = CheckpointManager(tmp_path / "run", keep_last=2, keep_every=4, chunk_bytes=1 << 16)
    w = torch.zeros(512, 128)
    for step in range(1, 10):
        w.fill_(float(step))  # every step new bytes
        mgr.save(step, {"w": w})
    assert mgr.steps() == [4, 8, 9]
    repo = mgr.repo
    referenced = set().union(*(repo.manifest(f"step-{s}").blob_digests() for s in (4, 8, 9)))
    stored = {info.key.rsplit("/", 1)[-1] for info in repo.store.list("blobs/")}
    assert stored == referenced  # nothing left over from dropped steps
    state = {"w": torch.zeros(512, 128)}
    assert mgr.restore(state) == 9 and float(state["w"][0, 0]) == 9.0
    assert mgr.restore(state, step=4) == 4 and float(state["w"][0, 0]) == 4.0
    mgr.close()


def test_retention_keeps_blobs_shared_with_kept_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path / "run", keep_last=1)
    frozen = torch.randn(400, 400)
    for step in range(3):
        mgr.save(step, {"frozen": frozen, "moving": torch.full((300, 300), float(step))})
    assert mgr.steps() == [2]
    assert mgr.repo.verify("step-2").ok
    mgr.close()


def test_async_errors_surface(tmp_path):
    mgr = CheckpointManager(tmp_path / "run", async_save=True)
    mgr.save(1, {"w": torch.ones(3)})
    mgr.wait()
    with pytest.raises(ckptstore.CheckpointExistsError):
        mgr.save(1, {"w": torch.ones(3)})
    with pytest.raises(TypeError, match="bad"):
        mgr.save(2, {"bad": object()})
    mgr.close()


def test_restore_of_a_plain_state_names_the_tensors_the_checkpoint_lacks(tmp_path):
    # a plain dict (get_state_dict style) with a tensor added since the save: restore
    # returned the step and that tensor kept its initial values
    mgr = CheckpointManager(tmp_path / "run")
    mgr.save(1, {"model": {"layer.weight": torch.ones(8, 4)}})
    state = {"model": {"layer.weight": torch.zeros(8, 4), "layer.bias": torch.full((8,), 7.0)}}
    with pytest.raises(ckptstore.KeyMismatchError, match="'model.layer.bias'"):
        mgr.restore(state)
    assert mgr.restore({"model": {"layer.weight": torch.zeros(8, 4)}}) == 1
    mgr.close()


def test_restore_of_a_module_whose_state_dict_hands_out_copies_reaches_its_weights(tmp_path):
    # a state-dict hook that clones (wrappers, modules keeping master weights elsewhere):
    # restore filled the copies in place, returned the step, and the weights never changed
    class Cloning(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

            def clone_all(_module, state, _prefix, _local):
                for key in list(state):
                    state[key] = state[key].detach().clone()

            self.register_state_dict_post_hook(clone_all)

    model = Cloning()
    mgr = CheckpointManager(tmp_path / "run")
    with torch.no_grad():
        model.lin.weight.fill_(1.0)
    mgr.save(1, {"model": model})
    with torch.no_grad():
        model.lin.weight.fill_(0.0)
    assert mgr.restore({"model": model}) == 1
    assert torch.equal(model.lin.weight, torch.ones(2, 2))
    mgr.close()


def test_restore_mismatch_is_clear(tmp_path):
    mgr = CheckpointManager(tmp_path / "run")
    model, opt, _ = make()
    mgr.save(1, {"model": model})
    other = torch.nn.Linear(3, 3)
    with pytest.raises(KeyError):
        mgr.restore({"model": other})
    with pytest.raises(KeyError, match="optim"):
        mgr.restore({"model": model, "optim": opt})
    mgr.close()
