"""A process of the kill -9 campaign (tests/reliability/test_kill9.py).

    python -m tests.reliability.worker --uri URI [--endpoint-url URL] --ack FILE \
        --role worker|peer --run N --seed S [--stop-file F] [--max-ops N]
    python -m tests.reliability.worker --zygote

Loops over seeded random operations on one store until killed (role `worker`), until
`--stop-file` exists (role `peer`) or after `--max-ops` operations:

* `save` (synchronous), `save_async` (then `handle.wait()`), and for the worker
  `CheckpointManager.save` with retention `keep_last=2` (sync or async);
* `delete` of one of its own checkpoints (the oldest, when it holds more than a few);
* `gc(grace_seconds=...)` with a short or zero grace (LeaseBusyError is expected while the
  other process saves).

Every checkpoint holds `common.make_state(name)`. The process appends one JSON line to the
`--ack` file per fact, with a single O_APPEND write, only once the fact holds:
`{"event": "ack", "name", "digest"}` after `save()` / `handle.wait()` returned (digest:
`common.state_digest` of the state saved); `deleting` before and `deleted` after a delete;
`gc` / `gc-busy`; `ready` once the store is open; `begin` before each operation (so the
campaign knows what a kill interrupted). Any other exception is an `error` line, a traceback
on stderr and exit status 3: the campaign fails on it.

`--zygote` is a fork server that saves the campaign ~1.5 s of Python, numpy and torch imports
per restart: it imports everything once, then reads JSON lines on stdin
(`{"argv": [...], "stdout": path, "stderr": path}`), forks one single-threaded child per line
that runs `main(argv)` with its output in those files, and writes JSON lines on stdout:
`{"event": "spawned", "pid"}` and, once it has reaped a child, `{"event": "exit", "pid",
"code"}` (negative: killed by that signal). A child is an ordinary process: SIGKILL ends it as
it would end any trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import sys
import time
import traceback
from typing import Any

from tests.reliability.common import (
    append_json_line,
    lease_busy_error,
    make_state,
    state_digest,
)

KEEP_OWN = 4  # plain checkpoints each process keeps before it deletes its oldest


def _options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {"chunk_bytes": args.chunk_bytes, "workers": 4}
    if args.endpoint_url:
        opts["endpoint_url"] = args.endpoint_url
    return opts


def run(args: argparse.Namespace) -> int:
    import ckptstore

    rng = random.Random(args.seed)
    repo = ckptstore.CheckpointStore(args.uri, **_options(args))
    managers: list[Any] = []
    if args.role == "worker":
        from ckptstore import CheckpointManager

        managers = [CheckpointManager(repo, keep_last=2, async_save=False),
                    CheckpointManager(repo, keep_last=2, async_save=True)]
    own_prefix = f"{'w' if args.role == 'worker' else 'p'}{args.run}-"
    mine = "w" if args.role == "worker" else "p"

    def ack(event: str, **fields: Any) -> None:
        append_json_line(args.ack, {"event": event, "role": args.role, "run": args.run,
                                    "pid": os.getpid(), "t": time.time(), **fields})

    ack("ready")
    print("ready", flush=True)
    ops = ["save", "save_async", "delete", "gc"]
    weights = [3, 3, 1, 1]
    if managers:
        ops.append("manager")
        weights.append(4)
    count = 0
    while args.max_ops <= 0 or count < args.max_ops:
        if args.stop_file and os.path.exists(args.stop_file):
            break
        count += 1
        op = rng.choices(ops, weights)[0]
        own = sorted((n for n in repo.names() if n[:1] == mine and "-" in n),
                     key=lambda n: (int(n[1:].split("-")[0]), int(n.split("-")[1])))
        if op == "delete" or len(own) > KEEP_OWN:
            if own:
                name = own[0]
                ack("begin", op="delete", name=name)
                ack("deleting", name=name)
                repo.delete(name)
                ack("deleted", name=name)
            continue
        if op == "gc":
            ack("begin", op="gc")
            try:
                report = repo.gc(grace_seconds=rng.choice([0.0, 0.5, 5.0]))
            except lease_busy_error():
                ack("gc-busy")
            else:
                ack("gc", deleted_blobs=report.deleted_blobs)
            continue
        if op == "manager":
            manager = rng.choice(managers)
            step = max(manager.steps(), default=0) + 1
            name = manager.name_of(step)
            state = make_state(name, base_bytes=args.base_bytes, delta_bytes=args.delta_bytes)
            ack("begin", op="manager-async" if manager.async_save else "manager", name=name)
            result = manager.save(step, state)
            if not isinstance(result, ckptstore.SaveInfo):
                result.wait()
            ack("ack", name=name, digest=state_digest(state), how=op, step=step)
            continue
        name = f"{own_prefix}{count}"
        state = make_state(name, base_bytes=args.base_bytes, delta_bytes=args.delta_bytes)
        ack("begin", op=op, name=name)
        if op == "save":
            repo.save(name, state, metadata={"role": args.role})
        else:
            handle = repo.save_async(name, state, metadata={"role": args.role})
            state["delta"][:] = -1.0  # async: the checkpoint holds the values at call time
            handle.wait()
            state = make_state(name, base_bytes=args.base_bytes, delta_bytes=args.delta_bytes)
        ack("ack", name=name, digest=state_digest(state), how=op)
    ack("stopped", ops=count)
    repo.close()
    return 0


def zygote() -> int:
    """The fork server (see the module docstring). Single-threaded, so forking is safe."""
    import boto3  # noqa: F401 - everything a worker needs, imported once
    import torch  # noqa: F401

    import ckptstore
    import ckptstore.stores.s3  # noqa: F401

    assert ckptstore.CheckpointManager  # a lazy attribute: imports the manager (and torch)

    def say(doc: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()

    say({"event": "zygote-ready", "pid": os.getpid()})
    pending = b""
    children: set[int] = set()
    stdin_open = True
    while stdin_open or children:
        for pid in list(children):  # reap promptly: a zombie still looks alive to leases
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                say({"event": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})
        if not stdin_open:
            time.sleep(0.01)
            continue
        readable, _, _ = select.select([0], [], [], 0.01)
        if not readable:
            continue
        data = os.read(0, 65536)
        if not data:
            stdin_open = False
            continue
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if not line.strip():
                continue
            cmd = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(cmd)  # never returns
            children.add(pid)
            say({"event": "spawned", "pid": pid})
    return 0


def _child(cmd: dict[str, Any]) -> None:
    code = 3
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, cmd["stdout"]), (2, cmd["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        random.seed()
        code = main(list(cmd["argv"]))
    except BaseException:  # noqa: BLE001 - a child must never return into the server loop
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:] == ["--zygote"]:
        return zygote()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--uri", required=True)
    p.add_argument("--endpoint-url")
    p.add_argument("--ack", required=True, help="JSON-lines file of acknowledged facts")
    p.add_argument("--role", choices=["worker", "peer"], required=True)
    p.add_argument("--run", type=int, required=True, help="restart number (names are unique)")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--stop-file")
    p.add_argument("--max-ops", type=int, default=0)
    p.add_argument("--base-bytes", type=int, default=2 << 20)
    p.add_argument("--delta-bytes", type=int, default=1 << 20)
    p.add_argument("--chunk-bytes", type=int, default=256 << 10)
    args = p.parse_args(argv)
    try:
        return run(args)
    except Exception as exc:  # noqa: BLE001 - report any unexpected error, then fail
        traceback.print_exc()
        try:
            append_json_line(args.ack, {"event": "error", "role": args.role, "run": args.run,
                                        "pid": os.getpid(), "t": time.time(),
                                        "error": f"{type(exc).__name__}: {exc}"})
        finally:
            sys.stderr.flush()
        return 3


if __name__ == "__main__":
    sys.exit(main())
