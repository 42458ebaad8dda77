"""`ckpt-data` (also ``python -m dataloader``; the entry point is `dataloader.cli:main`):
convert files into datasets, inspect and verify them. Imports flow down this list only:

    progress.py   progress bars on stderr (rich, only when stderr is a terminal)
    commands.py   the argument parser and the convert, info and verify commands

The top of the dataloader: it may import every other layer (lazily, per command, so that
`ckpt-data --version` stays fast).
"""

from __future__ import annotations

from .commands import INDEX_KEY, PROG, build_parser, main, summary

__all__ = ["INDEX_KEY", "PROG", "build_parser", "main", "summary"]
