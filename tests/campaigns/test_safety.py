"""Safety rules: whole-or-invisible commits, verified reads, clear errors on bad input."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ckptstore import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointStore,
    CkptStoreError,
    DurabilityError,
    FormatError,
    IntegrityError,
    InvalidNameError,
    RepositoryNotFoundError,
    StoreError,
)
from ckptstore.layout import blob_key
from ckptstore.stores import LocalStore, MemoryStore
from tests.helpers import sealed_manifest


@pytest.fixture
def repo(tmp_path):
    r = CheckpointStore(tmp_path / "repo")
    yield r
    r.close()


def state_of(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(400, 300, generator=g), "b": torch.randn(200, generator=g),
            "step": seed}


def test_existing_name_is_refused_and_untouched(repo):
    repo.save("a", state_of(1))
    before = repo.store.get("checkpoints/a.json")
    with pytest.raises(CheckpointExistsError):
        repo.save("a", state_of(2))
    with pytest.raises(FileExistsError):
        repo.save_async("a", state_of(2))
    assert repo.store.get("checkpoints/a.json") == before
    assert torch.equal(repo.load("a")["w"], state_of(1)["w"])


def test_concurrent_commit_race_keeps_the_first(tmp_path):
    """Two writers pass the early existence check; the create-only commit picks one."""
    r1 = CheckpointStore(tmp_path / "repo")
    r2 = CheckpointStore(tmp_path / "repo")
    from ckptstore.format.tree import TreeEncoder
    from ckptstore.pipeline.writer import CheckpointWriter, KnownChunks

    def write(repo, seed):
        enc = TreeEncoder()
        tree = enc.encode(state_of(seed))
        w = CheckpointWriter(repo.store, repo.save_options, KnownChunks())
        return w.write("same", tree, enc.leaves, {}, None, "checkpoints/same.json")

    write(r1, 1)
    with pytest.raises(CheckpointExistsError):
        write(r2, 2)
    assert torch.equal(r2.load("same")["w"], state_of(1)["w"])


@pytest.mark.parametrize("name", ["", ".hidden", "../x", "a/b", "a b", "x" * 129, "-lead",
                                  "é", None, 5, "a\x00"])
def test_hostile_names_are_refused(repo, name):
    with pytest.raises(InvalidNameError):
        repo.save(name, {})
    with pytest.raises((InvalidNameError, CheckpointNotFoundError)):
        repo.load(name)


def test_corrupt_chunk_is_named(repo, tmp_path):
    repo.save("a", state_of(1))
    entry = next(t for t in repo.manifest("a").tensors if t.key == "w")
    blob = entry.chunks[0].blob
    path = tmp_path / "repo" / blob_key(blob)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as err:
        repo.load("a")
    assert "'w'" in str(err.value) and blob in str(err.value)
    report = repo.verify("a")
    assert not report.ok and report.problems[0].blob == blob
    assert report.problems[0].keys == ("w",)


def test_corrupt_compressed_chunk_is_detected(tmp_path):
    repo = CheckpointStore(tmp_path / "repo", compression="zstd")
    repo.save("a", {"z": torch.zeros(100_000)})
    blob = repo.manifest("a").tensors[0].chunks[0].blob
    path = tmp_path / "repo" / blob_key(blob)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        repo.load("a")


def test_corrupt_packed_member_is_detected(repo, tmp_path):
    repo.save("a", {f"b{i}": torch.full((10,), float(i)) for i in range(20)})
    m = repo.manifest("a")
    chunk = m.tensors[7].chunks[0]
    path = tmp_path / "repo" / blob_key(chunk.blob)
    data = bytearray(path.read_bytes())
    data[chunk.offset + 3] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="b7"):
        repo.load("a")
    # keys outside the damaged range still load
    assert torch.equal(repo.load("a", keys=["b1"])["b1"], torch.full((10,), 1.0))


def test_missing_blob(repo, tmp_path):
    repo.save("a", state_of(1))
    blob = repo.manifest("a").tensors[0].chunks[0].blob
    os.unlink(tmp_path / "repo" / blob_key(blob))
    with pytest.raises(IntegrityError, match="missing"):
        repo.load("a")
    assert repo.verify("a").problems[0].problem == "missing"


def test_truncated_blob(repo, tmp_path):
    repo.save("a", state_of(1))
    blob = repo.manifest("a").tensors[0].chunks[0].blob
    path = tmp_path / "repo" / blob_key(blob)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CkptStoreError):
        repo.load("a")


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(version=99),
    lambda d: d.update(format="other"),
    lambda d: d.update(hash="md5"),
    lambda d: d.pop("tree"),
    lambda d: d["tensors"][0]["attributes"]["ckptstore"].update(dtype="float128"),
    lambda d: d["tensors"][0].update(shape=[10**12, 10**12]),
    lambda d: d["tensors"][0]["attributes"]["ckptstore"]["chunks"].pop(),
    lambda d: d["tensors"][0]["attributes"]["ckptstore"]["chunks"][0].update(nbytes=1 << 40),
    lambda d: d["tensors"][0]["attributes"]["ckptstore"]["chunks"][0].update(blob="../../x"),
    lambda d: d.update(tree={"tensor": 99}),
    lambda d: d.update(tree={"pickle": "gASV"}),
    lambda d: d.update(name="other"),
])
def test_hostile_or_broken_manifest_gives_format_error(repo, tmp_path, mutate):
    repo.save("a", state_of(1))
    path = tmp_path / "repo" / "checkpoints" / "a.json"
    doc = json.loads(path.read_bytes())
    mutate(doc)
    path.write_bytes(sealed_manifest(doc))  # sealed: the structural checks must catch it
    fresh = CheckpointStore(tmp_path / "repo")
    with pytest.raises(FormatError):
        fresh.load("a")


def test_truncated_manifest(repo, tmp_path):
    repo.save("a", state_of(1))
    path = tmp_path / "repo" / "checkpoints" / "a.json"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(FormatError, match="'a'"):
        CheckpointStore(tmp_path / "repo").load("a")


def test_unknown_repository_version(tmp_path):
    CheckpointStore(tmp_path / "repo").close()
    (tmp_path / "repo" / "ckptstore.json").write_text('{"format":"ckptstore","version":7}')
    with pytest.raises(FormatError, match="version"):
        CheckpointStore(tmp_path / "repo")


def test_open_without_create(tmp_path):
    with pytest.raises(RepositoryNotFoundError):
        CheckpointStore(tmp_path / "nothing", create=False)
    with pytest.raises(FileNotFoundError):
        CheckpointStore(tmp_path / "nothing", create=False)


def test_missing_checkpoint(repo):
    with pytest.raises(CheckpointNotFoundError):
        repo.load("nope")
    with pytest.raises(KeyError):
        repo.load("nope")
    with pytest.raises(CheckpointNotFoundError):
        repo.load()  # latest of an empty repository
    with pytest.raises(CheckpointNotFoundError):
        repo.delete("nope")


class FailingStore(MemoryStore):
    """Fails the n-th blob put."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.puts = 0

    def put(self, key, data):
        if key.startswith("blobs/"):
            self.puts += 1
            if self.puts == self.fail_at:
                raise StoreError("injected: disk on fire")
        super().put(key, data)


