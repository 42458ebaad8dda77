"""Corruption campaigns on real checkpoints in a local store: every mutation of a blob or a
manifest must be detected by `load()` (a ckptstore error, never values) and by `ckpt verify`
(a non-zero exit).

Blob mutations (seeded, round-robin over every blob of an uncompressed and a zstd checkpoint):
one bit flipped, several bits flipped, truncated, a range zeroed, the content replaced by
random bytes of the same size, swapped with another blob's content, the blob deleted: `load()`
raises. Bytes appended after the end of a blob are a case apart: `load()` reads exactly the
byte ranges the manifest names (each verified), so it returns the right values without
noticing; `verify()` and `ckpt verify` hash whole blobs and flag it. Manifest mutations:
single-bit flips at many positions and truncations at many lengths.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptstore import CheckpointStore, CkptStoreError, FormatError, IntegrityError, StoreError
from ckptstore.cli import main as ckpt_main

from .common import Profile, blob_key, state_digest

pytestmark = pytest.mark.reliability

CHUNK = 16 << 10
BLOB_MUTATIONS = ("bitflip", "multiflip", "truncate", "zero-range", "append", "random-same-size",
                  "swap", "delete")
#: mutations outside every byte range a load reads: load returns the right values (never
#: others) and only a whole-blob check (verify) can tell
OUTSIDE_READ_RANGES = ("append",)
DETECTED = (IntegrityError, FormatError, StoreError)


def make_states() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"w": torch.randn(160, 256, generator=g),  # ten row-block chunks
                  "emb": torch.randn(128, 128, generator=g).to(torch.bfloat16),
                  "b": torch.randn(256, generator=g), "tied": None},
        "optim": {"step": np.int64(12), "m": np.random.default_rng(1).random((80, 100)),
                  "flags": torch.tensor([True, False, True])},
        "small": [torch.full((5,), float(i)) for i in range(12)],  # packed together
        "meta": {"lr": 0.1, "name": "corruption", "blob": b"\x00\x01raw bytes"},
    }


@dataclass
class Checkpoints:
    root: Path
    names: list[str]
    digests: dict[str, str]  # name -> state digest
    users: dict[str, list[str]]  # blob -> checkpoints using it
    manifests: dict[str, bytes]  # name -> manifest bytes


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    root = tmp_path_factory.mktemp("corruption") / "repo"
    state = make_states()
    state["model"]["tied"] = state["model"]["w"][:8]  # shares storage with w
    repo = CheckpointStore(root, chunk_bytes=CHUNK)
    repo.save("raw", state)
    repo.save("zstd", state, compression="zstd", parent=None)
    users: dict[str, list[str]] = {}
    digests, manifests = {}, {}
    for name in ("raw", "zstd"):
        for blob in repo.manifest(name).blob_digests():
            users.setdefault(blob, []).append(name)
        digests[name] = state_digest(repo.load(name))
        manifests[name] = repo.store.get(f"checkpoints/{name}.json")
    assert digests["raw"] == digests["zstd"] == state_digest(state)
    repo.close()
    return Checkpoints(root, ["raw", "zstd"], digests, users, manifests)


@dataclass
class Tally:
    """How each mutation was caught."""

    trials: int = 0
    load_errors: Counter[str] = field(default_factory=Counter)  # "kind: ErrorType" -> n
    load_returned: list[str] = field(default_factory=list)  # undetected by load()
    verify_missed: list[str] = field(default_factory=list)  # verify() said ok
    cli_missed: list[str] = field(default_factory=list)  # `ckpt verify` exited 0
    odd_errors: list[str] = field(default_factory=list)  # caught, but by an unexpected type
    touched: set[str] = field(default_factory=set)


def ckpt_verify(root: Path, *names: str) -> int:
    """`ckpt verify` in this process (its exit code; output swallowed)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return ckpt_main(["verify", str(root), *names, "--json"])


