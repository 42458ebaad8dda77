"""`ckpt import` of a real torch.distributed.checkpoint save of a raw `optimizer.state_dict()`:
DCP stores the integer parameter ids as strings; the import gives them back, so the optimizer
resumes with its Adam state (not silently without it)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptstore import CheckpointStore, FormatError
from ckptstore.cli import main
from ckptstore.tools.interop import import_checkpoint, restore_optimizer_keys


def _trained(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 6, generator=g)).pow(2).sum().backward()
        opt.step()
    return model, opt


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    assert not torch.distributed.is_initialized()  # one process, no process group
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.full((4, 6), 0.5)).pow(2).sum().backward()
    opt.step()


def test_adam_state_survives_a_dcp_import(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    model, opt = _trained(steps=3)
    _dcp_save({"optim": opt.state_dict(), "model": model.state_dict()}, tmp_path / "dcp")
    root = str(tmp_path / "repo")
    rc = main(["--json", "import", root, "opt", str(tmp_path / "dcp"), "--trust-pickle"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert json.loads(cap.out)["restored_int_keys"] == 1
    assert "integer parameter ids" in cap.err
    state = CheckpointStore(root).load("opt")
    assert sorted(state["optim"]["state"]) == [0, 1, 2, 3]
    assert state["optim"]["param_groups"][0]["params"] == [0, 1, 2, 3]

    model2, opt2 = _trained(steps=0)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optim"])
    params, params2 = list(model.parameters()), list(model2.parameters())
    assert len(opt2.state) == len(params) == 4
    for p, p2 in zip(params, params2):
        a, b = opt.state[p], opt2.state[p2]
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a[name], b[name]), name
            assert a[name].dtype == b[name].dtype
    _step(model, opt)
    _step(model2, opt2)
    for p, p2 in zip(params, params2):
        assert torch.equal(p, p2)  # the next step is the same step


def test_an_optimizer_saved_alone_and_one_never_stepped(tmp_path: Path) -> None:
    repo = CheckpointStore(tmp_path / "repo")
    _model, opt = _trained(steps=2)
    _dcp_save(opt.state_dict(), tmp_path / "root")  # the state_dict is the whole checkpoint
    import_checkpoint(repo, "root", tmp_path / "root", trust_pickle=True)
    assert sorted(repo.load("root")["state"]) == [0, 1, 2, 3]
    _model, fresh = _trained(steps=0)  # no state at all: DCP stores no "state" key
    _dcp_save({"optim": fresh.state_dict()}, tmp_path / "fresh")
    rep = import_checkpoint(repo, "fresh", tmp_path / "fresh", trust_pickle=True)
    assert rep.restored_int_keys == 1
    back = repo.load("fresh")["optim"]
    assert back["state"] == {}
    _model, again = _trained(steps=0)
    again.load_state_dict(back)


def test_keys_that_are_not_parameter_ids_are_refused(tmp_path: Path) -> None:
    repo = CheckpointStore(tmp_path / "repo")
    odd = {"optim": {"state": {"0": {"m": torch.ones(2)}, "7": {"m": torch.ones(2)}},
                     "param_groups": [{"lr": 0.1, "params": [0, 1]}]}}
    _dcp_save(odd, tmp_path / "odd")
    with pytest.raises(FormatError, match="optimizer state for '7'.*not one of the parameter"):
        import_checkpoint(repo, "odd", tmp_path / "odd", trust_pickle=True)
    assert repo.names() == []
    # optimizers keyed by parameter names (torch.distributed.checkpoint.state_dict) stay so
    named = {"state": {"0.weight": {"m": 1}}, "param_groups": [{"params": ["0.weight"]}]}
    assert restore_optimizer_keys(named) == 0 and list(named["state"]) == ["0.weight"]
