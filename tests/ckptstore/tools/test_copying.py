"""copy_checkpoints (ckptstore/tools/copying.py): only missing blobs are sent, each is verified, the
manifest is committed last and create-only, and a bad source commits nothing."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from ckptstore import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointStore,
    IntegrityError,
)
from ckptstore.layout import blob_key, manifest_key
from ckptstore.maintenance.leases import LeaseBusyError, gc_lease, list_leases
from ckptstore.tools.copying import copy_checkpoints


def repo() -> CheckpointStore:
    return CheckpointStore(f"memory://{uuid.uuid4().hex}", chunk_bytes=32 * 1024)


@pytest.fixture
def src() -> CheckpointStore:
    r = repo()
    rng = np.random.default_rng(3)
    frozen = rng.standard_normal(50_000).astype(np.float32)
    r.save("a", {"frozen": frozen, "w": rng.standard_normal(20_000).astype(np.float32)},
           {"step": 1})
    r.save("b", {"frozen": frozen, "w": rng.standard_normal(20_000).astype(np.float32)},
           {"step": 2})
    return r


def blobs(r: CheckpointStore) -> set[str]:
    return {i.key for i in r.store.list("blobs/")}


def test_copy_sends_only_missing_blobs_and_keeps_manifest_bytes(src: CheckpointStore) -> None:
    dst = repo()
    first = copy_checkpoints(src, dst, ["a"])
    assert first.copied == ["a"] and first.blobs_present == 0
    assert first.blobs_sent == len(src.manifest("a").blob_digests())
    sent: list[int] = []
    second = copy_checkpoints(src, dst, ["a", "latest"], progress=sent.append)
    assert second.skipped == ["a"] and second.copied == ["b"]
    in_a, in_b = src.manifest("a").blob_digests(), src.manifest("b").blob_digests()
    assert in_a & in_b  # `frozen` is shared
    assert second.blobs_needed == len(in_a | in_b) and second.blobs_present == len(in_a)
    assert second.blobs_sent == len(in_b - in_a)
    assert sum(sent) == second.bytes_sent
    for name in ("a", "b"):
        assert dst.store.get(manifest_key(name)) == src.store.get(manifest_key(name))
        assert dst.verify(name).ok
    assert blobs(dst) == blobs(src)
    assert list_leases(dst.store) == []  # the lease is released


def test_corrupt_or_missing_source_blob_commits_nothing(src: CheckpointStore) -> None:
    b_only = sorted(src.manifest("b").blob_digests() - src.manifest("a").blob_digests())
    key = blob_key(b_only[0])
    data = bytearray(src.store.get(key))
    data[0] ^= 1
    src.store.put(key, bytes(data))
    dst = repo()
    with pytest.raises(IntegrityError, match=f"{b_only[0]}.*corrupt"):
        copy_checkpoints(src, dst, ["b"])
    assert dst.names() == []
    src.store.delete(key)
    with pytest.raises(IntegrityError, match="missing"):
        copy_checkpoints(src, dst, ["a", "b"])
    assert dst.names() == []  # not even `a`: manifests go in only after every blob


def test_a_different_checkpoint_of_that_name_is_never_touched(src: CheckpointStore) -> None:
    dst = repo()
    dst.save("b", {"x": np.ones(3)})
    before = dst.store.get(manifest_key("b"))
    n_blobs = len(blobs(dst))
    with pytest.raises(CheckpointExistsError, match="other content"):
        copy_checkpoints(src, dst, ["a", "b"])
    assert dst.store.get(manifest_key("b")) == before
    assert len(blobs(dst)) == n_blobs and dst.names() == ["b"]  # nothing was sent


def test_unknown_name_and_running_gc(src: CheckpointStore) -> None:
    dst = repo()
    with pytest.raises(CheckpointNotFoundError):
        copy_checkpoints(src, dst, ["a", "nope"])
    with gc_lease(dst.store):
        with pytest.raises(LeaseBusyError):
            copy_checkpoints(src, dst, ["a"], lease_wait=0)
    assert dst.names() == []
    assert copy_checkpoints(src, dst, ["a"]).copied == ["a"]


def test_copy_again_repairs_a_deleted_blob_in_the_destination(src: CheckpointStore) -> None:
    dst = repo()
    copy_checkpoints(src, dst, ["a"])
    lost = sorted(dst.manifest("a").blob_digests())[0]
    dst.store.delete(blob_key(lost))  # e.g. removed after `ckpt verify` called it corrupt
    assert not dst.verify("a").ok
    again = copy_checkpoints(src, dst, ["a"])
    assert again.skipped == ["a"] and again.copied == [] and again.blobs_sent == 1
    assert dst.verify("a").ok
