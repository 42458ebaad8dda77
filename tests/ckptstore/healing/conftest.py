"""Fixtures shared by the live-healing tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ckptstore.torchft import Transport


@pytest.fixture
def transports() -> Iterator[list[Transport]]:
    """Transports a test makes (append them): shut down when it ends."""
    made: list[Transport] = []
    yield made
    for t in made:
        t.shutdown(wait=False)
