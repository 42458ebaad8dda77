"""Hardening: the reserved name 'latest', symbolic links in a local store, CKPT_DEBUG and the
exit code of `ckpt`, and clear errors when a repository cannot be created."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import sysconfig
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.cli import main
from ckptstore.errors import InvalidNameError, StoreAccessError, StoreError
from ckptstore.format.names import validate_name
from ckptstore.stores import LocalStore

ROOT = Path(__file__).resolve().parents[2]


def _state() -> dict[str, Any]:
    return {"w": np.arange(64, dtype=np.float32), "step": 3}


# ------------------------------------------------------------------ the reserved name 'latest'
def test_latest_is_reserved_exactly() -> None:
    with pytest.raises(InvalidNameError, match="'latest' is reserved: it means the newest "
                                               "checkpoint"):
        validate_name("latest")
    for ordinary in ("Latest", "LATEST", "latest-1", "latest.v2", "my-latest"):
        assert validate_name(ordinary) == ordinary
    assert validate_name("latest", allow_reserved=True) == "latest"  # reading old manifests


def test_a_checkpoint_cannot_be_named_latest(tmp_path: Path) -> None:
    with ckptstore.CheckpointStore(tmp_path / "repo") as repo:
        repo.save("a", _state())
        with pytest.raises(InvalidNameError, match="reserved"):
            repo.save("latest", _state())
        assert not (tmp_path / "repo" / "checkpoints" / "latest.json").exists()
        assert repo.names() == ["a"]
        assert repo.load("latest")["step"] == 3  # still means the newest
        with pytest.raises(InvalidNameError, match="reserved"):
            repo.delete("latest")  # never "the checkpoint named latest", never the newest
        assert repo.names() == ["a"]


# ------------------------------------------------------------------ symbolic links (local)
Op = Callable[[LocalStore, str], object]
OPS: dict[str, Op] = {
    "get": lambda s, k: s.get(k),
    "get_range": lambda s, k: s.get_range(k, 0, 1),
    "read_into": lambda s, k: s.read_into(k, 0, memoryview(bytearray(1))),
    "read_into_digest": lambda s, k: s.read_into_digest(k, 0, memoryview(bytearray(1))),
    "put": lambda s, k: s.put(k, b"new"),
    "create": lambda s, k: s.create(k, b"new"),
    "stat": lambda s, k: s.stat(k),
    "exists": lambda s, k: s.exists(k),
    "delete": lambda s, k: s.delete(k),
    "list": lambda s, k: list(s.list(k)),
    "list_folder": lambda s, k: list(s.list(k.rpartition("/")[0] + "/")),
}


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.fixture
def linked(tmp_path: Path) -> tuple[LocalStore, Path]:
    """A store with links: blobs/ab -> outside/ (a folder), blobs/aa/obj -> outside/victim (an
    object), and checkpoints -> outside/ (a top-level folder)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"do not touch")
    (outside / "sub").mkdir()
    store = LocalStore(tmp_path / "root")
    store.put("blobs/aa/real", b"real")
    os.symlink(outside, tmp_path / "root" / "blobs" / "ab")
    os.symlink(outside / "victim", tmp_path / "root" / "blobs" / "aa" / "obj")
    os.symlink(outside, tmp_path / "root" / "checkpoints")
    return store, outside


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("key, link", [
    ("blobs/ab/victim", "blobs/ab"),       # a folder link, existing target
    ("blobs/ab/new", "blobs/ab"),          # a folder link, a write would create outside
    ("blobs/ab/sub/deeper", "blobs/ab"),   # a link further up
    ("blobs/aa/obj", "blobs/aa/obj"),      # the object itself is a link
    ("checkpoints/victim", "checkpoints"),
])
def test_links_below_the_root_are_refused(linked: tuple[LocalStore, Path], op: str, key: str,
                                          link: str) -> None:
    store, outside = linked
    before = _snapshot(outside)
    with pytest.raises(StoreError, match="symbolic link") as info:
        OPS[op](store, key)
    assert repr(link) in str(info.value) and not isinstance(info.value, FileNotFoundError)
    assert _snapshot(outside) == before  # nothing written, replaced or deleted out there
    assert sorted(p.name for p in outside.iterdir()) == ["sub", "victim"]
    assert store.get("blobs/aa/real") == b"real"


def test_listing_and_gc_scans_refuse_links(linked: tuple[LocalStore, Path]) -> None:
    store, outside = linked
    (outside / ".tmp-old").write_bytes(b"x")
    os.symlink(outside / ".tmp-old", Path(store.root) / "blobs" / "aa" / ".tmp-x-obj")
    for call in (lambda: list(store.list()), lambda: list(store.list("blobs/")),
                 lambda: list(store.temp_files()),
                 lambda: store.delete_temp("blobs/aa/.tmp-x-obj"),
                 lambda: store.delete_temp("blobs/ab/.tmp-old")):
        with pytest.raises(StoreError, match="symbolic link"):
            call()
    assert (outside / ".tmp-old").read_bytes() == b"x"
    with pytest.raises(StoreError, match="not a temp file"):
        store.delete_temp("../outside/.tmp-old")
    assert [i.key for i in store.list("blobs/aa/r")] == ["blobs/aa/real"]  # links elsewhere


