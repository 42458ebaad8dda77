"""Space that stays reclaimable: a save copies the few small arrays it would reuse from a mostly
dead pack into its own pack, so retention + gc can reclaim old packs, and a long run with
retention stays within a fixed factor of its live size."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from ckptstore import CheckpointStore
from ckptstore.cli import main
from ckptstore.layout import BLOB_PREFIX
from ckptstore.maintenance.checks import MIN_BLOB_AGE, TEMP_MIN_AGE
from ckptstore.pipeline import writer
from ckptstore.tools import inspection

N = 24  # small arrays (packed together); one more of them freezes at every save
M = 8  # small arrays that change at every save
KEEP = 3


def state(step: int) -> dict[str, np.ndarray]:
    """Array p<i> changes at every step until step i, then never again: each save leaves one
    more member behind in its pack that every later checkpoint still uses. The q arrays
    change at every step (as trained weights do)."""
    frozen = {f"p{i:02d}": np.full(1024, float(min(step, i)), dtype=np.float32)
              for i in range(N)}
    return {**frozen, **{f"q{j}": np.full(1024, 1e6 + step * M + j, dtype=np.float32)
                         for j in range(M)}}


def long_run(root: Path, saves: int) -> tuple[int, int, CheckpointStore]:
    """`saves` saves with keep-last-KEEP retention and gc after each; (blob bytes, live)."""
    repo = CheckpointStore(root)
    later = time.time() + 2 * max(MIN_BLOB_AGE, TEMP_MIN_AGE)
    for step in range(saves):
        repo.save(f"s{step:03d}", state(step))
        for old in repo.history()[:-KEEP]:
            repo.delete(old)
        repo.gc(grace_seconds=0, now=later)
    stored = sum(info.size for info in repo.store.list(BLOB_PREFIX))
    live = inspection.live_bytes([repo.manifest(n) for n in repo.history()])
    return stored, live, repo


def test_long_run_with_retention_stays_within_a_fixed_factor_of_live(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stored, live, repo = long_run(tmp_path / "repo", 40)
    assert repo.history() == ["s037", "s038", "s039"]
    for name in repo.names():  # every kept checkpoint whole and right
        assert repo.verify(name).ok
        step = int(name[1:])
        got = repo.load(name)
        assert all(np.array_equal(got[k], v) for k, v in state(step).items())
    assert stored <= 2 * live, (stored, live)
    assert main(["--json", "du", str(tmp_path / "repo")]) == 0
    totals = json.loads(capsys.readouterr().out)["totals"]
    assert (totals["live_bytes"], totals["blob_bytes"]) == (live, stored)


def test_without_reclaim_old_packs_pile_up(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run with the rewrite disabled: the test above can tell the difference."""
    monkeypatch.setattr(writer, "RECLAIM_LIVE_FRACTION", 0.0)
    stored, live, _repo = long_run(tmp_path / "repo", 40)
    assert stored > 5 * live, (stored, live)  # 10.8x here, against 1.5x with it


def test_a_mostly_live_pack_is_reused_not_copied(tmp_path: Path) -> None:
    repo = CheckpointStore(tmp_path / "repo")
    base = {f"p{i:02d}": np.full(1024, float(i), dtype=np.float32) for i in range(10)}
    repo.save("a", base)
    changed = dict(base, p00=np.full(1024, -1.0, dtype=np.float32))  # 9 of 10 members unchanged
    info = repo.save("b", changed)
    assert info.written_bytes == 4096 and info.reused_bytes == 9 * 4096
    mostly_new = {k: (v if k == "p00" else v + 1000) for k, v in base.items()}  # 1 of 10 kept
    info = repo.save("c", mostly_new)
    assert info.written_bytes == 10 * 4096 and info.reused_bytes == 0  # p00 copied out
    pack_c = {c.blob for t in repo.manifest("c").tensors for c in t.chunks}
    assert len(pack_c) == 1  # c points into no older pack: deleting a and b frees them
