"""A CLI that never misleads: advice it can follow, honest errors for non-checkpoints, checks
before long reads, progress that ends at 100%, durations that are never '0.0s', `rm --dry-run`,
"did you mean", and a demo that runs twice against one S3 prefix."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.cli import main
from ckptstore.cli.output import human_duration
from ckptstore.layout import BLOB_PREFIX
from ckptstore.tools.copying import copy_checkpoints

ROOT = Path(__file__).resolve().parents[3]


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt: "), err
    return lines[0]


@pytest.fixture
def repo_path(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    with CheckpointStore(root) as repo:
        for step in (1, 2, 3):
            repo.save(f"s{step}", {"w": torch.full((64, 64), float(step)), "step": step})
    return root


def test_missing_bucket_advice_is_one_the_cli_can_follow(capsys: pytest.CaptureFixture[str],
                                                         moto_endpoint: str) -> None:
    rc, _out, err = run(capsys, "ls", "s3://missing-bucket-x/p", "--endpoint-url", moto_endpoint)
    assert rc == 2
    line = error_line(err)
    assert "does not exist" in line and "create the bucket first" in line
    assert "create=True" not in line


def test_import_of_a_non_checkpoint_never_suggests_unpickling(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint\n")
    junk = tmp_path / "weights.pt"
    junk.write_bytes(os.urandom(4096))
    for source in (notes, junk):
        rc, _out, err = run(capsys, "import", str(tmp_path / "r"), "x", str(source))
        assert rc == 2
        line = error_line(err)
        assert "not a safetensors, torch or DCP checkpoint" in line, line
        assert "weights_only" not in line and "pickle" not in line.replace("unpickles", "")


def test_export_checks_the_destination_before_reading(capsys: pytest.CaptureFixture[str],
                                                      repo_path: Path, tmp_path: Path) -> None:
    for blob in (repo_path / BLOB_PREFIX).rglob("*"):  # any read of the checkpoint would fail
        if blob.is_file():
            blob.write_bytes(b"damaged")
    existing = tmp_path / "out.safetensors"
    existing.write_bytes(b"keep me")
    rc, _out, err = run(capsys, "export", str(repo_path), "s1", str(existing))
    assert rc == 2 and "exists" in error_line(err) and "--force" in err
    assert existing.read_bytes() == b"keep me"
    rc, _out, err = run(capsys, "export", str(repo_path), "s1",
                        str(tmp_path / "no" / "such" / "m.safetensors"))
    assert rc == 2 and "no such folder" in error_line(err)
    rc, _out, err = run(capsys, "export", str(repo_path), "s1", str(tmp_path / "fresh.pt"))
    assert rc == 2 and "shorter than the manifest declares" in error_line(err)  # it did read


def test_cp_progress_ends_exactly_at_its_total(tmp_path: Path) -> None:
    # b reuses five of the six members of a's pack (enough for the pack to stay live, not the
    # last one): copying b alone sends the whole pack, while b references only part of it
    src = CheckpointStore(tmp_path / "src")
    small = {f"t{i}": np.full(7, i, dtype=np.float32) for i in range(6)}
    src.save("a", small)
    src.save("b", {**{f"t{i}": small[f"t{i}"] for i in range(5)},
                   "big": np.ones((300, 300), dtype=np.float32)})
    dst = CheckpointStore(tmp_path / "dst")
    totals: list[int] = []
    steps: list[int] = []
    report = copy_checkpoints(src, dst, ["b"], progress=steps.append, on_total=totals.append)
    assert report.bytes_sent > sum(steps) > 0  # the pack is sent whole
    assert totals == [sum(steps)]


def test_durations_are_never_printed_as_zero() -> None:
    assert human_duration(0.0) == "<1 ms"
    assert human_duration(0.0004) == "<1 ms"
    assert human_duration(0.042) == "42 ms"
    assert human_duration(2.345) == "2.3 s"
    assert human_duration(125) == "2m05s"
    assert human_duration(7300) == "2h01m"


def test_verify_table_shows_a_real_duration(capsys: pytest.CaptureFixture[str],
                                            repo_path: Path) -> None:
    rc, out, _err = run(capsys, "--table", "verify", str(repo_path))
    assert rc == 0
    assert " 0.0s" not in out and re.search(r"in (<1 ms|\d+ ms|[\d.]+ s):", out), out


def test_rm_dry_run_deletes_nothing(capsys: pytest.CaptureFixture[str], repo_path: Path) -> None:
    rc, out, _err = run(capsys, "--json", "rm", str(repo_path), "s1", "latest", "--dry-run")
    assert rc == 0
    assert json.loads(out) == {"uri": str(repo_path), "dry_run": True,
                               "deleted": ["s1", "s3"]}
    assert sorted(CheckpointStore(repo_path).names()) == ["s1", "s2", "s3"]
    rc, out, _err = run(capsys, "--table", "rm", str(repo_path), "s2", "--dry-run")
    assert "would delete 1 checkpoint(s): s2; nothing deleted" in out
    rc, _out, err = run(capsys, "rm", str(repo_path), "nope", "--dry-run")
    assert rc == 2 and "no checkpoint 'nope'" in err
    rc, out, _err = run(capsys, "--json", "rm", str(repo_path), "s2")
    assert json.loads(out)["dry_run"] is False
    assert sorted(CheckpointStore(repo_path).names()) == ["s1", "s3"]


def test_typo_gets_did_you_mean(capsys: pytest.CaptureFixture[str], repo_path: Path) -> None:
    for typo, meant in (("lss", "ls"), ("verfy", "verify"), ("exprot", "export")):
        rc, _out, err = run(capsys, typo, str(repo_path))
        assert rc == 2 and f"did you mean '{meant}'?" in error_line(err), err
    rc, _out, err = run(capsys, "zzzz", str(repo_path))
    assert rc == 2 and "did you mean" not in err
    rc, _out, err = run(capsys, "export", str(repo_path), "s1", "x", "--format", "zar")
    assert rc == 2 and "did you mean 'zarr'?" in err


def test_demo_runs_twice_on_one_s3_prefix_without_wrapping(moto_endpoint: str,
                                                            s3_uri: str) -> None:
    env = {**os.environ, "AWS_ENDPOINT_URL": moto_endpoint, "COLUMNS": "60",
           "PYTHONPATH": str(ROOT)}
    outputs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--root",
                               s3_uri], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        outputs.append(proc.stdout)
    first, second = outputs
    for out in outputs:
        rows = [ln for ln in out.splitlines() if "async+incr" in ln or " full " in ln]
        assert len(rows) == 2, out  # one line per row: nothing wrapped
        assert all("GiB/s" in ln for ln in rows), out
    assert "earlier demo run" in second and "step-2-run2" in second
    assert "verify step-3-run2" in second and "OK" in second
    assert "step-3-run2 (step 3)" in second


def test_a_missing_index_segment_is_reported_by_verify_ls_and_du_not_a_crash(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # each of them stopped with "index blob ... has no good copy" (rc 2), verify included,
    # instead of naming the blob and listing the rest
    root = tmp_path / "repo"
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(3000)}  # segmented
    with CheckpointStore(root) as repo:
        repo.save("a", state)
        repo.save("b", {**state, "t5": state["t5"] + 1})
        segments = {s: {r.digest for r in repo.manifest(s).segment_refs()} for s in "ab"}
    (lost,) = segments["b"] - segments["a"]
    (root / BLOB_PREFIX / lost[:2] / lost).unlink()
    rc, out, _err = run(capsys, "--json", "verify", str(root))
    doc = json.loads(out)
    assert rc == 1 and [(p["blob"], p["problem"], p["checkpoints"]) for p in doc["problems"]] \
        == [(lost, "missing", ["b"])]
    for command in ("ls", "du"):
        rc, out, err = run(capsys, "--json", command, str(root))
        doc = json.loads(out)
        assert rc == 1, (command, err)
        assert [c["name"] for c in doc["checkpoints"]] == ["a"], command
        assert [e["name"] for e in doc["errors"]] == ["b"] and lost in doc["errors"][0]["error"]
