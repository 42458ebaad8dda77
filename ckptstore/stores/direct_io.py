"""A local folder whose large blobs are written with O_DIRECT (the writer process's store).

A buffered write(2) copies every byte into the page cache (a read and a write of memory by
the kernel, plus page allocation and, later, reclaim): about 1 s of CPU per 480 MiB here, on
the core and the memory bus a training step beside the save shares. With O_DIRECT the device
reads the caller's buffer itself. `DirectLocalStore` is a LocalStore (same temp file, fsync,
rename and folder fsyncs) whose file bodies go out that way when they can:

* only bodies of at least DIRECT_MIN_BYTES whose buffer starts on a page boundary (the
  writer process's shared slots are page-aligned mappings) are written direct; the file's
  start and the body's length are rounded down to ALIGN, and the tail below one block is
  written buffered (O_DIRECT is cleared on the descriptor);
* a file system or device that refuses O_DIRECT (EINVAL, at fcntl or at the write) gets
  the rest of that body buffered, and the store stops trying (`refused` tells why).

Written bytes are the same either way; durability comes from the fsync that follows, as for
every LocalStore put. A trade-off: blobs written direct are not left in the page cache, so
a restore right after a save reads them from the device.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading

import numpy as np

from .local import LocalStore, write_all

#: alignment of the buffer, the file offset and the length of a direct write: the page size
#: (a multiple of every logical block size Linux file systems use on 4 KiB-page machines)
ALIGN = 4096
#: bodies smaller than this are written buffered: a direct write waits for the device, which
#: costs more than the copy it saves for a few KiB
DIRECT_MIN_BYTES = 1 << 20


def _set_direct(fd: int, on: bool) -> None:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)


def direct_eligible(view: memoryview) -> bool:
    """Whether a body may go out direct: large enough, and starting on a page boundary."""
    if len(view) < DIRECT_MIN_BYTES:
        return False
    address = int(np.frombuffer(view, np.uint8).ctypes.data)
    return address % ALIGN == 0


def write_direct(fd: int, view: memoryview) -> str | None:
    """Write all of `view` to the fresh, empty file `fd`: the ALIGN-multiple head with
    O_DIRECT, the rest buffered. If the kernel refuses O_DIRECT (EINVAL), what is left is
    written buffered and the reason is returned; None when the head went out direct."""
    head = len(view) - len(view) % ALIGN
    written = 0
    refused = None
    try:
        _set_direct(fd, True)
        try:
            while written < head:
                written += os.write(fd, view[written:head])
        finally:
            _set_direct(fd, False)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        refused = f"O_DIRECT refused: {exc.strerror or exc}"
    write_all(fd, view[written:])
    return refused


class DirectLocalStore(LocalStore):
    """A LocalStore whose large page-aligned bodies are written with O_DIRECT (module
    docstring). Thread-safe as LocalStore is."""

    def __init__(self, root: str | os.PathLike[str], create: bool = True) -> None:
        super().__init__(root, create=create)
        #: why O_DIRECT was given up on this store (the first refusal), or None
        self.refused: str | None = None
        #: bodies written direct (their heads) since the store was opened
        self.direct_writes = 0
        self._direct_lock = threading.Lock()

    def _write_body(self, fd: int, view: memoryview) -> None:
        if self.refused is not None or not direct_eligible(view):
            write_all(fd, view)
            return
        refused = write_direct(fd, view)
        with self._direct_lock:
            if refused is None:
                self.direct_writes += 1
            elif self.refused is None:
                self.refused = refused
