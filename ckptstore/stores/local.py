"""A folder on a POSIX file system.

Durability: `put` writes a temp file in the target folder, fsyncs it and renames it into place;
the folder entries are fsynced by `sync()` (once per folder, not once per blob). `create` fsyncs
the file, links it create-only into place (link fails if the name exists) and fsyncs the folder
before it returns. A failed fsync raises DurabilityError and is never retried: Linux may have
dropped the dirty pages, so a retry could "succeed" over lost data.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import DurabilityError, ObjectExistsError, ObjectNotFoundError, StoreError
from ..hashing import new_hasher
from ..names import validate_key, validate_prefix
from .base import Buffer, ObjectInfo, Store, check_range, short_read

TEMP_PREFIX = ".tmp-"
# read and hash in pieces of this size: each is hashed while still in the CPU cache
HASH_STEP = 1 << 20


def _fsync(fd: int, what: str) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        raise DurabilityError(f"fsync of {what} failed: {exc}") from exc


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _fsync(fd, f"folder {path}")
    finally:
        os.close(fd)


class LocalStore(Store):
    """Objects are files under `root`; key 'a/b/c' is the file root/a/b/c."""

    def __init__(self, root: str | os.PathLike[str], create: bool = True) -> None:
        self.root = Path(root).absolute()
        self.uri = str(self.root)
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        elif not self.root.is_dir():
            raise ObjectNotFoundError(f"no such folder: {self.root}")
        self._dirty: set[Path] = set()
        self._lock = threading.Lock()

    # -- paths ---------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.root.joinpath(*validate_key(key).split("/"))

    def _ensure_parent(self, path: Path) -> None:
        parent = path.parent
        if parent.is_dir():
            return
        created: list[Path] = []
        p = parent
        while not p.exists() and p != self.root:
            created.append(p)
            p = p.parent
        parent.mkdir(parents=True, exist_ok=True)
        with self._lock:  # new folders need their own parents' entries synced too
            self._dirty.update(c.parent for c in created)

    def _write_temp(self, path: Path, data: Buffer) -> Path:
        """Write `data` to a fresh temp file beside `path` and fsync it."""
        self._ensure_parent(path)
        tmp = path.with_name(f"{TEMP_PREFIX}{uuid.uuid4().hex}-{path.name}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            raise StoreError(f"cannot create {tmp}: {exc}") from exc
        try:
            view = memoryview(data).cast("B")
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
            _fsync(fd, str(tmp))
        except BaseException as exc:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError) and not isinstance(exc, StoreError):
                raise StoreError(f"cannot write {tmp}: {exc}") from exc
            raise
        os.close(fd)
        return tmp

    # -- reads ---------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.uri}: no object {key!r}") from None
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc}") from exc

    def get_range(self, key: str, start: int, length: int) -> bytes:
        out = bytearray(length)
        self.read_into(key, start, memoryview(out))
        return bytes(out)

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        self._read(key, start, out, None)

    def read_into_digest(self, key: str, start: int, out: memoryview) -> str:
        hasher = new_hasher()
        self._read(key, start, out, hasher)
        return hasher.hexdigest()

    def _read(self, key: str, start: int, out: memoryview, hasher: Any) -> None:
        """Fill `out` from the file in HASH_STEP pieces, feeding each piece to `hasher` (if
        given) right after it is read, while it is still in the CPU cache."""
        check_range(key, start, len(out))
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.uri}: no object {key!r}") from None
        except OSError as exc:
            raise StoreError(f"cannot open {path}: {exc}") from exc
        try:
            view = out.cast("B") if out.format != "B" else out
            step = HASH_STEP if hasher is not None else max(len(view), 1)
            done = 0
            while done < len(view):
                piece = view[done : done + step]
                got = 0
                while got < len(piece):
                    n = os.preadv(fd, [piece[got:]], start + done + got)
                    if n == 0:
                        raise short_read(key, start, len(view), done + got)
                    got += n
                if hasher is not None:
                    hasher.update(piece)
                done += got
        except OSError as exc:
            if isinstance(exc, StoreError):
                raise
            raise StoreError(f"cannot read {path}: {exc}") from exc
        finally:
            os.close(fd)

    # -- writes --------------------------------------------------------------------------
    def put(self, key: str, data: Buffer) -> None:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"cannot rename into {path}: {exc}") from exc
        with self._lock:
            self._dirty.add(path.parent)

    def create(self, key: str, data: Buffer) -> None:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            same = path.read_bytes() == bytes(data)
            if not same:
                raise ObjectExistsError(f"{self.uri}: {key!r} exists") from None
        except OSError as exc:
            raise StoreError(f"cannot create {path}: {exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)
        self.sync()
        fsync_dir(path.parent)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StoreError(f"cannot delete {path}: {exc}") from exc
        with self._lock:
            self._dirty.add(path.parent)

    def sync(self) -> None:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        # deepest level first, so a new folder's entry is synced after its contents; the
        # folders of one level in parallel (concurrent fsyncs share journal commits)
        levels: dict[int, list[Path]] = {}
        for folder in dirty:
            levels.setdefault(len(folder.parts), []).append(folder)
        for depth in sorted(levels, reverse=True):
            folders = [f for f in levels[depth] if f.is_dir()]
            if len(folders) == 1:
                fsync_dir(folders[0])
            elif folders:
                with cf.ThreadPoolExecutor(min(8, len(folders))) as pool:
                    list(pool.map(fsync_dir, folders))

    # -- metadata ------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.uri}: no object {key!r}") from None
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        validate_prefix(prefix)
        head, _, _ = prefix.rpartition("/")
        start = self.root.joinpath(*head.split("/")) if head else self.root
        yield from self._walk(start, head + "/" if head else "", prefix)

    def _walk(self, folder: Path, key_prefix: str, prefix: str) -> Iterator[ObjectInfo]:
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            return
        except NotADirectoryError:
            return
        for entry in entries:
            if entry.name.startswith(TEMP_PREFIX):
                continue
            key = key_prefix + entry.name
            if entry.is_dir(follow_symlinks=False):
                if key.startswith(prefix) or prefix.startswith(key + "/"):
                    yield from self._walk(Path(entry.path), key + "/", prefix)
            elif entry.is_file(follow_symlinks=False) and key.startswith(prefix):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                yield ObjectInfo(key, st.st_size, st.st_mtime)

    def temp_files(self) -> Iterator[ObjectInfo]:
        """Temp files left by writers that died mid-write (for gc)."""
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith(TEMP_PREFIX):
                    path = Path(dirpath, name)
                    try:
                        st = path.stat()
                    except FileNotFoundError:
                        continue
                    rel = path.relative_to(self.root).as_posix()
                    yield ObjectInfo(rel, st.st_size, st.st_mtime)

    def delete_temp(self, rel: str) -> None:
        path = self.root / rel
        if not path.name.startswith(TEMP_PREFIX) or self.root not in path.parents:
            raise StoreError(f"not a temp file of this store: {rel!r}")
        path.unlink(missing_ok=True)


