"""The resume contract every loader kind keeps, as one helper the tests apply to each kind."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

Batch = Any


def _take(loader: Any, count: int | None, items_of: Callable[[Batch], list[Any]]
          ) -> tuple[list[list[Any]], Iterator[Batch]]:
    it = iter(loader)
    out = []
    for batch in it:
        out.append(items_of(batch))
        if count is not None and len(out) >= count:
            break
    return out, it


def assert_resumes_exactly(make: Callable[[], Any], items_of: Callable[[Batch], list[Any]],
                           stops: list[int], limit: int | None = None) -> None:
    """For each `stop`: a loader that delivered `stop` batches saves its state (through JSON,
    as a checkpoint stores it); a new loader given that state delivers exactly the batches the
    first would have delivered next. The batches before and after, joined, equal those of an
    uninterrupted run (its first `limit` batches, for a loader that never ends)."""
    full, _ = _take(make(), limit, items_of)
    assert full, "the uninterrupted run delivered nothing"
    for stop in stops:
        first = make()
        head, it = _take(first, stop, items_of)
        state = json.loads(json.dumps(first.state_dict()))
        close = getattr(it, "close", None)
        if close is not None:
            close()
        second = make()
        second.load_state_dict(state)
        rest, _ = _take(second, None if limit is None else limit - len(head), items_of)
        assert head + rest == full, f"resume after {stop} batch(es) diverged"
