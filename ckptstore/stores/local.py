"""A folder on a POSIX file system.

Durability: `put` writes a temp file in the target folder, fsyncs it and renames it into place;
the folder entries are fsynced by `sync()` (once per folder, not once per blob). `create` fsyncs
the file, links it create-only into place (link fails if the name exists) and fsyncs the folder
before it returns. `deferred()` batches defer the fsyncs: each put writes its temp file
without waiting, background threads fsync the temps concurrently (concurrent fsyncs share
journal commits), and `commit()` waits for them, renames every temp into place and fsyncs the
folders. No temp file is renamed before its own fsync returned, so a final name never holds
bytes that are not durable; a crash leaves temp files, which gc removes. A failed fsync raises
DurabilityError and is never retried: Linux may have dropped the dirty pages, so a retry could
"succeed" over lost data. A failed folder fsync in `sync()` is sticky: every later `sync()` of
this store object raises too (the failed folders may have held any caller's entries). Syncs
run one at a time, so a `sync()` never returns while a concurrent one that took its folders
is still fsyncing them.

Symbolic links: the root folder may be one (users point it at another disk); nothing below it
is ever followed. Every operation walks from a descriptor of the root one folder at a time
(`openat`-style, each component opened with O_NOFOLLOW), so a link anywhere between the root
and an object (a folder such as ``blobs/ab``, or the object itself) raises StoreError naming
the key, and no read or write leaves the root, even if a link appears while we work.

Why one module: the descriptor walk (no symlinks), temp-file writes and folder
fsyncs are one protocol; every operation uses all three.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import stat
import threading
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..errors import (
    DurabilityError,
    InvalidNameError,
    ObjectExistsError,
    ObjectNotFoundError,
    StoreAccessError,
    StoreError,
)
from ..format.hashing import new_hasher
from ..format.names import validate_key, validate_prefix
from ..redact import has_scheme, redact_uri
from .base import Buffer, DeferredPuts, ObjectInfo, Store, check_range, short_read

TEMP_PREFIX = ".tmp-"
# read and hash in pieces of this size: each is hashed while still in the CPU cache
HASH_STEP = 1 << 20

_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # the root may be a link
_DIR_FLAGS = _ROOT_FLAGS | os.O_NOFOLLOW
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC
_ACCESS_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
_FSYNC_THREADS = 4  # per store, for its deferred batches: fsyncs wait on the disk, not a core


def _fs_error(exc: OSError, message: str, reason: str | None = None) -> StoreError:
    """The StoreError for a failed file system call, as '<message>: <reason>' (default: the
    system's): StoreAccessError (also a PermissionError) when access was refused or the file
    system is read-only. Keeps the system's errno."""
    cls = StoreAccessError if exc.errno in _ACCESS_ERRNOS else StoreError
    err = cls(f"{message}: {reason or exc.strerror or exc}")
    err.errno = exc.errno
    return err


def _fsync(fd: int, what: str) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        raise DurabilityError(f"fsync of {what} failed: {exc}") from exc


def write_all(fd: int, view: memoryview) -> None:
    """Write all of `view` at the descriptor's position (loops over short writes)."""
    written = 0
    while written < len(view):
        written += os.write(fd, view[written:])


def _fsync_folders(dirty: set[Path]) -> None:
    """fsync these folders: deepest level first, so a new folder's entry is synced after its
    contents; the folders of one level in parallel (concurrent fsyncs share journal
    commits)."""
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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _fsync(fd, f"folder {path}")
    finally:
        os.close(fd)


def _unlink_quietly(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


class LocalStore(Store):
    """Objects are files under `root`; key 'a/b/c' is the file root/a/b/c."""

    def __init__(self, root: str | os.PathLike[str], create: bool = True) -> None:
        if isinstance(root, str) and has_scheme(root):
            raise InvalidNameError(f"LocalStore takes a folder path, not a URL: "
                                   f"{redact_uri(root)!r} (open URIs with open_store)")
        self.root = Path(root).absolute()
        self.uri = str(self.root)
        if create:
            self._make_root()
        elif not self.root.is_dir():
            raise ObjectNotFoundError(f"no such folder: {self.root}")
        self._dirty: set[Path] = set()
        self._lock = threading.Lock()
        self._sync_turn = threading.Lock()  # syncs run one at a time (module docstring)
        self._sync_failed: str | None = None  # the first failed folder fsync, sticky
        self._fsyncs: cf.ThreadPoolExecutor | None = None  # deferred batches' fsyncs (lazy)

    def _make_root(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            failed = f"mkdir {exc.filename}" if exc.filename else "mkdir"
            reason = {errno.EEXIST: "it exists and is not a folder",
                      errno.ENOTDIR: "a part of the path is a file, not a folder"}
            raise _fs_error(exc, f"cannot create the store folder {self.root} ({failed})",
                            reason.get(exc.errno or 0)) from exc

    # -- paths: walked from the root, never following a link -------------------------------
    def _show(self, key: str) -> str:
        return f"{self.uri}/{key}"

    def _link_error(self, link: str, key: str) -> StoreError:
        where = repr(link) if link == key else f"{link!r} on the way to {key!r}"
        return StoreError(f"{self.uri}: refusing to follow the symbolic link {where} (only "
                          "the store folder itself may be a link)")

    def _open_root(self, create: bool) -> int | None:
        """A descriptor of the root; None if it is missing (made first if `create`)."""
        try:
            return os.open(self.root, _ROOT_FLAGS)
        except FileNotFoundError:
            if not create:
                return None
        except OSError as exc:
            raise _fs_error(exc, f"cannot open the store folder {self.root}") from exc
        self._make_root()
        try:
            return os.open(self.root, _ROOT_FLAGS)
        except OSError as exc:
            raise _fs_error(exc, f"cannot open the store folder {self.root}") from exc

    def _open_folder(self, key: str, parts: list[str], create: bool) -> int | None:
        """A descriptor of the folder root/parts[0]/.../parts[-1]. Missing folders are made
        if `create`, else None is returned (also when a file stands where a folder should).
        A link on the way raises StoreError naming `key`."""
        fd, start = None, 0
        if parts:  # fast path: the first folder by its path (the root may be a link)
            try:
                fd, start = os.open(self.root / parts[0], _DIR_FLAGS), 1
            except OSError:
                pass  # the walk below says why, precisely
        if fd is None:
            fd = self._open_root(create)
        for depth, name in enumerate(parts[start:], start):
            if fd is None:
                return None
            parent = fd
            try:
                fd = self._open_child(parent, name, "/".join(parts[: depth + 1]), key, create)
            finally:
                os.close(parent)
        return fd

    def _open_child(self, fd: int, name: str, rel: str, key: str, create: bool) -> int | None:
        """Open the folder `name` in folder `fd` (whose key is `rel`) without following it."""
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                return None
        except OSError as exc:
            self._child_failed(fd, name, rel, key, exc, create)
            return None
        try:
            os.mkdir(name, 0o755, dir_fd=fd)
        except FileExistsError:
            pass  # made by another writer meanwhile
        except OSError as exc:
            raise _fs_error(exc, f"cannot create folder {self._show(rel)}") from exc
        else:
            with self._lock:  # a new folder's entry in its parent needs syncing too
                self._dirty.add(self.root.joinpath(*rel.split("/")[:-1]))
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            self._child_failed(fd, name, rel, key, exc, create)
            return None

    def _child_failed(self, fd: int, name: str, rel: str, key: str, exc: OSError,
                      create: bool) -> None:
        """Raise why a folder on the way did not open: a link (O_NOFOLLOW with O_DIRECTORY
        says ENOTDIR or ELOOP) or the system's reason. Returns if a file stands there and
        this is a read (the key is then simply missing)."""
        try:
            is_link = stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
        except OSError:
            is_link = False
        if is_link:
            raise self._link_error(rel, key) from None
        if exc.errno == errno.ENOTDIR and not create:
            return None
        raise _fs_error(exc, f"cannot open folder {self._show(rel)}") from exc

    def _parent(self, key: str, create: bool = False) -> tuple[int | None, str]:
        """(descriptor of the folder holding `key` or None if missing, last key part)."""
        parts = validate_key(key).split("/")
        return self._open_folder(key, parts[:-1], create), parts[-1]

    def _writable_parent(self, key: str) -> tuple[int, str]:
        fd, name = self._parent(key, create=True)
        assert fd is not None  # create=True makes every folder or raises
        return fd, name

    def _folder_path(self, key: str) -> Path:
        return self.root.joinpath(*key.split("/")[:-1])

    def _lstat(self, dir_fd: int, name: str, key: str) -> os.stat_result | None:
        """The entry itself (None if missing); StoreError if it is a link."""
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _fs_error(exc, f"cannot stat {self._show(key)}") from exc
        if stat.S_ISLNK(st.st_mode):
            raise self._link_error(key, key)
        return st

    def _open_object(self, key: str, flags: int) -> int:
        """Open the object's file without following a link anywhere."""
        dir_fd, name = self._parent(key)
        if dir_fd is None:
            raise ObjectNotFoundError(f"{self.uri}: no object {key!r}")
        try:
            return os.open(name, flags | _FILE_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.uri}: no object {key!r}") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
                raise self._link_error(key, key) from None
            raise _fs_error(exc, f"cannot open {self._show(key)}") from exc
        finally:
            os.close(dir_fd)

    def _write_temp(self, dir_fd: int, key: str, name: str, data: Buffer) -> str:
        """Write `data` to a fresh temp file beside `name` in folder `dir_fd`, fsync it, and
        return the temp file's name."""
        tmp, fd = self._write_temp_unsynced(dir_fd, key, name, data)
        try:
            _fsync(fd, f"a temp file for {self._show(key)}")
        except BaseException:
            _unlink_quietly(dir_fd, tmp)
            raise
        finally:
            os.close(fd)
        return tmp

    def _write_temp_unsynced(self, dir_fd: int, key: str, name: str, data: Buffer
                             ) -> tuple[str, int]:
        """Write `data` to a fresh temp file beside `name`; return its name and its still
        open descriptor (not fsynced: the caller fsyncs and closes it)."""
        tmp = f"{TEMP_PREFIX}{uuid.uuid4().hex}-{name}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_FLAGS, 0o644,
                         dir_fd=dir_fd)
        except OSError as exc:
            raise _fs_error(exc, f"cannot create a temp file for {self._show(key)}") from exc
        try:
            self._write_body(fd, memoryview(data).cast("B"))
        except BaseException as exc:
            os.close(fd)
            _unlink_quietly(dir_fd, tmp)
            if isinstance(exc, OSError) and not isinstance(exc, StoreError):
                raise _fs_error(exc, f"cannot write {self._show(key)}") from exc
            raise
        return tmp, fd

    def _rename_into_place(self, dir_fd: int, key: str, name: str, tmp: str) -> None:
        """Rename the (durable) temp file `tmp` over `name`; a link in its place is refused.
        The temp file is removed if that fails."""
        try:
            self._lstat(dir_fd, name, key)  # a link in the object's place is refused
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException as exc:
            _unlink_quietly(dir_fd, tmp)
            if isinstance(exc, OSError) and not isinstance(exc, StoreError):
                raise _fs_error(exc, f"cannot rename into {self._show(key)}") from exc
            raise

    def _write_body(self, fd: int, view: memoryview) -> None:
        """Write all of `view` to the fresh temp file `fd` (stores/direct_io.py overrides)."""
        write_all(fd, view)

    # -- reads ---------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        fd = self._open_object(key, os.O_RDONLY)
        try:
            with open(fd, "rb", buffering=0, closefd=False) as f:
                return f.readall()
        except OSError as exc:
            raise _fs_error(exc, f"cannot read {self._show(key)}") from exc
        finally:
            os.close(fd)

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
        fd = self._open_object(key, os.O_RDONLY)
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
            raise _fs_error(exc, f"cannot read {self._show(key)}") from exc
        finally:
            os.close(fd)

    # -- writes --------------------------------------------------------------------------
    def put(self, key: str, data: Buffer) -> None:
        dir_fd, name = self._writable_parent(key)
        try:
            self._rename_into_place(dir_fd, key, name, self._write_temp(dir_fd, key, name, data))
        finally:
            os.close(dir_fd)
        with self._lock:
            self._dirty.add(self._folder_path(key))

    def note_written(self, keys: Iterable[str]) -> None:
        """Objects under these keys were written into this folder by another handle (a
        writer process that has ended): the next `sync()` makes their folders durable too,
        as if this store had written them."""
        folders = {self._folder_path(validate_key(k)) for k in keys}
        with self._lock:
            self._dirty |= folders

    def deferred(self) -> DeferredPuts:
        """Puts written to temp files at once and fsynced in the background (concurrent
        fsyncs share journal commits); `commit()` waits for those fsyncs, then renames each
        temp into place and fsyncs the folders. A temp file is renamed only after its own
        fsync returned, so a final name never holds bytes that are not durable. The store's
        batches share one pool of fsync threads, made on first use, ended by `close()`."""
        return _LocalDeferredPuts(self)

    def _fsync_in_background(self, fd: int, what: str) -> cf.Future[None]:
        """fsync and close `fd` on the store's fsync pool (closes it at once if that fails)."""
        with self._lock:
            if self._fsyncs is None:
                self._fsyncs = cf.ThreadPoolExecutor(_FSYNC_THREADS,
                                                     thread_name_prefix="ckptstore-fsync")
            try:
                return self._fsyncs.submit(_fsync_and_close, fd, what)
            except BaseException:
                os.close(fd)
                raise

    def close(self) -> None:
        """End the fsync pool (after the fsyncs already handed to it)."""
        with self._lock:
            pool, self._fsyncs = self._fsyncs, None
        if pool is not None:
            pool.shutdown(wait=True)

    def create(self, key: str, data: Buffer) -> None:
        dir_fd, name = self._writable_parent(key)
        try:
            tmp = self._write_temp(dir_fd, key, name, data)
            try:
                os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            except FileExistsError:
                if self._read_existing(dir_fd, name, key) != bytes(data):
                    raise ObjectExistsError(f"{self.uri}: {key!r} exists") from None
            except OSError as exc:
                if isinstance(exc, StoreError):
                    raise
                raise _fs_error(exc, f"cannot create {self._show(key)}") from exc
            finally:
                _unlink_quietly(dir_fd, tmp)
            self.sync()
            _fsync(dir_fd, f"folder of {self._show(key)}")
        finally:
            os.close(dir_fd)

    def _read_existing(self, dir_fd: int, name: str, key: str) -> bytes:
        """The bytes of an object that `create` found in place (a link is refused)."""
        try:
            fd = os.open(name, os.O_RDONLY | _FILE_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._link_error(key, key) from None
            raise _fs_error(exc, f"cannot read {self._show(key)}") from exc
        try:
            with open(fd, "rb", buffering=0, closefd=False) as f:
                return f.readall()
        finally:
            os.close(fd)

    def delete(self, key: str) -> None:
        dir_fd, name = self._parent(key)
        if dir_fd is None:
            return
        try:
            if self._lstat(dir_fd, name, key) is None:
                return
            os.unlink(name, dir_fd=dir_fd)
        except StoreError:
            raise
        except FileNotFoundError:
            return
        except OSError as exc:
            raise _fs_error(exc, f"cannot delete {self._show(key)}") from exc
        finally:
            os.close(dir_fd)
        with self._lock:
            self._dirty.add(self._folder_path(key))

    def sync(self) -> None:
        with self._sync_turn:
            if self._sync_failed is not None:
                raise DurabilityError(f"an earlier folder fsync of {self.uri} failed "
                                      f"({self._sync_failed}); writes since may not be "
                                      "durable: check the disk, then open the store again")
            with self._lock:
                dirty, self._dirty = self._dirty, set()
            try:
                _fsync_folders(dirty)
            except DurabilityError as exc:
                self._sync_failed = str(exc)
                raise

    # -- metadata ------------------------------------------------------------------------
    def _stat(self, key: str) -> os.stat_result | None:
        dir_fd, name = self._parent(key)
        if dir_fd is None:
            return None
        try:
            return self._lstat(dir_fd, name, key)
        finally:
            os.close(dir_fd)

    def exists(self, key: str) -> bool:
        st = self._stat(key)
        return st is not None and stat.S_ISREG(st.st_mode)

    def stat(self, key: str) -> ObjectInfo:
        st = self._stat(key)
        if st is None:
            raise ObjectNotFoundError(f"{self.uri}: no object {key!r}")
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        validate_prefix(prefix)
        head, _, _ = prefix.rpartition("/")
        fd = self._open_folder(prefix, head.split("/") if head else [], create=False)
        if fd is not None:
            yield from self._scan(fd, head + "/" if head else "", prefix, temps=False)

    def _scan(self, fd: int, key_prefix: str, prefix: str, temps: bool) -> Iterator[ObjectInfo]:
        """The objects (or with `temps`, the temp files) whose key starts with `prefix` in
        folder `fd` (key `key_prefix`) and below; a link among them raises. Closes `fd`."""
        try:
            with os.scandir(fd) as it:
                entries = list(it)
            for entry in entries:
                is_temp = entry.name.startswith(TEMP_PREFIX)
                if is_temp and not temps:
                    continue  # a write in progress, not an object
                key = key_prefix + entry.name
                if not (key.startswith(prefix) or prefix.startswith(key + "/")):
                    continue
                if entry.is_symlink():
                    raise self._link_error(key, key)
                if entry.is_dir(follow_symlinks=False):
                    child = self._open_child(fd, entry.name, key, key, create=False)
                    if child is not None:
                        yield from self._scan(child, key + "/", prefix, temps)
                elif entry.is_file(follow_symlinks=False) and is_temp == temps \
                        and key.startswith(prefix):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    yield ObjectInfo(key, st.st_size, st.st_mtime)
        finally:
            os.close(fd)

    def temp_files(self) -> Iterator[ObjectInfo]:
        """Temp files left by writers that died mid-write (for gc)."""
        fd = self._open_root(create=False)
        if fd is not None:
            yield from self._scan(fd, "", "", temps=True)

    def delete_temp(self, rel: str) -> None:
        try:
            is_temp = validate_key(rel).rpartition("/")[2].startswith(TEMP_PREFIX)
        except InvalidNameError:
            is_temp = False
        if not is_temp:
            raise StoreError(f"not a temp file of this store: {rel!r}")
        self.delete(rel)


class _LocalDeferredPuts(DeferredPuts):
    """LocalStore.deferred(): temp files fsynced in the background, renamed at commit."""

    def __init__(self, store: LocalStore) -> None:
        super().__init__(store)
        self._local = store
        self._lock = threading.Lock()
        # (key, temp name, the temp's fsync): renamed into place by the next commit
        self._pending: list[tuple[str, str, cf.Future[None]]] = []

    def put(self, key: str, data: Buffer) -> None:
        store = self._local
        dir_fd, name = store._writable_parent(key)
        try:
            tmp, fd = store._write_temp_unsynced(dir_fd, key, name, data)
        finally:
            os.close(dir_fd)
        done = store._fsync_in_background(fd, f"a temp file for {store._show(key)}")
        with self._lock:
            self._pending.append((key, tmp, done))

    def commit(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        try:
            for _, _, done in pending:  # every temp durable before any rename
                done.result()
        except BaseException:
            self._remove(pending)
            raise
        for i, (key, tmp, _) in enumerate(pending):
            dir_fd, name = self._local._writable_parent(key)
            try:
                self._local._rename_into_place(dir_fd, key, name, tmp)
            except BaseException:
                self._remove(pending[i + 1 :])
                raise
            finally:
                os.close(dir_fd)
            with self._local._lock:
                self._local._dirty.add(self._local._folder_path(key))
        self._local.sync()

    def abandon(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        self._remove(pending)

    def _remove(self, pending: list[tuple[str, str, cf.Future[None]]]) -> None:
        """Remove these temp files (after their fsyncs ended: those close the descriptors)."""
        cf.wait([done for _, _, done in pending])
        for key, tmp, _ in pending:
            dir_fd, _name = self._local._parent(key)
            if dir_fd is not None:
                try:
                    _unlink_quietly(dir_fd, tmp)
                finally:
                    os.close(dir_fd)


def _fsync_and_close(fd: int, what: str) -> None:
    try:
        _fsync(fd, what)
    finally:
        os.close(fd)
