"""Resumable state: small, versioned, tied to the dataset's fingerprint, JSON-able.

A state is a dict of str/int/bool/lists of ints (no numpy objects, nothing pickled), so it can
be saved as JSON or inside a ckptstore checkpoint. It records *where the epoch stands*, not
what workers hold: (epoch, consumed intervals folded in so far, world size and balance mode
of the run that made it, items each rank has delivered since). See order/epoch.py for why that is
enough to resume exactly, also on another number of ranks or workers.

A state is untrusted input: `from_state` checks every field against the dataset it is loaded
into (exact int types, world_size within MAX_WORLD_SIZE, rank within world_size, `base` sorted,
disjoint and inside the epoch, `consumed` at most one rank's share of it) and raises
StateMismatchError (a ValueError) naming the field. Nothing is sized from a value before it
has passed its check.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import StateMismatchError
from ..format.validate import INT64_MAX, check_int, is_int, short_repr
from ..order.epoch import BALANCE, MAX_WORLD_SIZE, merge_intervals, rank_plan

STATE_FORMAT = "ckptstore.dataloader.state"
STATE_VERSION = 1


@dataclass(frozen=True)
class Progress:
    """Position in one epoch: `consumed` items per rank delivered after `base` (intervals of
    the epoch's global order already consumed before this run of `world_size` ranks)."""

    epoch: int
    base: np.ndarray
    world_size: int
    balance: str
    consumed: int

    def with_consumed(self, consumed: int) -> Progress:
        return Progress(self.epoch, self.base, self.world_size, self.balance, consumed)


def fresh(epoch: int, world_size: int, balance: str) -> Progress:
    return Progress(epoch, np.zeros((0, 2), dtype=np.int64), world_size, balance, 0)


def to_state(
    kind: str, fingerprint: str, order: dict[str, Any], progress: Progress, rank: int, **extra: Any
) -> dict[str, Any]:
    return {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "kind": kind,
        "fingerprint": fingerprint,
        "order": dict(order),
        "epoch": int(progress.epoch),
        "base": [[int(a), int(b)] for a, b in merge_intervals(progress.base)],
        "world_size": int(progress.world_size),
        "balance": progress.balance,
        "consumed": int(progress.consumed),
        "rank": int(rank),
        **extra,
    }


def _int(state: Mapping[str, Any], key: str, lo: int = 0, hi: int = INT64_MAX) -> int:
    return check_int(state.get(key), f"dataloader state: {key!r}", lo, hi, StateMismatchError)


def check_header(state: Any, kinds: tuple[str, ...]) -> Mapping[str, Any]:
    """`state` as a mapping if it is a dataloader state of a supported version and kind."""
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        raise StateMismatchError("not a dataloader state (missing format marker)")
    version = state.get("version")
    if not is_int(version) or version != STATE_VERSION:
        raise StateMismatchError(
            f"dataloader state version {short_repr(version)} is not supported"
            f" (want {STATE_VERSION})"
        )
    kind = state.get("kind")
    if not isinstance(kind, str) or kind not in kinds:
        raise StateMismatchError(
            f"dataloader state of kind {short_repr(kind)}, expected one of {kinds}"
        )
    return state


def from_state(
    state: Any,
    kinds: tuple[str, ...],
    fingerprint: str,
    order: dict[str, Any],
    epoch_items: Callable[[int], int],
) -> Progress:
    """Validate a state for this dataset/configuration and return its Progress.
    `epoch_items(epoch)` is the number of items in the dataset's epoch `epoch`."""
    state = check_header(state, kinds)
    theirs = state.get("fingerprint")
    if not isinstance(theirs, str) or theirs != fingerprint:
        raise StateMismatchError(
            f"dataloader state belongs to dataset {short_repr(theirs)}, not to this dataset "
            f"({fingerprint}): refusing to resume from another dataset's position"
        )
    _check_order(state.get("order"), order)
    balance = state.get("balance")
    if not isinstance(balance, str) or balance not in BALANCE:
        raise StateMismatchError(f"dataloader state: bad balance {short_repr(balance)}")
    epoch = _int(state, "epoch")
    world = _int(state, "world_size", 1, MAX_WORLD_SIZE)
    _int(state, "rank", 0, world - 1)
    if "batch_size" in state:
        _int(state, "batch_size", 1)
    total = epoch_items(epoch)
    base = _base(state.get("base", []), total)
    share = rank_plan(total, base, world, 0, balance).total  # rank 0 has the largest share
    where = f"dataloader state: 'consumed' (items per rank of {world} in epoch {epoch})"
    consumed = check_int(state.get("consumed"), where, 0, share, StateMismatchError)
    return Progress(epoch, base, world, balance, consumed)


def _check_order(theirs: Any, ours: dict[str, Any]) -> None:
    """The state's ordering options must equal ours, with the same JSON types (True is not 1,
    4.0 is not 4)."""
    if not isinstance(theirs, Mapping):
        raise StateMismatchError(
            f"dataloader state: 'order' must be a dict of ordering options, "
            f"got {short_repr(theirs)}"
        )
    missing = object()
    diff = sorted(
        (k for k in {*ours, *theirs} if not _same(theirs.get(k, missing), ours.get(k, missing))),
        key=str,
    )
    if diff:
        shown = ", ".join(
            f"{short_repr(k)}: state {short_repr(theirs.get(k))} vs now {ours.get(k)!r}"
            for k in diff[:4]
        )
        raise StateMismatchError(f"dataloader state was made with other ordering options ({shown})")


def _same(a: object, b: object) -> bool:
    if is_int(a) and is_int(b):
        return int(a) == int(b)
    return type(a) is type(b) and a == b


def _base(value: Any, total: int) -> np.ndarray:
    """The consumed intervals: [start, stop] int pairs, sorted, disjoint, not touching,
    non-empty and inside [0, total] (as `to_state` writes them)."""
    if not isinstance(value, list | tuple):
        raise StateMismatchError(
            f"dataloader state: 'base' must be a list of [start, stop], got {short_repr(value)}"
        )
    prev = -1
    for i, pair in enumerate(value):
        if not (
            isinstance(pair, list | tuple)
            and len(pair) == 2
            and is_int(pair[0])
            and is_int(pair[1])
        ):
            raise StateMismatchError(
                f"dataloader state: 'base'[{i}] must be a [start, stop] pair of ints, "
                f"got {short_repr(pair)}"
            )
        a, b = int(pair[0]), int(pair[1])
        if not prev < a < b <= total:
            raise StateMismatchError(
                f"dataloader state: 'base'[{i}] = {short_repr([a, b])} is not a sorted, "
                f"disjoint, non-empty interval of the epoch's items [0, {total}]"
            )
        prev = b
    return np.asarray(value, dtype=np.int64).reshape(-1, 2)
