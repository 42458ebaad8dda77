"""The forked-worker helper both process drivers use: results from every child, a child's
error raised in the parent, a child killed by a signal fails the run."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from dataloader.write.forked import run_forked


def _fail(kind: str, msg: str) -> Exception:
    return ValueError(f"{kind}: {msg}")


def test_every_childs_results_arrive() -> None:
    def produce(k: int) -> Iterator[dict[str, Any]]:
        for i in range(k, 20, 3):
            yield {"i": i, "pid": os.getpid()}

    seen: list[int] = []
    results = run_forked(3, produce, error=_fail, what="test",
                         on_result=lambda r: seen.append(r["i"]))
    assert sorted(r["i"] for r in results) == list(range(20)) == sorted(seen)
    assert os.getpid() not in {r["pid"] for r in results} and len({r["pid"] for r in results}) == 3


def test_a_childs_exception_is_raised_in_the_parent() -> None:
    def produce(k: int) -> Iterator[dict[str, Any]]:
        yield {"k": k}
        if k == 1:
            raise KeyError("bad input in child 1")

    with pytest.raises(ValueError, match="KeyError: 'bad input in child 1'"):
        run_forked(2, produce, error=_fail, what="test")


def test_a_child_killed_by_a_signal_fails_the_run() -> None:
    def produce(k: int) -> Iterator[dict[str, Any]]:
        if k == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        yield {"k": k}

    with pytest.raises(RuntimeError, match="a test process exited with code -9"):
        run_forked(2, produce, error=_fail, what="test")