def test_a_save_never_writes_through_a_linked_folder(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    with ckptstore.CheckpointStore(tmp_path / "repo") as repo:
        os.symlink(outside, tmp_path / "repo" / "blobs")
        with pytest.raises(StoreError, match="symbolic link 'blobs'"):
            repo.save("a", _state())
        assert list(outside.iterdir()) == []
        assert repo.names() == []


def test_the_root_itself_may_be_a_link(tmp_path: Path) -> None:
    real = tmp_path / "disk2" / "repo"
    real.mkdir(parents=True)
    os.symlink(real, tmp_path / "repo")
    with ckptstore.CheckpointStore(tmp_path / "repo") as repo:
        repo.save("a", _state())
        assert repo.load("a")["step"] == 3
    assert (real / "checkpoints" / "a.json").is_file()
    store = LocalStore(tmp_path / "repo")
    store.put("x/y", b"1")
    assert store.get("x/y") == b"1" and [i.key for i in store.list("x/")] == ["x/y"]
    store.delete("x/y")
    assert not store.exists("x/y")


# ------------------------------------------------------------------ CKPT_DEBUG
def _ckpt(*args: str, debug: str | None) -> subprocess.CompletedProcess[str]:
    script = Path(sysconfig.get_path("scripts")) / "ckpt"
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "ckptstore.cli"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("CKPT_DEBUG", None)
    if debug is not None:
        env["CKPT_DEBUG"] = debug
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def repo_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    uri = str(tmp_path_factory.mktemp("debug") / "repo")
    with ckptstore.CheckpointStore(uri) as repo:
        repo.save("a", _state())
    return uri


@pytest.mark.parametrize("case", ["no-repo", "no-checkpoint", "bad-name"])
def test_ckpt_debug_adds_a_traceback_and_keeps_the_exit_code(repo_uri: str, case: str) -> None:
    args = {"no-repo": ("ls", repo_uri + "-missing"),
            "no-checkpoint": ("show", repo_uri, "nope"),
            "bad-name": ("rm", repo_uri, "../x")}[case]
    plain, debug, off = (_ckpt(*args, debug=d) for d in (None, "1", "0"))
    assert plain.returncode == debug.returncode == off.returncode == 2
    assert "Traceback" not in plain.stderr and "Traceback" not in off.stderr
    assert "Traceback (most recent call last)" in debug.stderr
    # the same one-line message ends the debug output
    assert debug.stderr.strip().splitlines()[-1] == plain.stderr.strip()
    assert plain.stdout == debug.stdout == ""


def test_ckpt_debug_in_process_returns_the_code(repo_uri: str, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CKPT_DEBUG", "1")
    assert main(["show", repo_uri, "nope", "--json"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("ckpt: error: ")


# ------------------------------------------------------------------ cannot create a repository
def _sysfs_dir() -> Path:
    if not Path("/sys/kernel").is_dir():
        pytest.skip("no /sys here")
    return Path("/sys")


def test_creating_a_repository_where_mkdir_is_refused(tmp_path: Path) -> None:
    # sysfs refuses new folders even to root: an honest "not allowed here"
    target = _sysfs_dir() / f"ckptstore-test-{uuid.uuid4().hex[:8]}" / "repo"
    with pytest.raises(StoreAccessError) as info:
        ckptstore.CheckpointStore(target)
    err = info.value
    assert isinstance(err, PermissionError) and isinstance(err, StoreError)
    assert err.errno in (errno.EPERM, errno.EACCES, errno.EROFS)
    assert str(err).startswith(f"cannot create the store folder {target} (mkdir ")
    assert not target.parent.exists()


def test_creating_a_repository_in_a_folder_that_refuses_files() -> None:
    # an existing folder where no file may be created (sysfs): the marker write fails
    target = _sysfs_dir() / "kernel"
    with pytest.raises(StoreAccessError, match=f"cannot create a temp file for {target}/") as info:
        ckptstore.CheckpointStore(target)
    assert isinstance(info.value, PermissionError)


@pytest.mark.parametrize("case", ["parent-is-a-file", "root-is-a-file", "under-proc"])
def test_creating_a_repository_where_the_path_cannot_be_a_folder(tmp_path: Path,
                                                                 case: str) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"")
    target, reason, code = {
        "parent-is-a-file": (a_file / "repo", "a part of the path is a file, not a folder",
                             errno.ENOTDIR),
        "root-is-a-file": (a_file, "it exists and is not a folder", errno.EEXIST),
        "under-proc": (Path(f"/proc/ckptstore-test-{uuid.uuid4().hex[:8]}/repo"),
                       "No such file or directory", errno.ENOENT),
    }[case]
    with pytest.raises(StoreError) as info:
        ckptstore.CheckpointStore(target)
    assert str(info.value) == f"cannot create the store folder {target} " \
                              f"(mkdir {info.value.__cause__.filename}): {reason}"  # type: ignore[union-attr]
    assert info.value.errno == code


def test_a_read_only_file_system_is_an_access_error(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # no read-only mount can be made here: the system's EROFS reply is stood in for
    def refuse(self: Path, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(StoreAccessError, match="Read-only file system") as info:
        LocalStore(tmp_path / "repo")
    assert isinstance(info.value, PermissionError) and info.value.errno == errno.EROFS


def test_ckpt_reports_a_repository_it_cannot_create(repo_uri: str, tmp_path: Path) -> None:
    target = f"{_sysfs_dir()}/ckptstore-test-{uuid.uuid4().hex[:8]}/copy"
    r = _ckpt("cp", repo_uri, target, "a", debug=None)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"ckpt: error: cannot create the store folder {target} "
                               f"(mkdir {os.path.dirname(target)}): ")
    assert len(r.stderr.splitlines()) == 1
