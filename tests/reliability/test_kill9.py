"""kill -9 campaign: a worker process saving in a loop (sync, async, CheckpointManager with
retention, deletes, gc) is SIGKILLed at seeded random instants and restarted, while a second
process saves, deletes and collects garbage in the same store without pause.

At the end, every checkpoint a process acknowledged (its `save()` / `handle.wait()` returned)
is listed and restores bit-exact, unless it was deleted or retention dropped it for two newer
steps; every listed checkpoint loads, holds what its name says and verifies (nothing torn);
no process raised anything unexpected; and a final gc leaves no unreferenced blob or temp file.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore

from .common import (
    BLOB_PREFIX,
    Profile,
    blob_key,
    gc_at,
    lease_objects,
    make_state,
    read_json_lines,
    referenced_blobs,
    state_digest,
)
from .conftest import new_bucket

pytestmark = pytest.mark.reliability

ROOT = Path(__file__).resolve().parents[2]
STATE = {"base_bytes": 2 << 20, "delta_bytes": 1 << 20}
CHUNK = 256 << 10
STATE_ARGS = ["--base-bytes", str(STATE["base_bytes"]), "--delta-bytes",
              str(STATE["delta_bytes"]), "--chunk-bytes", str(CHUNK)]


class Zygote:
    """The worker's fork server (`worker.py --zygote`): a fresh worker process in milliseconds
    instead of ~1.5 s of imports. It reaps its children and reports their exit codes."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.stderr_path = folder / "zygote.stderr"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.reliability.worker", "--zygote"], cwd=ROOT,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        self._buf = b""
        self.exits: dict[int, int] = {}
        assert self._next(60.0)["event"] == "zygote-ready", self.stderr_path.read_text()

    def _next(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            if not ready:
                raise AssertionError(f"the fork server said nothing for {timeout}s: "
                                     f"{self.stderr_path.read_text()[-2000:]}")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"the fork server died: {self.stderr_path.read_text()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        doc: dict[str, Any] = json.loads(line)
        if doc["event"] == "exit":
            self.exits[doc["pid"]] = doc["code"]
        return doc

    def spawn(self, tag: str, argv: list[str]) -> Worker:
        out, err = self.folder / f"{tag}.stdout", self.folder / f"{tag}.stderr"
        out.touch()
        err.touch()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"argv": [*argv, *STATE_ARGS], "stdout": str(out),
                                          "stderr": str(err)}).encode() + b"\n")
        self.proc.stdin.flush()
        while True:
            doc = self._next(60.0)
            if doc["event"] == "spawned":
                # a PID is reused once its earlier holder was reaped, and the fork server
                # reports that exit before this spawn: forget it, or the new worker would
                # look dead at once (seen in a soak run after ~50 restarts)
                self.exits.pop(doc["pid"], None)
                return Worker(self, tag, doc["pid"], out, err)

    def wait_exit(self, pid: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while pid not in self.exits:
            self._next(max(0.0, deadline - time.monotonic()))
        return self.exits[pid]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # the server ends once its children have
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@dataclass
class Worker:
    zygote: Zygote
    tag: str
    pid: int
    stdout: Path
    stderr_path: Path

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while b"ready" not in self.stdout.read_bytes():
            assert self.alive(), f"{self.tag} exited before it was ready: {self.stderr()}"
            assert time.monotonic() < deadline, f"{self.tag} never ready: {self.stderr()}"
            time.sleep(0.005)

    def alive(self) -> bool:
        try:
            self.zygote._next(0.0)  # collect any exit report
        except AssertionError:
            pass
        return self.pid not in self.zygote.exits

    def kill9(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        code = self.zygote.wait_exit(self.pid, 30.0)
        assert code == -signal.SIGKILL, f"{self.tag} exited with {code}: {self.stderr()}"

    def finish(self, timeout: float) -> int:
        return self.zygote.wait_exit(self.pid, timeout)


def interrupted(acks: list[dict[str, Any]], run: int) -> str:
    """What the worker of `run` was doing when it was killed: the op of its last `begin` if
    no `ack`/`deleted`/`gc` line followed it, else "between" operations."""
    last = [a for a in acks if a.get("run") == run and a["role"] == "worker"
            and a["event"] in ("begin", "ack", "deleted", "gc", "gc-busy")]
    if last and last[-1]["event"] == "begin":
        return str(last[-1]["op"])
    return "between"


def check_worker_checkpoints(repo: CheckpointStore, acks: list[dict[str, Any]]) -> int:
    """With the worker dead: each of its acknowledged checkpoints that it did not delete (and
    retention did not retire) is listed and restores bit-exact, and every checkpoint of its
    that is listed (acknowledged or not: a kill may fall after the commit) is whole. Returns
    the number of acknowledged checkpoints restored."""
    mine = [a for a in acks if a["role"] == "worker"]
    deleting = {a["name"] for a in mine if a["event"] == "deleting"}
    names = {n for n in repo.names() if n.startswith(("w", "step-"))}
    steps = sorted(int(n[5:]) for n in names if n.startswith("step-"))
    restored = 0
    for a in mine:
        if a["event"] != "ack" or a["name"] in deleting:
            continue
        name = a["name"]
        if name.startswith("step-") and name not in names:
            assert sum(s > a["step"] for s in steps) >= 2, f"acknowledged {name} lost: {steps}"
            continue
        assert name in names, f"acknowledged checkpoint {name} ({a['how']}) is not listed"
        assert state_digest(repo.load(name)) == a["digest"], f"{name} restored other bytes"
        restored += 1
    acked = {a["name"] for a in mine if a["event"] == "ack"}
    for name in names - acked:  # committed, the kill came before the acknowledgement
        expected = state_digest(make_state(name, **STATE))
        assert state_digest(repo.load(name)) == expected, f"unacknowledged {name} is torn"
    return restored


def run_campaign(folder: Path, uri: str, endpoint: str | None, options: dict[str, Any],
                 kills: int, seed: int, profile: Profile) -> dict[str, Any]:
    """Kill the worker `kills` times while the peer runs; after each kill check the worker's
    checkpoints. Returns what was done."""
    rng = random.Random(seed)
    worker_acks, peer_acks, stop = folder / "worker.jsonl", folder / "peer.jsonl", folder / "stop"
    common = ["--uri", uri] + (["--endpoint-url", endpoint] if endpoint else [])
    zygote = Zygote(folder)
    checker = CheckpointStore(uri, **options)
    delays: list[float] = []
    what: Counter[str] = Counter()
    restored = 0
    try:
        peer = zygote.spawn("peer", [*common, "--ack", str(peer_acks), "--role", "peer",
                                     "--run", "0", "--seed", str(rng.getrandbits(32)),
                                     "--stop-file", str(stop)])
        peer.wait_ready()
        for run in range(1, kills + 1):
            worker = zygote.spawn(f"worker-{run}", [
                *common, "--ack", str(worker_acks), "--role", "worker", "--run", str(run),
                "--seed", str(rng.getrandbits(32))])
            try:
                worker.wait_ready()
                delays.append(rng.uniform(*profile.kill_delay))
                time.sleep(delays[-1])
                assert worker.alive(), f"worker {run} exited by itself: {worker.stderr()}"
            finally:
                if worker.alive():
                    worker.kill9()
            acks = read_json_lines(worker_acks)
            what[interrupted(acks, run)] += 1
            restored += check_worker_checkpoints(checker, acks)
            assert peer.alive(), f"the peer died: {peer.stderr()}"
        # a restart after the last kill runs to its end: the store is usable as left
        last = zygote.spawn("worker-last", [
            *common, "--ack", str(worker_acks), "--role", "worker", "--run", str(kills + 1),
            "--seed", str(rng.getrandbits(32)), "--max-ops", "6"])
        assert last.finish(300) == 0, last.stderr()
        stop.touch()
        assert peer.finish(300) == 0, peer.stderr()
    finally:
        stop.touch()
        zygote.close()
        checker.close()
    return {"delays": delays, "interrupted": dict(what), "restores_after_kills": restored,
            "acks": read_json_lines(worker_acks) + read_json_lines(peer_acks)}


def check_store(uri: str, options: dict[str, Any], acks: list[dict[str, Any]],
                local_root: Path | None) -> dict[str, Any]:
    """The campaign's invariants; returns the figures."""
    errors = [a for a in acks if a["event"] == "error"]
    assert not errors, f"unexpected exceptions in the workers: {errors}"
    repo = CheckpointStore(uri, chunk_bytes=CHUNK, **options)
    names = set(repo.names())
    # every listed checkpoint is whole and holds what its name says
    digests: dict[str, str] = {}
    for name in sorted(names):
        digests[name] = state_digest(repo.load(name))
        assert digests[name] == state_digest(make_state(name, **STATE)), f"{name} holds other data"
        assert repo.verify(name).ok, f"{name} does not verify"
    # every acknowledged checkpoint is there, bit-exact, unless deleted or retired
    acked = {a["name"]: a for a in acks if a["event"] == "ack"}
    deleting = {a["name"] for a in acks if a["event"] == "deleting"}
    deleted = {a["name"] for a in acks if a["event"] == "deleted"}
    steps = sorted(int(n[5:]) for n in names if n.startswith("step-"))
    must, retired = 0, 0
    for name, a in sorted(acked.items()):
        if name in deleting:
            continue
        if name.startswith("step-") and name not in names:
            newer = [s for s in steps if s > a["step"]]
            assert len(newer) >= 2, f"acknowledged {name} lost (listed steps {steps})"
            retired += 1
            continue
        must += 1
        assert name in names, f"acknowledged checkpoint {name} ({a['how']}) is not listed"
        assert digests[name] == a["digest"], f"acknowledged {name} restored other bytes"
    resurrected = deleted & names
    assert not resurrected, f"deleted checkpoints listed again: {sorted(resurrected)}"
    temp_before = len(list(local_root.rglob(".tmp-*"))) if local_root else 0
    leases_left = lease_objects(repo)
    # nobody runs now: a gc whose clock is far ahead must reclaim every leftover, and only that
    report = gc_at(repo, 0.0, now=time.time() + 10 * 86400)
    refs = referenced_blobs(repo)
    blobs = {i.key for i in repo.store.list(BLOB_PREFIX)}
    assert blobs == {blob_key(b) for b in refs}, "gc left unreferenced blobs (or lost some)"
    for name in sorted(names):
        assert repo.verify(name).ok, f"{name} broken by the final gc"
    if local_root is not None:
        assert not list(local_root.rglob(".tmp-*")), "gc left temp files"
    repo.close()
    return {"acked": len(acked), "acked_must_exist": must, "acked_retired_by_retention": retired,
            "restored_bit_exact": must, "listed_at_end": len(names),
            "deletes_acked": len(deleted),
            "gc_runs": sum(a["event"] == "gc" for a in acks),
            "gc_busy": sum(a["event"] == "gc-busy" for a in acks),
            "temp_files_left_by_kills": temp_before, "stale_leases_left": leases_left,
            "final_gc_deleted_blobs": report.deleted_blobs}


def _campaign(kind: str, tmp_path: Path, profile: Profile, report: Callable[..., Any],
              endpoint: str | None) -> None:
    kills = profile.kills_local if kind == "local" else profile.kills_s3
    seed = 20260101 + (kind == "s3")
    if endpoint is None:
        root = tmp_path / "store"
        uri, options, local_root = str(root), {}, root
    else:
        # the final gc lets a killed save's requests land before it lists: 3 s is plenty
        # for a server on 127.0.0.1 (the default, 15 s, is for remote ones)
        uri, local_root = f"s3://{new_bucket(endpoint)}/repo", None
        options = {"endpoint_url": endpoint, "in_flight_settle": 3.0}
    t0 = time.monotonic()
    done = run_campaign(tmp_path, uri, endpoint, options, kills, seed, profile)
    figures = check_store(uri, options, done["acks"], local_root)
    report(f"kill9-{kind}", seed=seed, kills=kills, seconds=round(time.monotonic() - t0, 1),
           mean_kill_delay=round(sum(done["delays"]) / max(1, len(done["delays"])), 3),
           kills_interrupted=done["interrupted"],
           restores_after_kills=done["restores_after_kills"], **figures)
    assert figures["acked"] > kills, "too few checkpoints acknowledged to mean anything"


def test_kill9_local(tmp_path: Path, profile: Profile,
                     campaign_report: Callable[..., Any]) -> None:
    _campaign("local", tmp_path, profile, campaign_report, None)


def test_kill9_s3(tmp_path: Path, profile: Profile, campaign_report: Callable[..., Any],
                  rel_moto_endpoint: str) -> None:
    _campaign("s3", tmp_path, profile, campaign_report, rel_moto_endpoint)
