"""save_async snapshots at call time; incremental saves skip unchanged chunks."""

from __future__ import annotations

import torch

from ckptstore import CheckpointStore


def test_async_save_holds_values_at_call_time(store_uri, store_options):
    repo = CheckpointStore(store_uri, chunk_bytes=1 << 16, **store_options)
    w = torch.randn(512, 256)
    expected = w.clone()
    handle = repo.save_async("a", {"w": w, "step": 1})
    w.add_(1.0)  # the trainer moves on immediately
    w[0, 0] = 99.0
    info = handle.wait()
    assert handle.done() and info.logical_bytes == w.nbytes
    assert info.blocked_seconds <= info.seconds
    assert torch.equal(repo.load("a")["w"], expected)
    repo.close()


def test_async_saves_run_one_at_a_time_and_reuse_staging(tmp_path):
    repo = CheckpointStore(tmp_path / "r")
    w = torch.randn(256, 256)
    handles, expected = [], []
    for step in range(4):
        w.add_(1.0)
        expected.append(w.clone())
        handles.append(repo.save_async(f"s{step}", {"w": w}))
    cap = repo._arena.capacity
    repo.wait()
    assert cap >= w.nbytes and repo._arena.capacity == cap  # one arena, reused
    for step, h in enumerate(handles):
        h.wait()
        assert torch.equal(repo.load(f"s{step}")["w"], expected[step])
    repo.close()


def test_incremental_save_writes_only_changed_chunks(store_uri, store_options):
    repo = CheckpointStore(store_uri, chunk_bytes=1 << 16, **store_options)
    state = {f"layer{i}": torch.randn(256, 128) for i in range(10)}  # 128 KiB each, 2 chunks
    state.update({f"bias{i}": torch.randn(128) for i in range(50)})
    full = repo.save("full", state)
    assert full.reused_bytes == 0
    state["layer3"].add_(1.0)
    state["bias7"].add_(1.0)
    inc = repo.save("inc", state)
    assert inc.logical_bytes == full.logical_bytes
    assert inc.written_bytes <= 2 * (1 << 16) + 128 * 4 * 50 + 1024
    assert inc.reused_bytes >= 9 * 256 * 128 * 4
    for k, v in repo.load("inc").items():
        assert torch.equal(v, state[k]), k
    # a fresh process (new CheckpointStore) learns the chunks from the parent manifest
    repo2 = CheckpointStore(store_uri, chunk_bytes=1 << 16, **store_options)
    again = repo2.save("again", state)
    assert again.written_bytes == 0 and again.chunks_written == 0
    repo.close()
    repo2.close()


def test_incremental_with_compression(tmp_path):
    repo = CheckpointStore(tmp_path / "r", compression="zstd", chunk_bytes=1 << 16)
    state = {"a": torch.zeros(64, 1024), "b": torch.randn(64, 1024)}
    repo.save("one", state)
    state["a"][0, 0] = 1.0
    info = repo.save("two", state)
    assert info.chunks_reused >= 4
    assert torch.equal(repo.load("two")["a"], state["a"])


def test_parent_none_writes_everything_new(tmp_path):
    repo = CheckpointStore(tmp_path / "r")
    state = {"a": torch.randn(300, 300)}
    repo.save("one", state)
    fresh = CheckpointStore(tmp_path / "r")
    info = fresh.save("two", state, parent=None)
    assert info.reused_bytes == 0  # nothing known: written again (identical blob, same key)
