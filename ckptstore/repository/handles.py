"""What the repository hands back: the handle of a save in flight, and what a load read and a
listing shows."""

from __future__ import annotations

import builtins
import concurrent.futures as cf
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from ..concurrency import Turns
from ..pipeline.options import SaveInfo
from ..pipeline.overlap import Guard, Overlap


@dataclass(frozen=True)
class LoadInfo:
    """What the last `load` of a CheckpointStore read: stored bytes served by each tier
    (URI -> bytes, nearest first) and the blobs rewritten on a nearer tier because its copy
    was missing or corrupt there."""

    name: str
    bytes_by_tier: dict[str, int]
    repaired: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(frozen=True)
class CheckpointInfo:
    """One listed checkpoint."""

    name: str
    created: float
    metadata: dict[str, Any]
    logical_bytes: int
    tensors: int
    parent: str | None


class SaveHandle:
    """A save running in the background. `wait()` returns its SaveInfo or raises its error."""

    def __init__(self, future: cf.Future[SaveInfo], name: str,
                 overlap: Overlap | None = None, turns: Turns | None = None) -> None:
        self._future = future
        self.name = name
        self._observed = False
        self._overlap = overlap
        self._turns = turns
        self._guards: builtins.list[Guard] = []

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveInfo:
        """Block until the save has committed; return its SaveInfo or raise its error. While
        the caller blocks here its core is lent to the save (concurrency.Turns)."""
        self._observed = True
        turns = None if self._future.done() else self._turns
        try:
            with turns.lent_to_waiter() if turns is not None else nullcontext():
                return self._future.result(timeout)
        finally:
            if self._future.done():
                self.remove_guards()

    def guard(self, optimizer: Any) -> None:
        """Make `optimizer.step()` wait until this save has copied every tensor the step
        changes (its parameters and their state tensors), so that the checkpoint holds their
        values at the call. Only overlapped saves need it (`staging="overlap"`); for a save
        staged at call time, or one already finished, it does nothing. The time steps waited
        is `SaveInfo.guard_wait_seconds`. The step pre-hook is inert once the save ends and
        removed by `wait()` or the next save (from the training thread)."""
        if self._overlap is None or self._overlap.finished:
            return
        self._guards.append(Guard(self._overlap, optimizer))

    def wait_copied(self, tensors: Iterable[Any]) -> None:
        """Block until this save has copied every tensor sharing storage with one of
        `tensors`, which the caller is about to write in place (a load into them): an
        overlapped save reads them after its call, and a write that bumps no version
        counter (a load writes through raw memory) would not be seen. Nothing to wait for
        in a save staged at call time or one already finished."""
        overlap = self._overlap
        if overlap is None or overlap.finished:
            return
        pending = [e for e in overlap.events_for(tensors) if not e.is_set()]
        with self._turns.lent_to_waiter() if pending and self._turns is not None \
                else nullcontext():
            for e in pending:
                e.wait()

    def remove_guards(self) -> None:
        """Remove the step pre-hooks of `guard` (call from the thread that runs `step()`)."""
        guards, self._guards = self._guards, []
        for g in guards:
            g.remove()

    @property
    def observed(self) -> bool:
        """True once the caller has waited on this handle (and so seen any error)."""
        return self._observed

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"SaveHandle({self.name!r}, {state})"
