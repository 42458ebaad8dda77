"""Merging byte ranges of one object into fewer, larger requests."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class MergedRange(Generic[T]):
    """One request [start, start+length) covering `parts` (start, length, payload), sorted."""

    start: int
    length: int
    parts: tuple[tuple[int, int, T], ...]


def merge_ranges(
    parts: Iterable[tuple[int, int, T]], gap: int, max_length: int
) -> list[MergedRange[T]]:
    """Group ranges (start, length, payload) of one object into requests.

    Two neighbours (in start order) share a request when the hole between them is at most `gap`
    bytes and the request stays within `max_length` (a single larger part still gets its own
    request). Overlapping parts are allowed. Every part lies in exactly one request.
    """
    ordered: Sequence[tuple[int, int, T]] = sorted(parts, key=lambda p: (p[0], p[1]))
    out: list[MergedRange[T]] = []
    cur: list[tuple[int, int, T]] = []
    cur_start = cur_end = 0
    for part in ordered:
        start, length, _ = part
        end = start + length
        if cur and start - cur_end <= gap and max(end, cur_end) - cur_start <= max_length:
            cur.append(part)
            cur_end = max(cur_end, end)
            continue
        if cur:
            out.append(MergedRange(cur_start, cur_end - cur_start, tuple(cur)))
        cur, cur_start, cur_end = [part], start, end
    if cur:
        out.append(MergedRange(cur_start, cur_end - cur_start, tuple(cur)))
    return out