def test_failed_save_leaves_nothing_listed():
    store = FailingStore(fail_at=3)
    repo = CheckpointStore(store, chunk_bytes=64 * 1024)
    repo.save("good", {"x": torch.ones(10)})
    with pytest.raises(StoreError, match="disk on fire"):
        repo.save("bad", state_of(3))
    assert [c.name for c in repo.list()] == ["good"]
    assert not store.exists("checkpoints/bad.json")
    assert torch.equal(repo.load("good")["x"], torch.ones(10))
    repo.save("bad", state_of(3))  # the name is free: nothing was committed
    assert torch.equal(repo.load("bad")["w"], state_of(3)["w"])


def test_failed_fsync_is_fatal_and_not_retried(tmp_path, monkeypatch):
    repo = CheckpointStore(tmp_path / "repo")
    repo.save("good", state_of(1))
    calls = []
    real_fsync = os.fsync

    def broken_fsync(fd):
        calls.append(fd)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(DurabilityError):
        repo.save("bad", state_of(2))
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert [c.name for c in repo.list()] == ["good"]
    assert torch.equal(repo.load("good")["w"], state_of(1)["w"])


def test_failed_async_save_surfaces_in_wait_and_next_save():
    store = FailingStore(fail_at=1)
    repo = CheckpointStore(store)
    handle = repo.save_async("bad", state_of(1))
    with pytest.raises(StoreError):
        handle.wait()
    repo.save("next", state_of(2))  # error already observed: next save proceeds
    handle = repo.save_async("bad2", {"x": torch.ones(3)})
    store.fail_at, store.puts = 1, 0
    while not handle.done():
        pass
    assert isinstance(handle.exception(), StoreError) or handle.exception() is None


