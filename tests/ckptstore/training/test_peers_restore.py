"""Peer-replica restores that cannot simply restore: restarts on more or fewer ranks, a rank
that lost everything, damaged peer copies and manifests, a peer that dies mid-transfer.
Every rank is its own process (tests/peer_worker.py) on one gloo group; every restart must
restore one step that every rank obtained whole, or fail on every rank with the same clear
error in bounded time, and never let retention delete the history it could not restore."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tests.peer_worker import run_job

pytestmark = pytest.mark.slow  # minutes of subprocesses: left out of the quick loop

def errors(results: list[dict[str, Any] | None]) -> list[Any]:
    return [None if r is None else r["error"] for r in results]


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 3 and 5 saved by a 2-rank job (every step on the node, its peer and far)."""
    root = tmp_path_factory.mktemp("two")
    results = run_job(2, root, {"save": [3, 5]})
    assert errors(results) == [None, None]
    return root


def copy_of(saved: Path, tmp_path: Path) -> Path:
    root = tmp_path / "job"
    shutil.copytree(saved, root, ignore=shutil.ignore_patterns("out-*"))
    return root


def test_a_restart_on_more_ranks_refuses_on_every_rank_and_fresh_ok_keeps_the_history(
        saved_on_two: Path, tmp_path: Path) -> None:
    root = copy_of(saved_on_two, tmp_path)
    results = run_job(3, root, {"restore": {}})  # used to return None on every rank
    errs = errors(results)
    assert all(e is not None and e[0] == "UnrestorableCheckpointError" for e in errs), errs
    assert len({e[1] for e in errs}) == 1  # the same message on every rank
    assert "saved by 2 rank(s) and this job has 3" in errs[0][1]
    # starting over is a decision; the old history survives the new run's retention
    results = run_job(3, root, {"restore": {"fresh_ok": True}, "save": [10, 11, 12]})
    assert errors(results) == [None, None, None]
    for rank in (0, 1):
        assert {"step-3", "step-5", "step-11", "step-12"} <= set(results[rank]["names"])
        assert any("starting over" in w for w in results[rank]["warnings"])
    assert results[2]["names"] == ["step-11", "step-12"]


def test_a_restart_on_fewer_ranks_refuses_instead_of_dropping_a_rank(tmp_path: Path) -> None:
    root = tmp_path / "three"
    assert errors(run_job(3, root, {"save": [3]})) == [None] * 3
    results = run_job(2, root, {"restore": {}})  # used to restore ranks 0, 1 and drop 2
    errs = errors(results)
    assert all(e is not None and e[0] == "UnrestorableCheckpointError" for e in errs), errs
    assert "saved by 3 rank(s) and this job has 2" in errs[0][1]


def test_a_rank_that_lost_node_peer_copy_and_far_folder_fails_every_rank(
        saved_on_two: Path, tmp_path: Path) -> None:
    root = copy_of(saved_on_two, tmp_path)
    shutil.rmtree(root / "node1")
    shutil.rmtree(root / "node0" / "peers" / "rank-1")
    shutil.rmtree(root / "far" / "1")
    errs = errors(run_job(2, root, {"restore": {}, "save": [6, 7, 8]}))
    assert all(e is not None and e[0] == "UnrestorableCheckpointError" for e in errs), errs
    assert "rank(s) 1 can obtain no checkpoint" in errs[0][1]
    assert (root / "node0" / "checkpoints" / "step-3.json").exists()  # nothing retained away


@pytest.mark.parametrize("damage", ["missing-blob", "damaged-manifest"])
def test_a_damaged_peer_copy_falls_back_to_the_far_tier(saved_on_two: Path, tmp_path: Path,
                                                         damage: str) -> None:
    root = copy_of(saved_on_two, tmp_path)
    shutil.rmtree(root / "node1")  # rank 1's node is gone; its peer copy is damaged
    copy = root / "node0" / "peers" / "rank-1"
    if damage == "missing-blob":
        blob = next(p for p in (copy / "blobs").rglob("*") if p.is_file())
        blob.unlink()
    else:
        manifest = copy / "checkpoints" / "step-5.json"
        manifest.write_bytes(manifest.read_bytes()[:-40])
    results = run_job(2, root, {"restore": {}})
    assert errors(results) == [None, None]  # used to fail on both ranks
    assert [r["restored"] for r in results if r] == [5, 5]  # rank 1's far copy


def test_a_rank_whose_newest_manifest_is_damaged_makes_every_rank_take_an_older_step(
        saved_on_two: Path, tmp_path: Path) -> None:
    root = copy_of(saved_on_two, tmp_path)
    for where in (root / "node0", root / "far" / "0", root / "node1" / "peers" / "rank-0"):
        manifest = where / "checkpoints" / "step-5.json"
        manifest.write_bytes(manifest.read_bytes()[:-40])
    results = run_job(2, root, {"restore": {}})
    assert errors(results) == [None, None]
    assert [r["restored"] for r in results if r] == [3, 3]  # both ranks, the same step


def test_a_peer_that_dies_mid_transfer_does_not_hold_the_others(saved_on_two: Path,
                                                                tmp_path: Path) -> None:
    root = copy_of(saved_on_two, tmp_path)
    shutil.rmtree(root / "node1")  # rank 1 needs rank 0's copy; rank 0 dies sending it
    t0 = time.monotonic()
    results = run_job(2, root, [{"restore": {}, "die_when_sending": True, "peer_timeout": 5},
                                {"restore": {}, "peer_timeout": 5}], timeout=90)
    assert results[0] is None  # killed
    survivor = results[1]
    assert survivor is not None and survivor["error"][0] == "UnrestorableCheckpointError"
    assert any("rank 0" in w for w in survivor["warnings"]), survivor["warnings"]
    assert time.monotonic() - t0 < 60  # not the process group's 10 minutes
