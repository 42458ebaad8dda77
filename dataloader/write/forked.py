"""Work spread over forked child processes that send JSON results back over pipes.

`run_forked(workers, produce, ...)` forks `workers` children; child k runs `produce(k)` and
sends each dict it yields as JSON bytes (nothing is pickled). The parent reads every pipe as
data comes (no child waits on a full pipe), hands each result to `on_result` and returns them
all, in arrival order. A child's exception reaches the parent as its type name and message,
and the parent raises `error(type_name, message)`; a child that dies (a signal, an exit code)
fails the run too. Children still alive when the parent stops are killed. POSIX (fork) only.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

Result = dict[str, Any]


def run_forked(
    workers: int,
    produce: Callable[[int], Iterator[Result]],
    *,
    error: Callable[[str, str], Exception],
    what: str,
    on_result: Callable[[Result], None] = lambda r: None,
) -> list[Result]:
    """Run `produce(0)` ... `produce(workers - 1)` in forked children; see the module doc.
    `what` names a child in the message about its exit code ("a {what} process exited")."""
    ctx = multiprocessing.get_context("fork")

    def child(k: int, conn: Any) -> None:
        try:
            for result in produce(k):
                conn.send_bytes(json.dumps(result).encode())
        except BaseException as exc:  # reported to the parent, which raises
            failure = {"type": type(exc).__name__, "message": str(exc)}
            conn.send_bytes(b"!" + json.dumps(failure).encode())
        finally:
            conn.close()

    conns, procs = [], []
    results: list[Result] = []
    try:
        for k in range(workers):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=child, args=(k, send), daemon=True)
            proc.start()
            send.close()
            conns.append(recv)
            procs.append(proc)
        pending = list(conns)
        while pending:
            for conn in multiprocessing.connection.wait(pending):
                assert isinstance(conn, Connection)
                try:
                    raw = conn.recv_bytes()
                except EOFError:
                    pending.remove(conn)
                    continue
                if raw.startswith(b"!"):
                    failure = json.loads(raw[1:])
                    raise error(str(failure["type"]), str(failure["message"]))
                results.append(json.loads(raw))
                on_result(results[-1])
        for proc in procs:
            proc.join()
            if proc.exitcode != 0:
                raise RuntimeError(f"a {what} process exited with code {proc.exitcode}")
        return results
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
