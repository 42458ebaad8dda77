"""The crash test of test_crash.py against S3: a writer saving to moto and to SeaweedFS (a real
object store) is killed with SIGKILL mid-save; every listed checkpoint restores whole, a rerun
continues, and gc keeps every referenced blob, also those of a commit that lands after the
kill."""

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
from tests.campaigns.test_crash import WRITER, expected
from tests.helpers import reap

pytestmark = pytest.mark.slow  # minutes of subprocesses: left out of the quick loop

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
            err = reap(proc, 60)
        assert proc.returncode == -signal.SIGKILL, err
    # the killed writer's requests reach a server on 127.0.0.1 within milliseconds: gc waits
    # 3 s for them to land here (15 s by default, for remote servers) before it lists
    repo = CheckpointStore(s3_any_uri, endpoint_url=s3_endpoint, create=False,
                           in_flight_settle=3.0)
    infos = repo.list()
    assert len(infos) >= 1  # odd steps are save_async: printed before their commit
    for info in infos:
        step = info.metadata["step"]
        assert info.name == f"step-{step:04d}"
        state = repo.load(info.name)
        assert torch.equal(state["w"], expected(step)), info.name
        assert all(torch.equal(s, torch.full((7,), float(step))) for s in state["small"])
    names = {c.name for c in infos}
    # The killed writer's last commit may still be on its way (its bytes were on the wire): gc
    # waits the store's in_flight_settle for it before listing, so one more checkpoint may
    # appear, and it too must be whole after a gc that deletes every unreferenced blob.
    repo.gc(grace_seconds=0, now=time.time() + 2 * TEMP_MIN_AGE)
    after = repo.list()
    assert names <= {c.name for c in after}
    assert len(after) <= len(names) + 1
    for info in after:
        assert repo.verify(info.name).ok, info.name
        assert torch.equal(repo.load(info.name)["w"], expected(info.metadata["step"]))
    repo.close()
