"""Crafted manifests must not make a load allocate before anything is verified: declared sizes
are bounded, checked against real objects, and allocation failures are FormatErrors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore, CkptStoreError, FormatError
from ckptstore.format.manifest import MAX_MANIFEST_BYTES
from tests.helpers import sealed_manifest


def _tamper(repo: CheckpointStore, name: str, change: Any) -> None:
    key = f"checkpoints/{name}.json"
    doc = json.loads(repo.store.get(key))
    change(doc)
    repo.store.put(key, sealed_manifest(doc))  # a consistent seal: only the rules can refuse


def _attrs(doc: dict, i: int = 0) -> dict:
    return doc["tensors"][i]["attributes"]["ckptstore"]


def _set_shape(doc: dict, shape: list[int], chunk_rows: int | None = None) -> None:
    entry = doc["tensors"][0]
    entry["shape"] = shape
    rows = chunk_rows if chunk_rows is not None else shape[0]
    _attrs(doc)["chunk_rows"] = rows
    entry["chunk_grid"]["configuration"]["chunk_shape"] = [max(1, rows)] + [
        max(1, d) for d in shape[1:]]


PROBE = textwrap.dedent("""
    import resource, sys
    from ckptstore import CheckpointStore, CkptStoreError
    repo = CheckpointStore(sys.argv[1], create=False)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        repo.load("big")
        outcome = "loaded"
    except CkptStoreError as exc:
        outcome = type(exc).__name__
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(outcome, grew // 1024)
""")


def test_a_small_manifest_declaring_a_huge_compressed_chunk_costs_no_memory(tmp_path: Path):
    """The audit's 4 KB manifest declaring a 400 MiB compressed chunk grew RSS by 802 MiB."""
    repo = CheckpointStore(tmp_path / "repo", compression="zstd")
    repo.save("big", {"w": torch.zeros(4 << 20, dtype=torch.uint8)})  # one compressed chunk
    assert _attrs(json.loads(repo.store.get("checkpoints/big.json")))["codec"] is not None
    n = 400 << 20

    def huge(doc: dict) -> None:
        _set_shape(doc, [n])
        chunk = _attrs(doc)["chunks"][0]
        chunk.update(nbytes=n, size=n)

    _tamper(repo, "big", huge)
    root = Path(__file__).resolve().parents[3]  # import this checkout's ckptstore
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "repo")], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    outcome, grew_mib = out.stdout.split()
    assert outcome in ("StoreError", "IntegrityError"), out.stdout
    assert int(grew_mib) < 64, f"RSS grew by {grew_mib} MiB"


@pytest.mark.parametrize("change, message", [
    (lambda d: _set_shape(d, [0, 2**40, 2**40]), "declares more than"),
    (lambda d: _set_shape(d, [2**61], chunk_rows=2**61), "declares more than"),
    (lambda d: _attrs(d).update(storage={"id": 0, "nbytes": 2**60, "offset": 0,
                                         "stride": [1]}), "storage declares more than"),
], ids=["empty-but-absurd", "huge-1d", "huge-storage"])
def test_absurd_shapes_and_storages_are_format_errors_for_load_and_verify(tmp_path: Path,
                                                                         change, message):
    repo = CheckpointStore(tmp_path / "repo")
    repo.save("big", {"w": torch.zeros(8)})
    _tamper(repo, "big", change)
    fresh = CheckpointStore(tmp_path / "repo")
    with pytest.raises(FormatError, match=message):
        fresh.load("big")
    with pytest.raises(FormatError, match=message):
        fresh.verify("big")


def test_a_load_declaring_more_than_the_machine_holds_fails_before_allocating(tmp_path: Path):
    repo = CheckpointStore(tmp_path / "repo")
    repo.save("big", {"w": torch.zeros(4, dtype=torch.uint8)})
    rows = 1 << 34  # chunks of 16 GiB, the most one chunk may declare
    chunks = 128  # 2 TiB in all

    def two_tib(doc: dict) -> None:
        _set_shape(doc, [rows * chunks], chunk_rows=rows)
        first = _attrs(doc)["chunks"][0]
        _attrs(doc)["chunks"] = [dict(first, nbytes=rows, size=rows) for _ in range(chunks)]

    _tamper(repo, "big", two_tib)
    with pytest.raises(FormatError, match="declares 2199023255552 bytes of tensors"):
        CheckpointStore(tmp_path / "repo").load("big")
    into = {"w": torch.zeros(4, dtype=torch.uint8)}  # in place: the shapes disagree instead
    with pytest.raises(CkptStoreError):
        CheckpointStore(tmp_path / "repo").load("big", into=into)


def test_an_oversized_manifest_is_refused_before_it_is_read(tmp_path: Path, monkeypatch):
    repo = CheckpointStore(tmp_path / "repo")
    repo.save("big", {"w": torch.zeros(8)})
    path = tmp_path / "repo" / "checkpoints" / "big.json"
    with open(path, "r+b") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: costs no disk
    fresh = CheckpointStore(tmp_path / "repo")

    def no_read(*args: Any) -> bytes:
        raise AssertionError("the oversized manifest was read")

    monkeypatch.setattr(fresh.store, "get", no_read)
    with pytest.raises(FormatError, match="larger than"):
        fresh.load("big")
    assert os.path.getsize(path) == MAX_MANIFEST_BYTES + 1
