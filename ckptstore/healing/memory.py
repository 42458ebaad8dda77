"""Memory of the tensors a receive creates: backed before the bytes arrive, in huge pages
where asked for.

A fresh optimizer has no moments, so a heal of a full state creates 2/3 of it as new tensors.
Their memory is mapped but not backed: the first write to every 4 KiB page faults and the
kernel zeroes the page (0.45-0.55 s per GiB on this VM, as much as the transfer itself).

* `populate` backs a range ahead of the transfer (MADV_POPULATE_WRITE, Linux 5.14+): the same
  faults, taken by a thread beside the ones receiving, on a core they do not use;
* `advise_huge` asks for transparent huge pages (MADV_HUGEPAGE; THP in `madvise` mode, the
  default of most distributions): one fault per 2 MiB. 0.13 s per 0.67 GiB here against
  0.45 s, when the kernel has free huge pages at hand; on this VM, whose host takes back freed
  guest memory, a huge page often has to be backed by the host first, and then it costs more
  than the small pages (0.5-2 s), so it is opt-in (`Transport(huge_pages=True)`).

Neither writes a byte: the kernel zero-fills what it backs and leaves backed pages as they
are, so both are safe beside a thread that is already receiving into the same range. Where
the call is not available (not Linux, an old kernel) nothing happens and nothing fails.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from typing import Any

import numpy as np

log = logging.getLogger("ckptstore.healing")

HUGE_PAGE = 2 << 20
#: buffers smaller than this are left alone (at most one aligned huge page would fit)
MIN_HUGE = 4 * HUGE_PAGE
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
PAGE = 4096

_madvise: Any = None


def _libc_madvise() -> Any:
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
                fn = libc.madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
                _madvise = fn
            except (OSError, AttributeError) as exc:  # pragma: no cover - exotic libc
                log.debug("live heal: no madvise (%s)", exc)
    return _madvise


def huge_range(address: int, nbytes: int) -> tuple[int, int] | None:
    """The largest range of whole, aligned huge pages inside [address, address + nbytes):
    (start, length), or None when it would be less than MIN_HUGE - HUGE_PAGE long."""
    start = (address + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    end = (address + nbytes) & ~(HUGE_PAGE - 1)
    if nbytes < MIN_HUGE or end - start < MIN_HUGE - HUGE_PAGE:
        return None
    return start, end - start


def advise_huge(buf: np.ndarray) -> bool:
    """Ask the kernel to back the untouched memory of `buf` (a new, contiguous CPU buffer)
    with huge pages; True if the advice was taken."""
    rng = huge_range(int(buf.ctypes.data), int(buf.nbytes)) if buf.size else None
    fn = _libc_madvise() if rng is not None else None
    if not fn or rng is None:
        return False
    return bool(fn(ctypes.c_void_p(rng[0]), ctypes.c_size_t(rng[1]), MADV_HUGEPAGE) == 0)


_populate_works = True


def populate(buf: np.ndarray) -> bool:
    """Back the memory of `buf` now (its content is unchanged); False when this kernel cannot
    (then later calls return False at once)."""
    global _populate_works
    fn = _libc_madvise() if _populate_works else None
    if not fn or not buf.size:
        return False
    address = int(buf.ctypes.data)
    start = address & ~(PAGE - 1)
    end = address + int(buf.nbytes)
    if fn(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_POPULATE_WRITE) != 0:
        _populate_works = False
        log.debug("live heal: MADV_POPULATE_WRITE unavailable (errno %d)", ctypes.get_errno())
        return False
    return True
