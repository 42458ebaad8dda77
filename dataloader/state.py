"""Resumable state: small, versioned, tied to the dataset's fingerprint, JSON-able.

A state is a dict of str/int/bool/lists of ints (no numpy objects, nothing pickled), so it can
be saved as JSON or inside a ckptstore checkpoint. It records *where the epoch stands*, not
what workers hold: (epoch, consumed intervals folded in so far, world size and balance mode
of the run that made it, items each rank has delivered since). See order.py for why that is
enough to resume exactly, also on another number of ranks or workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import StateMismatchError
from .order import BALANCE, as_intervals, merge_intervals

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


def _int(state: dict[str, Any], key: str, minimum: int = 0) -> int:
    v = state.get(key)
    if isinstance(v, np.integer):
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise StateMismatchError(
            f"dataloader state: {key!r} must be an int >= {minimum}, got {v!r}"
        )
    return v


def from_state(
    state: Any, kinds: tuple[str, ...], fingerprint: str, order: dict[str, Any]
) -> Progress:
    """Validate a state for this dataset/configuration and return its Progress."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise StateMismatchError("not a dataloader state (missing format marker)")
    if state.get("version") != STATE_VERSION:
        raise StateMismatchError(
            f"dataloader state version {state.get('version')!r} is not supported"
            f" (want {STATE_VERSION})"
        )
    if state.get("kind") not in kinds:
        raise StateMismatchError(
            f"dataloader state of kind {state.get('kind')!r}, expected one of {kinds}"
        )
    if state.get("fingerprint") != fingerprint:
        raise StateMismatchError(
            f"dataloader state belongs to dataset {state.get('fingerprint')!r}, "
            "not to this dataset "
            f"({fingerprint}): refusing to resume from another dataset's position"
        )
    theirs = state.get("order")
    if theirs != order:
        diff = sorted(
            k for k in set(order) | set(theirs or {}) if (theirs or {}).get(k) != order.get(k)
        )
        raise StateMismatchError(
            f"dataloader state was made with other ordering options ({', '.join(diff)}: "
            f"state { ({k: (theirs or {}).get(k) for k in diff}) } "
            f"vs now { ({k: order.get(k) for k in diff}) })"
        )
    balance = state.get("balance")
    if balance not in BALANCE:
        raise StateMismatchError(f"dataloader state: bad balance {balance!r}")
    try:
        base = as_intervals(state.get("base", []))
    except (TypeError, ValueError):
        raise StateMismatchError(
            "dataloader state: 'base' must be a list of [start, stop]"
        ) from None
    if len(base) and (np.any(base < 0) or np.any(base[:, 1] < base[:, 0])):
        raise StateMismatchError("dataloader state: 'base' has invalid intervals")
    return Progress(
        _int(state, "epoch"),
        merge_intervals(base),
        _int(state, "world_size", 1),
        balance,
        _int(state, "consumed"),
    )
