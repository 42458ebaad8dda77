"""The building blocks of ckptstore that other packages build on (the dataloader does).

Stable API: every name below keeps its meaning and signature across releases, wherever it is
implemented inside ckptstore (those modules may move; this one does not). Together with the
already public `ckptstore` (top level), `ckptstore.errors` and `ckptstore.stores`, it is all
that a package built on ckptstore should import.

Hashing and documents
    HASH_NAME                 "xxh3-128", the hash of every digest below
    digest(data)              xxh3-128 hex digest (32 lower-case hex characters) of a buffer
    is_digest(value)          whether `value` is such a digest (a str of 32 hex characters)
    canonical_json(doc)       sorted keys, no spaces, UTF-8, no NaN: equal documents, equal bytes

Reading objects
    merge_ranges(parts, gap, max_length) -> [MergedRange]
                              group (start, length, payload) byte ranges of one object into
                              fewer requests: neighbours closer than `gap` share one of at
                              most `max_length` bytes; every part lies in exactly one request

Errors and optional dependencies
    redact_text(text)         `text` with every URL's user info, query and fragment hidden
    missing(exc)              the MissingDependencyError ("pip install 'ckptstore[extra]'") for
                              a ModuleNotFoundError of an optional package (else `exc`)
    require(module)           import an optional module, or raise `missing(...)` for it

Command lines (the conventions `ckpt` and `ckpt-data` share)
    EXIT_OK 0, EXIT_FOUND 1 (ran and found a problem), EXIT_ERROR 2, EXIT_BUSY 75,
    EXIT_INTERRUPTED 130
    one_line(exc)             an error as one line for stderr, URLs redacted
    human_bytes(n)            sizes in binary units ("3.0 MiB")
    positive_int(text)        an argparse `type` for integers >= 1

    __version__               the package version
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .deps import missing, require
from .format.canonical import canonical_json
from .format.hashing import HASH_NAME, digest, is_digest
from .pipeline.ranges import MergedRange, merge_ranges
from .redact import redact_text
from .version import __version__

if TYPE_CHECKING:
    from .cli.args import positive_int
    from .cli.exits import EXIT_BUSY, EXIT_ERROR, EXIT_FOUND, EXIT_INTERRUPTED, EXIT_OK, one_line
    from .cli.output import human_bytes

#: the command-line names, loaded on first use: they live in the `ckpt` command's package,
#: which a library that imports this module should not pay for
_CLI = {
    "EXIT_BUSY": "exits", "EXIT_ERROR": "exits", "EXIT_FOUND": "exits",
    "EXIT_INTERRUPTED": "exits", "EXIT_OK": "exits", "one_line": "exits",
    "human_bytes": "output", "positive_int": "args",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _CLI.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptstore.toolkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ckptstore.cli.{module}"), name)
    globals()[name] = value
    return value

__all__ = [
    "EXIT_BUSY",
    "EXIT_ERROR",
    "EXIT_FOUND",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "HASH_NAME",
    "MergedRange",
    "__version__",
    "canonical_json",
    "digest",
    "human_bytes",
    "is_digest",
    "merge_ranges",
    "missing",
    "one_line",
    "positive_int",
    "redact_text",
    "require",
]
