"""LocalStore.deferred(): durability paid once per batch, and the safety rule that makes it
safe: a final name never holds bytes that are not durable, even if the writer is SIGKILLed
at any moment (content-addressed writers skip keys that exist, so such a file would corrupt
every later write of that key). Leftovers of a crash are temp files that gc removes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ckptstore.errors import DurabilityError
from ckptstore.format.hashing import digest
from ckptstore.stores import LocalStore
from ckptstore.stores import local as local_module
from ckptstore.stores.local import TEMP_PREFIX
from tests.helpers import reap

ROOT = Path(__file__).resolve().parents[3]


def _files(root: Path) -> tuple[list[str], list[str]]:
    """(final keys, temp files) under root."""
    finals: list[str] = []
    temps: list[str] = []
    for path in root.rglob("*"):
        if path.is_file():
            rel = path.relative_to(root).as_posix()
            (temps if path.name.startswith(TEMP_PREFIX) else finals).append(rel)
    return sorted(finals), sorted(temps)


def test_nothing_is_visible_before_commit(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    batch = store.deferred()
    batch.put("blobs/ab/one", b"1" * 1000)
    batch.put("blobs/cd/two", b"2")
    assert not store.exists("blobs/ab/one")
    assert list(store.list("blobs/")) == []
    finals, temps = _files(store.root)
    assert finals == [] and len(temps) == 2
    assert sorted(i.key for i in store.temp_files()) == temps
    batch.commit()
    assert _files(store.root) == (["blobs/ab/one", "blobs/cd/two"], [])


def test_a_failed_fsync_fails_the_commit_and_names_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = local_module._fsync

    def failing(fd: int, what: str) -> None:
        if "bad" in what:
            raise DurabilityError(f"fsync of {what} failed: injected")
        real(fd, what)

    monkeypatch.setattr(local_module, "_fsync", failing)
    store = LocalStore(tmp_path / "s")
    batch = store.deferred()
    batch.put("k/good", b"good")
    batch.put("k/bad", b"bad")
    with pytest.raises(DurabilityError, match="injected"):
        batch.commit()
    assert _files(store.root) == ([], [])  # no name for either, temps removed


def test_abandon_removes_the_temps(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    batch = store.deferred()
    batch.put("x/a", b"a" * 5000)
    batch.abandon()
    assert _files(store.root) == ([], [])


_CHILD = textwrap.dedent("""
    import os, sys, time
    from ckptstore.format.hashing import digest
    from ckptstore.stores import LocalStore
    from ckptstore.stores import local
    root, log = sys.argv[1], sys.argv[2]
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    real = local._fsync

    def slow_logged_fsync(fd, what):  # a slow disk, and a record of every durable temp
        time.sleep(0.01)
        real(fd, what)
        os.write(log_fd, (what.rsplit("/", 1)[-1] + "\\n").encode())

    local._fsync = slow_logged_fsync
    store = LocalStore(root)
    n = 0
    while True:
        batch = store.deferred()
        for _ in range(6):
            data = os.urandom(1000 + n * 37 % 50000)
            name = digest(data)
            batch.put(f"blobs/{name[:2]}/{name}", data)  # content-addressed, as blobs are
            n += 1
        batch.commit()
        print(n, flush=True)
""")


@pytest.mark.parametrize("kill_after", [0.15, 0.4, 0.75])
def test_sigkill_at_any_moment_leaves_only_durable_finals(tmp_path: Path,
                                                          kill_after: float) -> None:
    root, log = tmp_path / "store", tmp_path / "fsynced.log"
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(root), str(log)], stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # one batch committed: the child is past its start-up
        time.sleep(kill_after)
    finally:
        proc.kill()
        reap(proc, 60)
    finals, temps = _files(root)
    durable = set(log.read_text().split())
    assert finals, "the child committed nothing"
    for key in finals:
        name = key.rsplit("/", 1)[1]
        data = (root / key).read_bytes()
        assert digest(data) == name, f"{key}: torn or foreign bytes under a final name"
        assert name in durable, f"{key} got its name before its bytes were fsynced"
    # the crash's leftovers are ordinary temp files: the store lists them and gc deletes them
    store = LocalStore(root)
    assert sorted(i.key for i in store.temp_files()) == temps
    for info in list(store.temp_files()):
        store.delete_temp(info.key)
    assert _files(root) == (finals, [])
