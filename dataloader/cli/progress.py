"""Progress bars for `ckpt-data` (rich, on stderr, only when stderr is a terminal)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


def counted(items: Iterable[T], description: str, total: int | None, show: bool) -> Iterator[T]:
    """Yield `items`, advancing a bar per item (a count when `total` is unknown). Nothing is
    drawn unless `show` and stderr is a terminal."""
    with progress_bar(description, total, show) as advance:
        for item in items:
            yield item
            advance(1)


@contextmanager
def progress_bar(description: str, total: int | None, show: bool
                 ) -> Iterator[Callable[[int], None]]:
    """A bar on stderr (when `show` and stderr is a terminal); yields advance(n)."""
    if not show or not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is None:
        columns += [TextColumn("{task.completed:,} samples")]
    else:
        columns += [BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
    columns += [TimeElapsedColumn()]
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)