def check_detected(ck: Checkpoints, names: list[str], label: str, tally: Tally,
                   run_cli: bool = True) -> None:
    tally.trials += 1
    for name in names:
        repo = CheckpointStore(ck.root, create=False)  # fresh: no cached manifest
        try:
            state = repo.load(name)
        except CkptStoreError as exc:
            kind = label.split(":")[0].split("@")[0]
            tally.load_errors[f"{kind}: {type(exc).__name__}"] += 1
            if not isinstance(exc, DETECTED):
                tally.odd_errors.append(f"{label}: {exc!r}")
        else:
            same = state_digest(state) == ck.digests[name]
            tally.load_returned.append(f"{label} ({name}: {'same' if same else 'OTHER'} values)")
        try:
            ok = repo.verify(name).ok
        except CkptStoreError:
            ok = False
        if ok:
            tally.verify_missed.append(f"{label} ({name})")
        repo.close()
    if run_cli and ckpt_verify(ck.root, *names) == 0:
        tally.cli_missed.append(label)


@contextlib.contextmanager
def mutated(path: Path, new: bytes | None) -> Iterator[None]:
    """`path` holds `new` (None: deleted) inside the block, its old bytes after."""
    old = path.read_bytes()
    try:
        if new is None:
            path.unlink()
        else:
            path.write_bytes(new)
        yield
    finally:
        path.write_bytes(old)


