"""Staging for asynchronous saves: copy the state's arrays into one reusable arena so the caller
may change its tensors as soon as staging returns. The arena is kept and reused by the next
save when it is large enough (no page faults on the hot path after the first save).

Tensors on a device reach the arena through a few page-locked bounce slots the arena keeps
(BOUNCE_SLOTS of BOUNCE_BYTES, pinned once): each piece is copied from the device into a
slot, and once that copy's event completed, from the slot into the arena; several copies are
in flight at once. Staging returns when every byte is in the arena (the caller may then
change anything), so its stall includes the device copies: `staging="overlap"` is the mode
whose call returns before copying."""

from __future__ import annotations

import concurrent.futures as cf
from collections import deque

import numpy as np

from ..format.leaf import ArrayLeaf
from .device import (
    CopyEvent,
    DeviceBlock,
    Pins,
    block_of,
    copy_to_host,
    host_buffer,
    marks_for,
    on_device,
    settle,
    wait_copy,
)

ALIGN = 64
SPLIT_BYTES = 32 << 20  # copies larger than this are split across threads
#: arrays smaller than this are copied in the staging loop itself: a thread-pool task costs
#: more than copying a few KiB (20,000 small tensors: seconds of `submit` for 0.1 s of copies)
POOL_MIN_BYTES = 1 << 20
#: device tensors are staged through this many page-locked slots of BOUNCE_BYTES each
BOUNCE_SLOTS = 4
BOUNCE_BYTES = 16 << 20

Copy = tuple[np.ndarray, np.ndarray]  # (destination, source)


class StagingArena:
    """Owns one byte arena. Not thread-safe: one staging at a time (the repository ensures the
    previous save finished before staging the next)."""

    def __init__(self, workers: int = 4) -> None:
        self._arena = np.empty(0, np.uint8)
        self.workers = workers
        self._bounce: list[np.ndarray] = []  # page-locked slots for device copies (kept)
        self.pins = Pins()

    def __del__(self) -> None:
        self.pins.release()

    @property
    def capacity(self) -> int:
        return self._arena.nbytes

    def stage(self, leaves: list[ArrayLeaf]) -> list[ArrayLeaf]:
        """Return leaves whose arrays are copies in the arena (valid until the next stage)."""
        offsets = []
        total = 0
        for leaf in leaves:
            offsets.append(total)
            total += -(-leaf.nbytes // ALIGN) * ALIGN
        if total > self._arena.nbytes:
            self._arena = np.empty(total, np.uint8)
        arena = self._arena
        native: dict[np.dtype, np.dtype] = {}
        staged: list[ArrayLeaf] = []
        large: list[Copy] = []
        on_devices: list[tuple[np.ndarray, DeviceBlock, str]] = []
        for leaf, off in zip(leaves, offsets):
            src = leaf.array
            if on_device(src):
                dst = np.ndarray(src.shape, src.dtype, arena, off)
                on_devices.append((dst, block_of(src), leaf.key))
                staged.append(leaf.with_array(dst))
                continue
            dt = native.get(src.dtype)
            if dt is None:
                dt = native[src.dtype] = src.dtype.newbyteorder("=")
            dst = np.ndarray(src.shape, dt, arena, off)  # C-contiguous view of the arena
            if src.nbytes >= POOL_MIN_BYTES:
                large.extend(_split(dst, src))
            elif src.size:
                np.copyto(dst, src)  # small: here and now, cheaper than any task
            staged.append(leaf.with_array(dst))
        self._copy_large(large)
        if on_devices:
            self._copy_from_devices(on_devices)
        return staged

    def _copy_from_devices(self, copies: list[tuple[np.ndarray, DeviceBlock, str]]) -> None:
        """Fill the arena views from their device tensors through the bounce slots (module
        docstring); returns once every byte is in the arena."""
        marks = marks_for(src for _dst, src, _key in copies)
        pieces = [(*piece, key) for dst, src, key in copies
                  for piece in _device_pieces(dst, src)]
        free = list(range(BOUNCE_SLOTS))
        inflight: deque[tuple[CopyEvent, str, int, np.ndarray, np.ndarray]] = deque()

        def land() -> None:  # the oldest copy: wait for it, then slot -> arena
            event, what, k, view, dst = inflight.popleft()
            wait_copy(event, what)
            np.copyto(dst, view)
            free.append(k)

        try:
            for dst, src, key in pieces:
                device = src.device
                what = f"{key}: the copy from {device.name} to host memory"
                after = marks.get(device.name)
                if dst.nbytes > BOUNCE_BYTES:  # one row larger than a slot: straight in
                    wait_copy(copy_to_host(src, dst, after, what), what)
                    continue
                if not free:
                    land()
                k = free.pop()
                slot = self._slot(k)
                self.pins.ensure(slot, (device,))
                view = np.ndarray(dst.shape, dst.dtype, slot, 0)
                event = copy_to_host(src, view, after, what)
                inflight.append((event, what, k, view, dst))
            while inflight:
                land()
        except BaseException:
            settle((event, what) for event, what, *_rest in inflight)
            raise

    def _slot(self, k: int) -> np.ndarray:
        while len(self._bounce) <= k:
            self._bounce.append(host_buffer(BOUNCE_BYTES))
        return self._bounce[k]

    def _copy_large(self, copies: list[Copy]) -> None:
        """Run the large copies, on a thread pool when there are several."""
        if len(copies) > 1 and self.workers > 1:
            with cf.ThreadPoolExecutor(self.workers, thread_name_prefix="ckpt-stage") as pool:
                list(pool.map(lambda pair: np.copyto(pair[0], pair[1]), copies))
        else:
            for dst, src in copies:
                np.copyto(dst, src)


def _device_pieces(dst: np.ndarray, src: DeviceBlock) -> list[tuple[np.ndarray, DeviceBlock]]:
    """(arena view, device block) pieces of at most BOUNCE_BYTES (whole rows; one row may be
    larger)."""
    shape = src.shape
    if not shape or src.nbytes <= BOUNCE_BYTES:
        return [(dst, src)]
    row = src.nbytes // shape[0] if shape[0] else 0
    step = max(1, BOUNCE_BYTES // row) if row else shape[0]
    return [(dst[a : a + step], src[a : a + step]) for a in range(0, shape[0], step)]


def _split(dst: np.ndarray, src: np.ndarray) -> list[Copy]:
    """One copy, or row blocks of about SPLIT_BYTES for copies larger than that."""
    if not src.ndim or src.nbytes <= SPLIT_BYTES:
        return [(dst, src)]
    step = max(1, src.shape[0] * SPLIT_BYTES // src.nbytes)
    return [(dst[a : a + step], src[a : a + step]) for a in range(0, src.shape[0], step)]
