"""Which checkpoints to keep: small composable policies over step numbers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Retention:
    """Keep the newest `keep_last` steps and every step divisible by `keep_every`.
    Both None keeps everything; the newest step is always kept."""

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError("keep_last must be at least 1")
        if self.keep_every is not None and self.keep_every < 1:
            raise ValueError("keep_every must be at least 1")

    def to_delete(self, steps: list[int]) -> list[int]:
        """The steps this policy drops, oldest first."""
        if self.keep_last is None and self.keep_every is None:
            return []
        ordered = sorted(set(steps))
        keep = set(ordered[-(self.keep_last or 1):])
        if self.keep_every is not None:
            keep |= {s for s in ordered if s % self.keep_every == 0}
        return [s for s in ordered if s not in keep]
