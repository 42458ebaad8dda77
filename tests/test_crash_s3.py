"""The crash test of test_crash.py against S3: a writer saving to moto and to SeaweedFS (a real
object store) is killed with SIGKILL mid-save; every listed checkpoint restores whole, a rerun
continues, and gc keeps every referenced blob."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.maintenance.checks import TEMP_MIN_AGE

from .test_crash import WRITER, expected


@pytest.mark.parametrize("delay", [0.2])
def test_sigkill_mid_save_to_s3_leaves_only_whole_checkpoints(s3_any_uri: str, s3_endpoint: str,
                                                               delay: float) -> None:
    env = {**os.environ, "AWS_ENDPOINT_URL": s3_endpoint}
    for run in range(2):  # the second run starts on what the first one's kill left
        proc = subprocess.Popen([sys.executable, "-c", WRITER, s3_any_uri], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()
            assert first.strip().isdigit(), proc.stderr.read() if proc.stderr else first
            time.sleep(delay * (run + 1))
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
    repo = CheckpointStore(s3_any_uri, endpoint_url=s3_endpoint, create=False)
    infos = repo.list()
    assert len(infos) >= 1  # odd steps are save_async: printed before their commit
    for info in infos:
        step = info.metadata["step"]
        assert info.name == f"step-{step:04d}"
        state = repo.load(info.name)
        assert torch.equal(state["w"], expected(step)), info.name
        assert all(torch.equal(s, torch.full((7,), float(step))) for s in state["small"])
    names = {c.name for c in infos}
    repo.gc(grace_seconds=0, now=time.time() + 2 * TEMP_MIN_AGE)
    assert {c.name for c in repo.list()} == names
    for name in names:
        assert repo.verify(name).ok
    repo.close()
