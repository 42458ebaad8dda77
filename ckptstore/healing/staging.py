"""Device tensors in a live heal: their bytes go through page-locked host slots of the store's
device seam (pipeline/device.py, pipeline/overlap.StagingPool), never through a host copy of
a whole tensor or of the whole state.

* the sender copies each row block of a device tensor (or a pack of small ones) into a slot,
  hashes it there and gives the slot back (publish time); a request for a blob copies the
  block into a slot again, waits for the copy, sends the slot's bytes and gives it back. The
  receiver checks those bytes against the digest taken at publish time, so a state that
  changed in between fails the receive instead of mixing two steps;
* the receiver reads a chunk meant for a device tensor into a slot, verifies it there, and
  only then copies it to the device (and reuses the slot once that copy completed).

One `Staging` per transport and side: its pool is pinned once and reused from step to step.
On the sender every slot in use is held against a `ByteBudget`, so the host memory of device
tensors is bounded by `budget_bytes` (a block larger than a slot, one huge row, is held
alone: the budget admits it when nothing else is held).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np

from ..pipeline.budget import ByteBudget
from ..pipeline.device import (
    CopyEvent,
    Device,
    DeviceBlock,
    copy_to_device,
    copy_to_host,
    settle,
    wait_all,
    wait_copy,
)
from ..pipeline.overlap import StagingPool

#: pieces of a staged pack start at multiples of this (device copies of aligned host memory)
ALIGN = 64


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Staging:
    """Page-locked slots of `slot_bytes` (kept, pinned once per device), and with
    `budget_bytes` a bound on the host bytes they hold at once (module docstring)."""

    def __init__(self, slot_bytes: int, budget_bytes: int | None = None) -> None:
        self.pool = StagingPool(max(1, slot_bytes))
        self.budget = ByteBudget(budget_bytes) if budget_bytes else None

    @property
    def slot_bytes(self) -> int:
        return self.pool.slot_bytes

    @property
    def slots(self) -> int:
        """How many slots the budget lets be in use at once (None: no budget, 0)."""
        if self.budget is None:
            return 0
        return max(1, self.budget.capacity // self.pool.slot_bytes)

    @property
    def peak_bytes(self) -> int:
        """Most host bytes held at once: the budget's peak, or (no budget) the pooled slots."""
        pooled = self.pool.allocated * self.pool.slot_bytes
        return max(pooled, self.budget.peak) if self.budget is not None else pooled

    @contextmanager
    def slot(self, nbytes: int, devices: Iterable[Device]) -> Iterator[np.ndarray]:
        """A flat uint8 host buffer of exactly `nbytes` (a pooled slot, page-locked for
        `devices`, when it fits one), held against the budget while the block runs."""
        hold = max(nbytes, self.pool.slot_bytes)
        with self.budget.hold(hold) if self.budget is not None else nullcontext(), \
                self.pool.buffer(nbytes, tuple(devices)) as buf:
            yield buf[:nbytes]

    def release(self) -> None:
        """Unpin the slots (call once no copy into or out of them can run any more)."""
        self.pool.pins.release()


def stage_to_host(parts: list[tuple[DeviceBlock, int]], buf: np.ndarray,
                  after: dict[str, CopyEvent], what: str) -> None:
    """Copy every device block into `buf` at its offset (after the device's mark in `after`)
    and return once every copy completed (DeviceCopyError naming `what` if one failed; no
    copy is still running into `buf` when this returns or raises)."""
    events: list[tuple[CopyEvent, str]] = []
    try:
        for block, offset in parts:
            dst = np.ndarray(block.shape, block.dtype, buf, offset)
            events.append((copy_to_host(block, dst, after.get(block.device.name), what), what))
    except BaseException:
        settle(events)
        raise
    wait_all(events)


def copy_up(src: np.ndarray, block: DeviceBlock, after: CopyEvent | None, what: str) -> None:
    """Copy verified host bytes `src` (flat uint8, `block.nbytes` of them) into device block
    `block` and return once the copy completed (the caller may then reuse `src`)."""
    host = np.ndarray(block.shape, block.dtype, src, 0)
    wait_copy(copy_to_device(block.device, host, block.tensor, None, after, what), what)


def device_parts(blocks: Iterable[Any]) -> list[tuple[DeviceBlock, int]]:
    """(block, offset) of `blocks` laid out one after another at ALIGN-ed offsets."""
    out = []
    pos = 0
    for b in blocks:
        out.append((b, pos))
        pos += aligned(b.nbytes)
    return out
