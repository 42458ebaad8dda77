"""Which checkpoints to keep: a small policy over a history of step numbers."""

from __future__ import annotations

from dataclasses import dataclass


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
