"""A repository may name its chunks with a cryptographic hash (sha256-128) instead of
xxh3-128: the choice is kept in the marker and applied to every write, read and check."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore, FormatError, IntegrityError
from ckptstore.layout import blob_key
from ckptstore.tools.copying import copy_checkpoints
from tests.helpers import assert_same, sealed_manifest


def state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(300_000, generator=g),  # whole-blob chunks
            "small": [torch.arange(5), torch.ones(3, dtype=torch.bfloat16)],  # packed
            "step": 7}


def test_a_sha256_repository_round_trips_and_names_blobs_by_sha256(store_uri, store_options):
    repo = CheckpointStore(store_uri, hash="sha256-128", chunk_bytes=256 * 1024,
                           **store_options)
    s = state()
    repo.save("a", s)
    zrepo = CheckpointStore(store_uri, compression="zstd", **store_options)  # reopened
    zrepo.save("b", s, parent=None)
    assert json.loads(repo.store.get("ckptstore.json"))["hash"] == "sha256-128"
    fresh = CheckpointStore(store_uri, **store_options)
    assert fresh.hash.name == "sha256-128"
    for name in ("a", "b"):
        m = fresh.manifest(name)
        assert m.hash == "sha256-128"
        for blob in m.blob_digests():
            data = fresh.store.get(blob_key(blob))
            assert hashlib.sha256(data).hexdigest()[:32] == blob
        assert_same(fresh.load(name), s)
        assert fresh.verify(name).ok


def test_corruption_is_caught_with_sha256(tmp_path: Path):
    repo = CheckpointStore(tmp_path / "r", hash="sha256-128")
    repo.save("a", state())
    blob = max(repo.manifest("a").blob_digests(),
               key=lambda b: repo.store.stat(blob_key(b)).size)
    path = tmp_path / "r" / blob_key(blob)
    raw = bytearray(path.read_bytes())
    raw[100] ^= 1
    path.write_bytes(bytes(raw))
    fresh = CheckpointStore(tmp_path / "r")
    assert not fresh.verify("a").ok
    with pytest.raises(IntegrityError):
        fresh.load("a")


def test_a_repository_keeps_its_hash(tmp_path: Path):
    CheckpointStore(tmp_path / "r", hash="sha256-128").save("a", {"x": torch.ones(2)})
    with pytest.raises(FormatError, match="keeps the hash it was created with"):
        CheckpointStore(tmp_path / "r", hash="xxh3-128")
    with pytest.raises(FormatError, match="unknown hash algorithm"):
        CheckpointStore(tmp_path / "new", hash="md5")


def test_a_manifest_claiming_the_weaker_hash_is_refused(tmp_path: Path):
    repo = CheckpointStore(tmp_path / "r", hash="sha256-128")
    repo.save("a", {"x": torch.ones(2)})
    doc = json.loads(repo.store.get("checkpoints/a.json"))
    doc["hash"] = "xxh3-128"  # a forger's easy way out: sealed with xxh3
    repo.store.put("checkpoints/a.json", sealed_manifest(doc))
    with pytest.raises(FormatError):
        CheckpointStore(tmp_path / "r").load("a")


def test_copies_between_repositories_of_different_hashes_are_refused(tmp_path: Path):
    src = CheckpointStore(tmp_path / "src", hash="sha256-128")
    src.save("a", {"x": torch.ones(2)})
    dst = CheckpointStore(tmp_path / "dst")
    with pytest.raises(FormatError, match="cannot be copied"):
        copy_checkpoints(src, dst, ["a"])
    assert dst.list() == []
