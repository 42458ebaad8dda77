"""End to end over tiers: examples/train.py with a local tier 0 and moto S3 as the far tier,
killed with SIGKILL, its node-local folder deleted, resumes from the far tier with losses bit
for bit those of an uninterrupted run."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ckptstore
from tests.campaigns.test_train_resume import SCRIPT, losses_of
from tests.helpers import reap

STEPS, EVERY = 20, 4



pytestmark = pytest.mark.slow  # minutes of subprocesses: left out of the quick loop

def launch(run: Path, data: Path, extra: list[str]) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--run", str(run), "--data", str(data),
         "--steps", str(STEPS), "--every", str(EVERY), "--batch", "8",
         "--extra-rows", "2000", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen[str]) -> list[str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return [line.strip() for line in out.splitlines()]


def test_sigkill_lose_node_folder_resume_from_far(tmp_path: Path, s3_uri: str,
                                                 moto_endpoint: str) -> None:
    data = tmp_path / "data"
    reference = losses_of(finish(launch(tmp_path / "ref", data, [])))

    near = tmp_path / "node0"
    tiers = ["--far", s3_uri, "--endpoint-url", moto_endpoint, "--far-every", "2"]
    proc = launch(near, data, [*tiers, "--hold-after", "saving 16"])
    seen: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line.strip())
        if line.startswith("saving 16"):
            break
    far = ckptstore.CheckpointStore(s3_uri, endpoint_url=moto_endpoint, create=False)
    deadline = time.monotonic() + 30
    while "step-12" not in far.names() and time.monotonic() < deadline:
        time.sleep(0.1)  # saves 1, 3, 5 (steps 4, 12, 20) go far: wait for step 12's copy
    os.kill(proc.pid, signal.SIGKILL)
    err = reap(proc, 30)
    assert proc.returncode == -signal.SIGKILL, err
    assert sorted(far.names()) == ["step-12", "step-4"]  # every 2nd save went far
    shutil.rmtree(near)  # the node is gone with its checkpoints (16 was only there)

    lines = finish(launch(near, data, tiers))
    assert lines[0] == "start 12"
    assert lines[1].startswith("restored from") and s3_uri.split("/")[2] in lines[1]
    got = losses_of(seen + lines)
    assert sorted(got) == sorted(reference)
    for step, values in got.items():
        assert all(v == reference[step][0] for v in values), (step, values, reference[step])
    assert sorted(far.names()) == ["step-12", "step-20", "step-4"]
