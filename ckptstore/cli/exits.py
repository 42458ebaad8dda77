"""Exit codes and the one-line error form shared by every `ckpt` command."""

from __future__ import annotations

from ..redact import redact_text

EXIT_OK = 0
EXIT_FOUND = 1  # the command ran and found a difference or a problem
EXIT_ERROR = 2
EXIT_BUSY = 75  # gc did not run: saves in progress (try again)
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """Bad command-line arguments (one line, exit 2)."""


def one_line(exc: BaseException) -> str:
    """An error as one line for stderr, every URL in it redacted."""
    text = str(exc).strip() or type(exc).__name__
    return redact_text(" ".join(text.split()))
