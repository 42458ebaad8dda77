"""Overlapped async saves committed collectively by 2 ranks on gloo, and Shard leaves under
overlapped staging (issue 13)."""

from __future__ import annotations

import pytest
import torch

from ckptstore import CheckpointStore, Shard, SourceChangedError
from tests import overlap_dist_worker as worker
from tests.helpers import spawn_ranks

WORLD = 2


def run(fn, tmp_path, root, writer: str, tag: str) -> list[str]:
    return spawn_ranks(fn, WORLD, tmp_path, tag,
                       lambda init, out: (WORLD, init, str(root), out, writer),
                       lambda rank: f"rank-{rank}")


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_two_ranks_guarded_saves_hold_their_steps(tmp_path, writer):
    root = tmp_path / "run"
    run(worker.train_worker, tmp_path, root, writer, "train")
    repo = CheckpointStore(root, create=False)
    for step in (2, 4, 6, 8):
        name = f"step-{step}"
        table = repo.load(name, keys=["table"])["table"]
        assert torch.equal(table, worker.expected_table(step, WORLD)), name
        assert repo.manifest(name).metadata["world_size"] == WORLD
        assert repo.verify(name).ok
    repo.close()


def test_unguarded_shard_change_on_one_rank_fails_the_collective_save(tmp_path):
    root = tmp_path / "repo"
    reports = run(worker.change_worker, tmp_path, root, "thread", "change")
    for text in reports:
        _ok, committed, outcome = text.split("\n", 2)
        assert committed == "False"
        assert outcome.startswith("failed:") and "nothing committed" in outcome
        assert "rank 1" in outcome and "SourceChangedError" in outcome and "table" in outcome
    repo = CheckpointStore(root, create=False)
    assert [c.name for c in repo.list()] == ["b"]
    table = repo.load("b", keys=["table"])["table"]
    assert torch.equal(table[:256], torch.zeros(256, 64))
    assert torch.equal(table[256:], torch.full((256, 64), 2.0))
    repo.close()


def test_shard_leaves_in_one_process(tmp_path):
    repo = CheckpointStore(tmp_path / "r", chunk_bytes=16 * 1024)
    data = torch.randn(64, 128)  # 32 KiB: 2 chunks
    expected = data.clone()
    state = {"table": Shard(data, 0, (64, 128))}  # every row: an ordinary tensor
    handle = repo.save_async("a", state, staging="overlap", max_host_bytes=16 * 1024)
    handle.wait()
    data.add_(1.0)  # after the save: not in it
    assert torch.equal(repo.load("a")["table"], expected)
    # a change to the Shard's tensor before it is staged is seen through its version counter
    with pytest.raises(SourceChangedError, match="table"):
        handle = repo.save_async("b", {"big": torch.randn(1024, 1024), **state},
                                 staging="overlap", max_host_bytes=16 * 1024)
        data.add_(1.0)
        handle.wait()
    assert not repo.exists("b")
    # a Shard of some rows only cannot be saved by one process
    with pytest.raises(TypeError, match="some rows"):
        repo.save_async("c", {"t": Shard(torch.ones(2, 4), 0, (4, 4))},
                        staging="overlap").wait()
    repo.close()
