"""ckptstore.accelerate with a real Accelerator(cpu=True): SIGKILL and resume in new processes
(a new Accelerator each time) is bit for bit an uninterrupted run, no file but the
repository's objects is written, and what is not supported is refused clearly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstore
from ckptstore.accelerate import load_state, save_state
from tests.helpers import reap

pytestmark = pytest.mark.slow  # minutes of subprocesses: left out of the quick loop

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "accelerate_worker.py"
STEPS, EVERY = 14, 4  # 6 batches an epoch: saves mid-epoch (4, 8) and at an epoch's end (12)


def run(repo: Path, project: Path, hold: int | None, async_save: bool) -> dict[str, Any]:
    args = [sys.executable, str(WORKER), "--repo", str(repo), "--project", str(project),
            "--steps", str(STEPS), "--every", str(EVERY)]
    args += ["--hold", str(hold)] if hold is not None else []
    args += ["--async"] if async_save else []
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    out: dict[str, Any] = {"loss": {}, "saved": {}}
    assert proc.stdout is not None
    for line in proc.stdout:
        p = line.split()
        if p[0] in ("loss", "saved"):
            out[p[0]][int(p[1])] = p[2]
        elif p[0] in ("start", "load", "final", "hold"):
            out[p[0]] = int(p[1]) if p[0] in ("start", "hold") else p[1]
        if p[0] == "hold":
            os.kill(proc.pid, signal.SIGKILL)
            break
    err = reap(proc, 120)
    assert proc.returncode == (-signal.SIGKILL if hold is not None else 0), err
    return out


def test_sigkill_and_resume_is_bit_exact_and_writes_no_other_file(tmp_path: Path) -> None:
    ref = run(tmp_path / "ref", tmp_path / "ref-project", None, async_save=False)
    assert sorted(ref["loss"]) == list(range(1, STEPS + 1))
    repo, project = tmp_path / "run" / "repo", tmp_path / "run" / "project"
    # killed right after the async save of 4 was handed off and 3 steps on (mid-epoch)
    first = run(repo, project, 7, async_save=True)
    # killed right after the synchronous save of 12, the last batch of an epoch
    second = run(repo, project, 12, async_save=False)
    assert second["start"] in (0, 4)
    third = run(repo, project, None, async_save=True)
    assert third["start"] == 12
    saved = {**first["saved"], **second["saved"]}
    for got in (second, third):
        if got["start"]:
            assert got["load"] == saved[got["start"]]  # restored exactly what was saved
    for got in (first, second, third):
        for step, loss in got["loss"].items():
            assert loss == ref["loss"][step], step
        for step, d in got["saved"].items():
            assert d == ref["saved"][step], step
    assert third["final"] == ref["final"]
    files = [f for f in (tmp_path / "run").rglob("*") if f.is_file()]
    assert files and all(f.is_relative_to(repo) for f in files), files
    assert not [f for f in files if f.suffix in (".pkl", ".bin", ".safetensors", ".pt")]
    assert {f.relative_to(repo).parts[0] for f in files} <= {
        "ckptstore.json", "blobs", "checkpoints", "locks"}
    assert ckptstore.CheckpointManager(repo).steps() == [4, 8, 12]  # keep_last=3


# ---------------------------------------------------------------------------- in process
def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.fixture
def fresh_state() -> Iterator[None]:
    """accelerate's process-wide state, reset before and after (another test may have set
    it up otherwise)."""
    _reset_accelerate()
    yield
    _reset_accelerate()


def prepared(project: Path, **config: Any) -> tuple[Any, ...]:
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import ProjectConfiguration

    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(project), **config), dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True, use_seedable_sampler=True))
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3)),
                                         batch_size=2, shuffle=True)
    return acc, *acc.prepare(model, opt, loader)


def test_automatic_naming_total_limit_and_in_place_restore(tmp_path: Path,
                                                          fresh_state: None) -> None:
    acc, model, opt, loader = prepared(tmp_path / "p", automatic_checkpoint_naming=True,
                                       total_limit=2)
    assert load_state(acc) is None  # nothing saved yet: a fresh start
    for _ in range(3):
        (x,) = next(iter(loader))
        acc.backward(model(x).sum())
        opt.step()
        save_state(acc)  # checkpoints 0, 1, 2 in <project>/checkpoints
    repo = tmp_path / "p" / "checkpoints"
    assert ckptstore.CheckpointManager(repo).steps() == [1, 2]
    assert acc.save_iteration == 3
    weight = model.weight.detach().clone()
    momentum = opt.optimizer.state[model.weight]["momentum_buffer"].clone()
    with torch.no_grad():
        model.weight.zero_()
    opt.optimizer.state.clear()
    acc.project_configuration.iteration = 0
    assert load_state(acc) == 2
    assert torch.equal(model.weight, weight)
    assert torch.equal(opt.optimizer.state[model.weight]["momentum_buffer"], momentum)
    assert acc.save_iteration == 3
    assert load_state(acc, repo, step=1) == 1
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        load_state(acc, repo, step=0)  # dropped by total_limit


def test_refusals(tmp_path: Path, fresh_state: None) -> None:
    acc, model, opt, loader = prepared(tmp_path / "p")
    with pytest.raises(ValueError, match="automatic_checkpoint_naming"):
        save_state(acc)
    store = ckptstore.CheckpointStore(tmp_path / "repo")
    save_state(acc, store, 5)
    store.save("foreign", {"x": torch.zeros(1)})
    handle = acc.register_save_state_pre_hook(lambda models, weights, folder: None)
    with pytest.raises(ValueError, match="pre-hooks"):
        save_state(acc, store, 6)
    handle.remove()
    # another layout: a second registered object
    acc.register_for_checkpointing(torch.optim.lr_scheduler.StepLR(opt.optimizer, 2))
    with pytest.raises(ckptstore.KeyMismatchError, match="'custom': \\(0, 1\\)"):
        load_state(acc, store)
    acc._custom_objects.clear()
    assert load_state(acc, store) == 5
    ckptstore.CheckpointManager(store).save(7, {"x": torch.zeros(1)})
    with pytest.raises(ckptstore.KeyMismatchError, match="not saved by ckptstore.accelerate"):
        load_state(acc, store, step=7)
    # a checkpoint of a stateful dataloader into a plain one
    loader.use_stateful_dataloader = False
    with pytest.raises(ckptstore.KeyMismatchError, match="use_stateful_dataloader=True"):
        load_state(acc, store, step=5)
    loader.use_stateful_dataloader = True
    from accelerate.utils import DistributedType

    acc.state.distributed_type = DistributedType.DEEPSPEED
    with pytest.raises(NotImplementedError, match="DistributedType.DEEPSPEED"):
        save_state(acc, store, 8)
    acc.state.distributed_type = DistributedType.NO
    store.close()


def test_unsupported_values_are_named(tmp_path: Path, fresh_state: None) -> None:
    class Odd:
        def state_dict(self) -> dict[str, Any]:
            return {"when": object()}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    acc, *_ = prepared(tmp_path / "p")
    acc.register_for_checkpointing(Odd())
    with pytest.raises(ckptstore.UnsupportedTypeError, match="custom_0.when"):
        save_state(acc, str(tmp_path / "repo"), 1)
    assert ckptstore.CheckpointManager(tmp_path / "repo").steps() == []


def test_overlapped_async_saves_guard_the_unwrapped_optimizer(tmp_path: Path,
                                                              fresh_state: None) -> None:
    """save_state hands CheckpointManager the torch optimizer inside AcceleratedOptimizer, so
    staging="overlap" guards it (the manager's known AttributeError with an
    AcceleratedOptimizer in the state does not arise) and every save holds its own step."""
    acc, model, opt, loader = prepared(tmp_path / "p")
    mgr = ckptstore.CheckpointManager(tmp_path / "repo", async_save=True, staging="overlap")
    weights = {}
    for step in range(1, 4):
        (x,) = next(iter(loader))
        acc.backward(model(x).sum())
        opt.step()  # waits, if it must, until the save in flight has copied what it changes
        opt.zero_grad()
        assert isinstance(save_state(acc, mgr, step), ckptstore.SaveHandle)
        weights[step] = model.weight.detach().clone()
    mgr.close()
    for step in (1, 3):
        with torch.no_grad():
            model.weight.zero_()
        assert load_state(acc, str(tmp_path / "repo"), step=step) == step
        assert torch.equal(model.weight, weights[step])


def test_a_save_after_an_epochs_loop_resumes_the_next_epoch_not_the_one_after(
        tmp_path: Path, fresh_state: None) -> None:
    # accelerate's checkpointing_steps="epoch" saves after the loop, when the loader has
    # advanced `iteration` already: the state added one more, and the resume skipped an
    # epoch's data order
    torch.manual_seed(0)  # the same data in both runs
    acc, _model, _opt, loader = prepared(tmp_path / "p")
    orders = []
    for _epoch in range(3):
        orders.append([x.flatten().tolist() for (x,) in loader])
        if _epoch == 0:
            mgr = ckptstore.CheckpointManager(tmp_path / "repo")
            save_state(acc, mgr, 1)
            mgr.close()
    _reset_accelerate()
    torch.manual_seed(0)
    acc, _model, _opt, loader = prepared(tmp_path / "p")
    mgr = ckptstore.CheckpointManager(tmp_path / "repo")
    assert load_state(acc, mgr) == 1
    mgr.close()
    assert [x.flatten().tolist() for (x,) in loader] == orders[1]
