"""S3 faults at 1%, 5% and 20% of requests (seeded), against moto and against SeaweedFS.

Saves and loads of a ~7.5 MiB state (one blob large enough for a multipart upload) go through
`CheckpointStore("s3://bucket/prefix", endpoint_url=...)` to a server behind
`s3chaos.ChaosMiddleware` (503 SlowDown, 500, lost replies, dropped connections, GET bodies
cut half-way, latency). Asserted: no silent corruption (every load is bit-exact or raises a
ckptstore error, never another exception); with retries, every operation succeeds at 1% and
5% and most at 20% (where a save whose request fails five times in a row gives up with a
StoreError); once the faults stop, every checkpoint whose save returned (and every listed one)
loads bit-exact and verifies. Recorded: HTTP attempts and retries per operation and the time
overhead against 0%.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import pytest

from ckptstore import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointStore,
    CkptStoreError,
)
from ckptstore.stores.s3 import S3Store

from .common import MiB, Profile, make_state, state_digest
from .conftest import new_bucket
from .s3chaos import ChaosServer, ForwardApp, moto_app

pytestmark = pytest.mark.reliability

SIZES = {"base_bytes": 1 * MiB, "delta_bytes": 1 * MiB, "small": 12}
BIG = int(5.5 * MiB)  # one blob above the multipart threshold
STORE_OPTIONS: dict[str, Any] = {"chunk_bytes": 8 * MiB, "multipart_threshold": 5 * MiB,
                                 "multipart_chunksize": 5 * MiB}


def state_of(name: str) -> dict[str, Any]:
    state = make_state(name, **SIZES)
    state["big"] = make_state(name + "/big", base_bytes=0, delta_bytes=BIG, small=0)["delta"]
    return state


def s3_client(repo: CheckpointStore) -> Any:
    """The botocore client of an S3-backed repository."""
    assert isinstance(repo.store, S3Store)
    return repo.store.client


class Attempts:
    """Counts API calls and HTTP attempts (retries included) of one botocore client."""

    def __init__(self, client: Any) -> None:
        self.calls = 0
        self.attempts = 0
        self._lock = threading.Lock()
        client.meta.events.register("before-call.s3", self._call)
        client.meta.events.register("before-send.s3", self._send)

    def _call(self, **kwargs: Any) -> None:
        with self._lock:
            self.calls += 1

    def _send(self, **kwargs: Any) -> None:
        with self._lock:
            self.attempts += 1


@dataclass
class RateResult:
    rate: float
    saves: int = 0
    saves_ok: int = 0
    loads: int = 0
    loads_ok: int = 0
    corrupt: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    messages: list[str] = field(default_factory=list)  # first lines of the errors raised
    foreign: list[str] = field(default_factory=list)  # exceptions that are not ckptstore's
    save_seconds: list[float] = field(default_factory=list)
    load_seconds: list[float] = field(default_factory=list)
    save_attempts: list[int] = field(default_factory=list)
    save_calls: list[int] = field(default_factory=list)
    load_attempts: list[int] = field(default_factory=list)
    load_calls: list[int] = field(default_factory=list)
    injected: dict[str, int] = field(default_factory=dict)
    requests: int = 0
    acked: dict[str, str] = field(default_factory=dict)  # save() returned: name -> digest
    attempted: dict[str, str] = field(default_factory=dict)  # every save tried


def _mean(xs: list[float] | list[int]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _open(uri: str, endpoint: str, result: RateResult) -> CheckpointStore:
    """Open a store through the faults (opening sends requests too), a few tries."""
    for attempt in range(5):
        try:
            return CheckpointStore(uri, endpoint_url=endpoint, **STORE_OPTIONS)
        except CkptStoreError as exc:
            result.errors[f"open:{type(exc).__name__}"] += 1
            if attempt == 4:
                raise
    raise AssertionError("unreachable")


def run_rate(server: ChaosServer, bucket: str, rate: float, rounds: int, seed: int
             ) -> RateResult:
    """`rounds` saves, each followed by a load from a freshly opened store, at `rate`."""
    result = RateResult(rate)
    server.plan.configure(rate, seed)
    uri = f"s3://{bucket}/rate-{round(rate * 100)}"
    repo = _open(uri, server.endpoint, result)
    saver = Attempts(s3_client(repo))
    try:
        for i in range(rounds):
            name = f"c{i}"
            state = state_of(f"{seed}-{rate}-{name}")
            want = state_digest(state)
            result.attempted[name] = want
            result.saves += 1
            a0, c0, t0 = saver.attempts, saver.calls, time.perf_counter()
            try:
                repo.save(name, state)
            except CkptStoreError as exc:
                result.errors[f"save:{type(exc).__name__}"] += 1
                result.messages.append(f"save {name}: {exc}"[:300])
            except Exception as exc:  # noqa: BLE001 - must never happen: recorded, asserted
                result.foreign.append(f"save: {type(exc).__name__}: {exc}")
            else:
                result.saves_ok += 1
                result.acked[name] = want
                result.save_seconds.append(time.perf_counter() - t0)
                result.save_attempts.append(saver.attempts - a0)
                result.save_calls.append(saver.calls - c0)
            try:
                reader = _open(uri, server.endpoint, result)
            except CkptStoreError:
                result.loads += 1  # the load could not even start: counts as failed
                continue
            counter = Attempts(s3_client(reader))
            t0 = time.perf_counter()
            try:
                got = state_digest(reader.load(name))
            except CheckpointNotFoundError:
                if name in result.acked:  # an acknowledged checkpoint is never absent
                    result.loads += 1
                    result.errors["load:CheckpointNotFoundError(acked)"] += 1
            except CkptStoreError as exc:
                result.loads += 1
                result.errors[f"load:{type(exc).__name__}"] += 1
                result.messages.append(f"load {name}: {exc}"[:300])
            except Exception as exc:  # noqa: BLE001 - must never happen: recorded, asserted
                result.loads += 1
                result.foreign.append(f"load: {type(exc).__name__}: {exc}")
            else:
                result.loads += 1
                if got != want:
                    result.corrupt += 1
                else:
                    result.loads_ok += 1
                    result.load_seconds.append(time.perf_counter() - t0)
                    result.load_attempts.append(counter.attempts)
                    result.load_calls.append(counter.calls)
            finally:
                reader.close()
    finally:
        repo.close()
        result.injected = dict(server.plan.injected)
        result.requests = server.plan.request_count
        server.plan.configure(0.0, 0)
    return result


def check_clean(uri: str, endpoint: str, result: RateResult) -> None:
    """With the faults gone: every acknowledged checkpoint is listed, and every listed one
    (including a save that raised after its commit landed) loads bit-exact and verifies."""
    with CheckpointStore(uri, endpoint_url=endpoint, **STORE_OPTIONS) as repo:
        names = set(repo.names())
        missing = set(result.acked) - names
        assert not missing, f"acknowledged checkpoints missing at rate {result.rate}: {missing}"
        for name in sorted(names):
            assert state_digest(repo.load(name)) == result.attempted[name], (
                f"{name} restored other bytes")
            assert repo.verify(name).ok, f"{name} does not verify"


def campaign(server: ChaosServer, clean_endpoint: str, bucket: str, rates: tuple[float, ...],
             rounds: int, seed: int) -> list[dict[str, Any]]:
    results = [run_rate(server, bucket, rate, rounds, seed) for rate in rates]
    rows = []
    base = results[0]
    for r in results:
        check_clean(f"s3://{bucket}/rate-{round(r.rate * 100)}", clean_endpoint, r)
        rows.append({
            "rate": r.rate, "saves_ok": f"{r.saves_ok}/{r.saves}",
            "loads_ok": f"{r.loads_ok}/{r.loads}", "silent_corruption": r.corrupt,
            "errors": dict(r.errors), "foreign_errors": len(r.foreign),
            "requests": r.requests, "injected": r.injected,
            "attempts_per_save": round(_mean(r.save_attempts), 1),
            "retries_per_save": round(_mean(r.save_attempts) - _mean(r.save_calls), 2),
            "extra_calls_per_save": round(_mean(r.save_calls) - _mean(base.save_calls), 2),
            "attempts_per_load": round(_mean(r.load_attempts), 1),
            "retries_per_load": round(_mean(r.load_attempts) - _mean(r.load_calls), 2),
            "extra_calls_per_load": round(_mean(r.load_calls) - _mean(base.load_calls), 2),
            "save_s": round(_mean(r.save_seconds), 3), "load_s": round(_mean(r.load_seconds), 3),
            "error_messages": r.messages[:4],
            "save_overhead": round(_mean(r.save_seconds) / _mean(base.save_seconds) - 1, 2)
            if base.save_seconds else None,
            "load_overhead": round(_mean(r.load_seconds) / _mean(base.load_seconds) - 1, 2)
            if base.load_seconds else None,
        })
    for r in results:
        assert not r.foreign, f"non-ckptstore exceptions at rate {r.rate}: {r.foreign[:3]}"
        assert r.corrupt == 0, f"silent corruption at rate {r.rate}"
        if r.rate <= 0.05:  # a request fails 5 times in a row with p <= 3e-7
            assert r.saves_ok == r.saves and r.loads_ok == r.loads, (r.rate, r.messages)
        else:  # ~1 save in 30 gives up (a StoreError, cleanly) at 20%
            assert r.saves_ok >= 0.5 * r.saves and r.loads_ok >= 0.5 * r.loads, r.messages
    injected = sum(sum(r.injected.values()) for r in results)
    assert injected > 0, "no fault was injected"
    return rows


# -- moto -------------------------------------------------------------------------------------


def _run_and_report(name: str, server: ChaosServer, endpoint: str, rates: Any, rounds: int,
                    seed: int, report: Callable[..., Any]) -> None:
    """One fault campaign on a fresh bucket behind `server`; one report line per fault rate
    and a total."""
    bucket = new_bucket(endpoint, "chaos")
    t0 = time.monotonic()
    for row in campaign(server, endpoint, bucket, rates, rounds, seed=seed):
        report(name, **row)
    report(f"{name}-total", seconds=round(time.monotonic() - t0, 1), rounds=rounds)


@pytest.fixture(scope="module")
def moto_chaos(rel_moto_endpoint: str) -> Iterator[ChaosServer]:
    server = ChaosServer(moto_app())
    yield server
    server.close()


def test_s3_faults_moto(moto_chaos: ChaosServer, rel_moto_endpoint: str, profile: Profile,
                        campaign_report: Callable[..., Any]) -> None:
    _run_and_report("s3-faults-moto", moto_chaos, rel_moto_endpoint, profile.s3_rates,
                    profile.s3_rounds, 7, campaign_report)


# -- SeaweedFS --------------------------------------------------------------------------------


@pytest.fixture
def seaweed_chaos(seaweed_env: str) -> Iterator[ChaosServer]:
    parts = urlsplit(seaweed_env)
    server = ChaosServer(ForwardApp(parts.hostname or "127.0.0.1", parts.port or 80))
    yield server
    server.close()


def test_seaweedfs_semantics(seaweed_env: str) -> None:
    """A real S3 server: create-only commits refuse a second writer of a name, ranged and
    verified restores, delete and gc."""
    bucket = new_bucket(seaweed_env, "semantics")
    uri = f"s3://{bucket}/repo"
    repo = CheckpointStore(uri, endpoint_url=seaweed_env, **STORE_OPTIONS)
    other = CheckpointStore(uri, endpoint_url=seaweed_env, **STORE_OPTIONS)
    a, b = state_of("sw-a"), state_of("sw-b")
    repo.save("a", a)
    with pytest.raises(CheckpointExistsError):
        other.save("a", b, parent=None)
    assert state_digest(other.load("a")) == state_digest(a)
    repo.save("b", b)
    assert other.verify("b").ok
    assert state_digest(other.load("b", keys=["big"])["big"]) == state_digest(b["big"])
    repo.delete("a")
    assert not other.exists("a")
    with CheckpointStore(uri, endpoint_url=seaweed_env) as fresh:  # no cached manifest
        with pytest.raises(CheckpointNotFoundError):
            fresh.load("a")
        assert fresh.names() == ["b"]
    repo.close()
    other.close()


def test_s3_faults_seaweedfs(seaweed_chaos: ChaosServer, seaweed_env: str, profile: Profile,
                             campaign_report: Callable[..., Any]) -> None:
    _run_and_report("s3-faults-seaweedfs", seaweed_chaos, seaweed_env, profile.s3_rates,
                    profile.seaweed_rounds, 11, campaign_report)
