"""Saves and loads pause Python's cyclic garbage collector and always give it back as found."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from ckptstore import CheckpointExistsError, CheckpointStore
from ckptstore.manifest import gc_paused


@pytest.fixture
def gc_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_nested_and_concurrent_pauses_reenable_only_at_the_end(gc_enabled):
    inside = threading.Event()
    release = threading.Event()

    def other_thread() -> None:
        with gc_paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other_thread)
    with gc_paused():
        assert not gc.isenabled()
        t.start()
        assert inside.wait(10)
        with gc_paused():
            assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's block is still running
    release.set()
    t.join(10)
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled(gc_enabled):
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_save_load_and_async_save_leave_the_collector_as_found(tmp_path, gc_enabled):
    state = {f"t{i}": torch.full((3,), float(i)) for i in range(50)}
    repo = CheckpointStore(tmp_path / "r")
    seen: list[bool] = []
    repo.save("a", state)
    assert gc.isenabled()
    handle = repo.save_async("b", state)
    handle.wait()
    assert gc.isenabled()
    got = repo.load("b")
    assert gc.isenabled()
    assert torch.equal(got["t7"], state["t7"])
    with pytest.raises(CheckpointExistsError):
        repo.save("a", state)  # exists: the error path gives the collector back too
    seen.append(gc.isenabled())
    gc.disable()
    repo.save("c", state)
    repo.load("c")
    seen.append(gc.isenabled())
    assert seen == [True, False]
