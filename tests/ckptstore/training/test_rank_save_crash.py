"""A rank of a collective save by rank plans killed (SIGKILL) at each step: the other ranks
fail instead of committing, the earlier checkpoint stays whole, and a new job on fresh
processes saves again over what the last one left (training/rank_save.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from tests import rank_save_worker

ROOT = Path(__file__).resolve().parents[3]
WORLD = 3


def _run(tmp_path: Path, tag: str, root: Path, kill_rank: int, point: str
         ) -> list[tuple[int, list[str]]]:
    init = tmp_path / f"pg-{tag}"
    code = ("import sys; from tests.rank_save_worker import crash_main; "
            "crash_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], "
            "int(sys.argv[5]), sys.argv[6])")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(WORLD), str(init),
                               str(root), str(kill_rank), point], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for r in range(WORLD)]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=240)
        out.append((proc.returncode, stdout.split("\n") + [stderr[-2000:]]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kill_rank,point", [(2, "written"), (1, "built"),
                                             (0, "before-root")])
def test_a_rank_killed_mid_save_commits_nothing_and_a_new_job_saves(tmp_path, kill_rank,
                                                                    point):
    root = tmp_path / "repo"
    results = _run(tmp_path, "crash", root, kill_rank, point)
    for rank, (code, lines) in enumerate(results):
        assert "saved 1" in lines, (rank, lines)
        if rank == kill_rank:
            assert code == -signal.SIGKILL and "dying" in lines, (rank, code, lines)
        else:
            # a CkptStoreError naming the failed exchange, not gloo's bare RuntimeError
            assert code == 0 and "failed 2 CollectiveError" in lines, (rank, lines)
    repo = CheckpointStore(root, create=False)
    assert [c.name for c in repo.list()] == ["step-1"]
    truth = rank_save_worker.truth()
    assert torch.equal(repo.load("step-1")["model"]["emb"], truth["emb"])
    assert repo.verify("step-1").ok
    repo.close()
    if point != "before-root":  # once is enough (each job costs seconds of imports)
        return
    # a new job (fresh processes: no rank memory) saves step 2 over what the dead one left
    again = _run(tmp_path, "again", root, -1, "none")
    assert all(code == 0 and "saved 2" in lines for code, lines in again), again
    repo = CheckpointStore(root, create=False)
    assert torch.equal(repo.load("step-2")["model"]["emb"], truth["emb"] + 5.0)
    assert repo.verify("step-2").ok
