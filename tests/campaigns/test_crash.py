"""kill -9 at any instant leaves every earlier checkpoint restorable and no half checkpoint
listed. The writer is a real subprocess killed with SIGKILL mid-save."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.maintenance.checks import TEMP_MIN_AGE
from tests.helpers import reap

WRITER = textwrap.dedent("""
    import sys, torch, ckptstore
    repo = ckptstore.CheckpointStore(sys.argv[1], chunk_bytes=1 << 20)
    start = len(repo.list())
    for step in range(start, start + 1000):
        g = torch.Generator().manual_seed(step)
        state = {"w": torch.randn(2048, 1024, generator=g), "step": step,
                 "small": [torch.full((7,), float(step)) for _ in range(30)]}
        save = repo.save_async if step % 2 else repo.save
        h = save(f"step-{step:04d}", state, metadata={"step": step})
        print(step, flush=True)
""")


def expected(step: int) -> torch.Tensor:
    return torch.randn(2048, 1024, generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("delay", [0.0, 0.03, 0.11, 0.27, 0.5])
def test_sigkill_mid_save_leaves_only_whole_checkpoints(tmp_path, delay):
    root = tmp_path / "repo"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        # wait until the first checkpoint is committed, then kill at an arbitrary later point
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.strip() == "0", proc.stderr.read() if proc.stderr else first
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        err = reap(proc, 30)
    assert proc.returncode == -signal.SIGKILL, err
    repo = CheckpointStore(root)
    assert len(repo.list()) >= 1
    for info in repo.list():
        step = info.metadata["step"]
        state = repo.load(info.name)
        assert torch.equal(state["w"], expected(step)), info.name
        assert state["step"] == step
        assert all(torch.equal(s, torch.full((7,), float(step))) for s in state["small"])
    # a rerun continues without tripping over leftovers, and gc cleans what the kill left
    names = {c.name for c in repo.list()}
    report = repo.gc(grace_seconds=0, now=time.time() + 2 * TEMP_MIN_AGE)
    assert {c.name for c in repo.list()} == names
    for name in names:
        assert repo.verify(name).ok
    leftovers = [p for p in root.rglob(".tmp-*")]
    assert not leftovers, leftovers
    assert report.deleted_blobs >= 0
