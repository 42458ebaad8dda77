"""Output for the `ckpt` command line: JSON documents or rich tables on stdout, progress bars
and notes on stderr. rich is imported only when something human-readable is drawn."""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_DURATION_RE = re.compile(r"(\d+(?:\.\d*)?)(ms|s|m|h|d|w)")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError


def human_duration(seconds: float) -> str:
    """A duration that never reads as zero when it was not: '<1 ms', '340 ms', '2.4 s',
    '3m05s', '2h04m'."""
    if not math.isfinite(seconds) or seconds < 0:
        return "-"
    if seconds < 0.001:
        return "<1 ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def iso_time(t: float) -> str:
    """UTC ISO 8601 with a Z, to the second."""
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def parse_duration(text: str) -> float:
    """Seconds in '0', '90', '30s', '10m', '1h', '1h30m', '2d', '500ms'. ValueError otherwise."""
    s = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d*)?", s):
        return float(s)
    pos, total = 0, 0.0
    for m in _DURATION_RE.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _SECONDS[m.group(2)]
        pos = m.end()
    if pos != len(s) or not s:
        raise ValueError(f"invalid duration {text!r} (use e.g. 0, 30s, 10m, 1h, 1h30m, 2d)")
    return total


def finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


class Output:
    """Where a command's results go. `json_mode`: one JSON document on stdout; otherwise
    tables drawn with rich. Progress bars appear only on an interactive stderr."""

    def __init__(self, json_mode: bool) -> None:
        self.json_mode = json_mode
        self._console: Any = None

    @property
    def console(self) -> Any:
        if self._console is None:
            from rich.console import Console

            tty = sys.stdout.isatty()
            width = None if tty else max(100, shutil.get_terminal_size((120, 24)).columns)
            self._console = Console(highlight=False, soft_wrap=False, width=width,
                                    emoji=False, markup=False)
        return self._console

    def emit(self, doc: dict[str, Any], render: Callable[[Any], None]) -> None:
        """Print `doc` as JSON, or call render(console) to draw it."""
        if self.json_mode:
            sys.stdout.write(json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False))
            sys.stdout.write("\n")
            sys.stdout.flush()
        else:
            render(self.console)

    @staticmethod
    def note(message: str) -> None:
        """One line on stderr (never part of the JSON document)."""
        sys.stderr.write(f"ckpt: {message}\n")
        sys.stderr.flush()

    @contextmanager
    def progress(self, description: str, total: float | None = None,
                 unit: str = "bytes") -> Iterator[Progress]:
        """A progress bar on stderr when it is a terminal (and not in JSON mode); else silent."""
        if self.json_mode or not sys.stderr.isatty():
            yield Progress(None, None)
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
        from rich.progress import Progress as RichProgress

        columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}")]
        if total is None and unit != "bytes":  # a spinner: nothing to count
            columns += [TimeElapsedColumn()]
        elif unit == "bytes":
            columns += [BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(),
                        TimeElapsedColumn(), TimeRemainingColumn()]
        else:
            columns += [BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TimeRemainingColumn()]
        with RichProgress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield Progress(bar, task)


class Progress:
    """Advance handle of one progress bar (a no-op when no bar is shown). Thread-safe."""

    def __init__(self, bar: Any, task: Any) -> None:
        self._bar = bar
        self._task = task

    def advance(self, n: float = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def set_total(self, total: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, total=total)


def table(console: Any, columns: Sequence[str], rows: Sequence[Sequence[Any]], *,
          title: str | None = None, right: Sequence[str] = (),
          nowrap: Sequence[str] = ("BLOB",)) -> None:
    """Draw a simple table; cell values are shown literally (never as rich markup)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    t = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False)
    for col in columns:
        t.add_column(col, justify="right" if col in right else "left", overflow="fold",
                     no_wrap=col in nowrap, min_width=32 if col in nowrap else None)
    for row in rows:
        t.add_row(*(Text("" if v is None else str(v)) for v in row))
    console.print(t)


def line(console: Any, text: str = "") -> None:
    from rich.text import Text

    console.print(Text(text))
