"""Errors of a live heal."""

from __future__ import annotations

from ..errors import CkptStoreError


class HealError(CkptStoreError):
    """A live heal could not complete: the sender stopped answering, died, moved on to
    another step or refused the request. Nothing partial is returned; the message names the
    sender, the step and how far the transfer got."""


class HealTimeoutError(HealError, TimeoutError):
    """A live heal did not complete within its timeout (the message says what it waited for)."""
