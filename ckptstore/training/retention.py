"""Which checkpoints to keep: a small policy over a history of step numbers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Retention:
    """Keep the last `keep_last` checkpoints in commit order and every step divisible by
    `keep_every`. Both None keeps everything.

    Commit order, not step order: a run that went back to step 50 (after a loss spike) and
    saved 51 and 52 keeps those, and drops the abandoned steps 90 and 100 as it goes on. The
    newest checkpoint and the one just saved are never dropped."""

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")

    def to_delete(self, history: list[int], saved: int | None = None) -> list[int]:
        """The steps this policy drops from `history` (the committed steps in commit order,
        oldest first), oldest first. Never `saved` (the step just saved) nor the newest."""
        if self.keep_last is None and self.keep_every is None:
            return []
        keep = set(history[-(self.keep_last or 1):])
        if saved is not None:
            keep.add(saved)
        if self.keep_every is not None:
            keep |= {s for s in history if s % self.keep_every == 0}
        return [s for s in history if s not in keep]


def per_tier(value: Any, tiers: int, name: str) -> tuple[Any, ...]:
    """A scalar applies to every tier; a list or tuple gives one value per tier."""
    if isinstance(value, (list, tuple)):
        if len(value) != tiers:
            raise ValueError(f"{name} has {len(value)} entries for {tiers} tier(s)")
        return tuple(value)
    return (value,) * tiers


@dataclass(frozen=True)
class TieredRetention:
    """Per-tier retention and save intervals of a tiered repository (tier 0 = nearest).

    * `every[i] = k`: tier i receives a checkpoint once k saves have passed since the last one
      it received (tier 0 receives every save: every[0] must be 1).
    * `policies[i]` (keep_last / keep_every) decide what tier i keeps, over the checkpoints it
      holds, with two overrides (`to_delete`): tier 0 never drops a checkpoint whose
      replication is unfinished, and a later tier never drops the last copy of a checkpoint
      that tier 0's policy keeps (tier 0 lost it, e.g. with its node)."""

    policies: tuple[Retention, ...]
    every: tuple[int, ...]

    @classmethod
    def of(cls, tiers: int, keep_last: Any, keep_every: Any, every: Any) -> TieredRetention:
        lasts = per_tier(keep_last, tiers, "keep_last")
        everies = per_tier(keep_every, tiers, "keep_every")
        intervals = per_tier(1 if every is None else every, tiers, "every")
        for k in intervals:
            if type(k) is not int or k < 1:
                raise ValueError(f"every must hold positive ints, got {k!r}")
        if intervals[0] != 1:
            raise ValueError("every[0] must be 1: every save lands on tier 0 first")
        return cls(tuple(Retention(a, b) for a, b in zip(lasts, everies)), intervals)

    def due(self, since_last: list[int]) -> list[int]:
        """The tiers the next save goes to, given per tier how many saves have passed since
        it last received one (the caller resets the counts of the tiers returned)."""
        return [i for i, k in enumerate(self.every) if since_last[i] + 1 >= k]

    def superseded(self, tier: int, holdings: list[set[int]], history: list[int],
                   saved: int | None, pending: set[int]) -> list[int]:
        """Steps still to replicate to `tier` (`pending`) that its policy would delete even
        once every pending step has arrived: newer ones replace them there. Their
        replication to `tier` is pointless and may be dropped (then tier 0's own policy
        decides them), which keeps tier 0 from growing through a long outage of `tier`."""
        after = [s for s in history if s in holdings[tier] or s in pending]
        return [s for s in self.policies[tier].to_delete(after, saved) if s in pending]

    def to_delete(self, tier: int, holdings: list[set[int]], history: list[int],
                  saved: int | None, pending: set[int]) -> list[int]:
        """Steps to delete from `tier`. `holdings[j]`: the steps tier j holds; `history`: the
        union of every tier's steps in commit order; `pending`: steps still to replicate."""
        own = [s for s in history if s in holdings[tier]]
        drop = self.policies[tier].to_delete(own, saved)
        out = []
        for s in drop:
            if tier == 0 and s in pending:
                continue  # its replication has not finished: tier 0 holds the source
            last_copy = not any(s in held for j, held in enumerate(holdings) if j != tier)
            if last_copy and tier != 0:
                near_view = [x for x in history if x in holdings[0] or x == s]
                if s not in self.policies[0].to_delete(near_view, saved):
                    continue  # tier 0's policy keeps it, and this is the only copy left
            out.append(s)
        return out
