"""End to end: examples/train.py killed with SIGKILL at several points (one of them while an
async save is being written) resumes with losses bit for bit those of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import reap

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train.py"
STEPS, EVERY = 24, 4


def launch(run: Path, data: Path, hold_after: str | None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    hold = ["--hold-after", hold_after] if hold_after else []
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--run", str(run), "--data", str(data),
         "--steps", str(STEPS), "--every", str(EVERY), "--batch", "8",
         "--extra-rows", "20000", *hold],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def losses_of(lines: list[str]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 4 and parts[0] == "step":
            out.setdefault(int(parts[1]), []).append(parts[3])
    return out


def wait_committed(run: Path, name: str, timeout: float = 120.0) -> None:
    """Wait until checkpoint `name` of the run is committed (read from the outside, as a
    restarted process would find it)."""
    import ckptstore

    deadline = time.monotonic() + timeout
    while name not in {c.name for c in ckptstore.CheckpointStore(run, create=False).list()}:
        assert time.monotonic() < deadline, f"{name} was not committed within {timeout} s"
        time.sleep(0.05)


def run_until(run: Path, data: Path, kill_after: str | None,
              committed: str | None = None) -> list[str]:
    """Run the script; SIGKILL it right after it prints `kill_after` (None: to the end). The
    script holds after printing that line, so the kill lands exactly there; after a `saving`
    line its async save (about 32 MB) is still being written when the kill lands. With
    `committed`: the kill waits until that checkpoint is committed (an async save's commit
    may trail the steps by more than a step on a loaded machine)."""
    proc = launch(run, data, kill_after)
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.strip())
        if kill_after is not None and (line.strip() == kill_after
                                       or line.startswith(kill_after + " ")):
            if committed is not None:
                wait_committed(run, committed)
            os.kill(proc.pid, signal.SIGKILL)
            break
    err = reap(proc, 120)
    if kill_after is None:
        assert proc.returncode == 0, err
        assert lines[-1] == "done"
    else:
        assert proc.returncode == -signal.SIGKILL, (
            f"exited {proc.returncode} before the kill: {err}")
    return lines


@pytest.mark.slow
def test_sigkill_and_resume_is_bit_exact(tmp_path):
    data = tmp_path / "data"
    reference = losses_of(run_until(tmp_path / "ref", data, None))
    assert sorted(reference) == list(range(1, STEPS + 1))

    run = tmp_path / "run"
    seen: list[str] = []
    # mid-epoch between saves; right after an async save was handed off (its write is in
    # flight when the kill lands); just after a resume; then run to completion
    for point, committed in [("step 6", "step-4"), ("saving 8", None), ("step 13", None),
                             ("saving 20", None), (None, None)]:
        lines = run_until(run, data, point, committed)
        assert lines[0].startswith("start "), lines[:3]
        seen += lines
    starts = [int(line.split()[1]) for line in seen if line.startswith("start ")]
    assert starts[0] == 0 and starts[1] == 4  # step 6 killed: resumes from the save at 4
    got = losses_of(seen)
    assert sorted(got) == sorted(reference)
    for step, values in got.items():
        assert all(v == reference[step][0] for v in values), (step, values, reference[step])
    assert any(len(v) > 1 for v in got.values())  # some steps really were redone