def test_unobserved_async_failure_raises_on_next_save():
    store = FailingStore(fail_at=1)
    repo = CheckpointStore(store)
    repo.save_async("bad", state_of(1))
    with pytest.raises(StoreError):
        repo.save("next", state_of(2))
    repo.save("next", state_of(2))
    assert [c.name for c in repo.list()] == ["next"]


def test_no_pickle_anywhere():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    sources = [*(root / "ckptstore").rglob("*.py"), *(root / "dataloader").rglob("*.py")]
    for path in sources:
        text = path.read_text()
        assert "import pickle" not in text and "cPickle" not in text, path
        assert "torch.load(" not in text or "weights_only=True" in text, path


def test_local_store_never_escapes_root(tmp_path):
    store = LocalStore(tmp_path / "root")
    for key in ["../x", "a/../../x", "/etc/passwd"]:
        with pytest.raises(InvalidNameError):
            store.put(key, b"x")
    assert not (tmp_path / "x").exists()


def _slow_folder_fsyncs(monkeypatch, fail: bool = False):
    """Make LocalStore folder fsyncs wait for `gate` (and then fail, if asked); `entered` is
    set once the first one started."""
    import threading

    from ckptstore.stores import local

    gate, entered = threading.Event(), threading.Event()
    real = local.fsync_dir

    def slow(path):
        entered.set()
        assert gate.wait(10)
        if fail:
            raise DurabilityError(f"fsync of folder {path} failed: injected")
        real(path)

    monkeypatch.setattr(local, "fsync_dir", slow)
    return gate, entered


@pytest.mark.parametrize("fail", [False, True])
def test_a_sync_never_returns_before_a_concurrent_sync_that_took_its_folders(
        tmp_path, monkeypatch, fail):
    """Two threads put, then sync: the first sync takes every dirty folder, the second finds
    none. The second must still wait until those folders are durable, and fail if they
    could not be made so (a caller would otherwise commit a manifest over lost entries)."""
    import threading

    store = LocalStore(tmp_path / "s")
    store.put("a/x", b"1")
    store.put("b/y", b"2")
    gate, entered = _slow_folder_fsyncs(monkeypatch, fail)
    outcome: dict[str, object] = {}

    def sync(who):
        try:
            store.sync()
            outcome[who] = "ok"
        except DurabilityError as exc:
            outcome[who] = exc

    first = threading.Thread(target=sync, args=("first",))
    first.start()
    assert entered.wait(5)  # the first sync holds both folders now
    second = threading.Thread(target=sync, args=("second",))
    second.start()
    second.join(0.3)
    assert "second" not in outcome  # its folders are not durable yet: it waits
    gate.set()
    first.join(5)
    second.join(5)
    if not fail:
        assert outcome == {"first": "ok", "second": "ok"}
    else:
        assert all(isinstance(v, DurabilityError) for v in outcome.values()), outcome
        with pytest.raises(DurabilityError, match="earlier folder fsync"):
            store.sync()  # sticky: nothing written since can be called durable
