"""`ckpt ls NEAR FAR` and `ckpt replicate NEAR FAR` on real folders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_ls_shows_tiers_and_replicate_copies_what_far_lacks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    near, far = str(tmp_path / "near"), str(tmp_path / "far")
    with ckptstore.CheckpointStore([near, far]) as repo:
        repo.save("a", {"x": np.arange(1000)})
        repo.wait_replicated()
        repo.save("b", {"x": np.arange(1000) + 1}, tiers=[0])
    code, doc = run(capsys, "ls", near, far)
    assert code == 0
    where = {c["name"]: c["tiers"] for c in doc["checkpoints"]}
    assert len(where["a"]) == 2 and len(where["b"]) == 1 and doc["tiers"][0] in where["b"]

    code, doc = run(capsys, "replicate", near, far)
    assert code == 0 and [d["name"] for d in doc["replicated"]] == ["b"]
    assert doc["replicated"][0]["blobs_sent"] == 1
    assert ckptstore.CheckpointStore(far, create=False).load("b")["x"][0] == 1
    code, doc = run(capsys, "replicate", near, far)  # nothing left: idempotent
    assert code == 0 and doc["replicated"] == []
    code, doc = run(capsys, "ls", near, far)
    assert all(len(c["tiers"]) == 2 for c in doc["checkpoints"])
    assert main(["replicate", near, str(tmp_path / "nowhere" / "x"), "--name", "zz"]) == 2


def test_replicate_reports_a_name_far_holds_for_another_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # FAR's step-1 held other values and replicate said FAR had everything (exit 0)
    near, far = str(tmp_path / "near"), str(tmp_path / "far")
    ckptstore.CheckpointStore(near).save("step-1", {"w": np.ones(3)})
    ckptstore.CheckpointStore(far).save("step-1", {"w": np.zeros(3)})
    ckptstore.CheckpointStore(near).save("step-2", {"w": np.ones(3) * 2})
    code, doc = run(capsys, "replicate", near, far)
    assert code == 1 and doc["conflicts"] == ["step-1"]
    assert [d["name"] for d in doc["replicated"]] == ["step-2"]
    assert ckptstore.CheckpointStore(far).load("step-1")["w"].tolist() == [0.0, 0.0, 0.0]
    code, doc = run(capsys, "replicate", near, far)  # step-2, copied by replicate: no conflict
    assert doc["conflicts"] == ["step-1"] and doc["replicated"] == []