def mutate_blob(kind: str, data: bytes, other: bytes, rng: random.Random) -> bytes | None:
    """A mutated copy of `data` that differs from it (None: delete the blob)."""
    n = len(data)
    if kind == "delete":
        return None
    if kind == "swap":
        return other
    if kind == "append":
        return data + rng.randbytes(rng.randint(1, 64))
    if kind == "truncate":
        return data[: rng.randrange(n)]
    if kind == "random-same-size":
        return rng.randbytes(n)
    out = bytearray(data)
    if kind in ("bitflip", "multiflip"):
        bits = rng.sample(range(n * 8), 1 if kind == "bitflip" else rng.randint(2, 8))
        for bit in bits:
            out[bit // 8] ^= 1 << (bit % 8)
    elif kind == "zero-range":
        start = rng.randrange(n)
        stop = rng.randint(start + 1, min(n, start + 4096))
        if not any(out[start:stop]):  # already zero there: zero everything instead
            start, stop = 0, n
        out[start:stop] = bytes(stop - start)
    else:
        raise ValueError(kind)
    return bytes(out)


def test_every_blob_mutation_is_detected(saved: Checkpoints, profile: Profile,
                                         campaign_report: Callable[..., Any]) -> None:
    rng = random.Random(404)
    blobs = sorted(saved.users)
    rng.shuffle(blobs)
    tally = Tally()
    by_kind: Counter[str] = Counter()
    t0 = time.monotonic()
    for i in range(profile.corruption_mutations):
        blob = blobs[i % len(blobs)]
        kind = BLOB_MUTATIONS[(i // len(blobs) + i) % len(BLOB_MUTATIONS)]
        path = saved.root / blob_key(blob)
        data = path.read_bytes()
        other = (saved.root / blob_key(blobs[(i + 1) % len(blobs)])).read_bytes()
        new = mutate_blob(kind, data, other, rng)
        assert new != data
        by_kind[kind] += 1
        tally.touched.add(blob)
        with mutated(path, new):
            # the CLI on every 4th mutation in the quick profile (each costs a full verify)
            check_detected(saved, saved.users[blob], f"{kind}:{blob}", tally,
                           run_cli=profile.name == "soak" or i % 4 == 0)
    missed = [x for x in tally.load_returned if x.split(":")[0] not in OUTSIDE_READ_RANGES]
    outside = [x for x in tally.load_returned if x.split(":")[0] in OUTSIDE_READ_RANGES]
    campaign_report("corruption-blobs", mutations=tally.trials, blobs=len(blobs),
                    by_kind=dict(by_kind), load_errors=dict(tally.load_errors),
                    undetected_by_load=len(missed),
                    appended_bytes_loaded_with_right_values=len(outside),
                    loaded_other_values=sum("OTHER" in x for x in tally.load_returned),
                    undetected_by_verify=len(tally.verify_missed),
                    undetected_by_cli=len(tally.cli_missed),
                    seconds=round(time.monotonic() - t0, 1))
    assert tally.touched == set(blobs), "not every blob was mutated"
    assert not tally.odd_errors, tally.odd_errors[:10]
    assert not any("OTHER" in x for x in tally.load_returned), tally.load_returned[:10]
    assert not missed, missed[:10]
    assert not tally.verify_missed, tally.verify_missed[:10]
    assert not tally.cli_missed, tally.cli_missed[:10]
    assert set(by_kind) == set(BLOB_MUTATIONS)


def _manifest_trials(saved: Checkpoints, label: str, count: int, total: int,
                     make: Callable[[bytes, int], bytes], profile: Profile,
                     report: Callable[..., Any]) -> Tally:
    """Mutate each manifest at `count` seeded positions out of `total` (0: all of them)."""
    tally = Tally()
    t0 = time.monotonic()
    for name in saved.names:
        raw = saved.manifests[name]
        size = total if total else len(raw)
        positions = range(size) if not count or count >= size else sorted(
            random.Random(f"{label}-{name}").sample(range(size), count))
        path = saved.root / "checkpoints" / f"{name}.json"
        for k, pos in enumerate(positions):
            new = make(raw, pos)
            with mutated(path, new):
                # `ckpt verify` on every 10th mutation (every 50th in soak: all bits)
                check_detected(saved, [name], f"{label}@{pos}:{name}", tally,
                               run_cli=k % (50 if profile.name == "soak" else 10) == 0)
    report(f"corruption-manifest-{label}", mutations=tally.trials,
           manifest_bytes={n: len(saved.manifests[n]) for n in saved.names},
           load_errors=dict(tally.load_errors), undetected_by_load=len(tally.load_returned),
           loaded_other_values=sum("OTHER" in x for x in tally.load_returned),
           undetected_by_verify=len(tally.verify_missed),
           undetected_by_cli=len(tally.cli_missed), seconds=round(time.monotonic() - t0, 1),
           examples=tally.load_returned[:3])
    return tally


def _flip(raw: bytes, bit: int) -> bytes:
    out = bytearray(raw)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def test_every_manifest_bit_flip_is_detected(saved: Checkpoints, profile: Profile,
                                             campaign_report: Callable[..., Any]) -> None:
    bits = len(saved.manifests["raw"]) * 8
    tally = _manifest_trials(saved, "bitflip", profile.manifest_flips, bits, _flip, profile,
                             campaign_report)
    assert not tally.odd_errors, tally.odd_errors[:10]
    assert not tally.load_returned, tally.load_returned[:10]
    assert not tally.verify_missed, tally.verify_missed[:10]
    assert not tally.cli_missed, tally.cli_missed[:10]


def test_every_manifest_truncation_is_detected(saved: Checkpoints, profile: Profile,
                                               campaign_report: Callable[..., Any]) -> None:
    tally = _manifest_trials(saved, "truncate", profile.manifest_cuts, 0,
                             lambda raw, n: raw[:n], profile, campaign_report)
    assert not tally.odd_errors, tally.odd_errors[:10]
    assert not tally.load_returned, tally.load_returned[:10]
    assert not tally.verify_missed, tally.verify_missed[:10]
    assert not tally.cli_missed, tally.cli_missed[:10]


def test_ckpt_verify_command_exits_non_zero_on_corruption(saved: Checkpoints) -> None:
    """The real `ckpt` entry point in a subprocess, on a flipped blob and a cut manifest."""
    blob = sorted(saved.users)[0]
    path = saved.root / blob_key(blob)
    cmd = [sys.executable, "-m", "ckptstore.cli", "verify", str(saved.root)]
    env = {**os.environ, "CKPT_DEBUG": ""}
    assert subprocess.run(cmd, capture_output=True, env=env).returncode == 0
    data = path.read_bytes()
    with mutated(path, _flip(data, 8 * (len(data) // 2))):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        assert done.returncode == 1, done.stderr
        assert blob in done.stdout
    manifest = saved.root / "checkpoints" / "raw.json"
    with mutated(manifest, saved.manifests["raw"][:-7]):
        done = subprocess.run(cmd + ["raw"], capture_output=True, text=True, env=env)
        assert done.returncode != 0, done.stdout
