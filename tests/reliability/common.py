"""Helpers shared by the reliability campaigns and their worker processes.

Everything here is deterministic from its arguments (names, seeds), so a checkpoint found in a
store after a crash can be checked against what its name says it must hold, whoever wrote it.
Processes talk through argv, JSON lines in files and exit codes: never pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ckptstore.layout import BLOB_PREFIX, blob_key
from ckptstore.maintenance import checks
from ckptstore.maintenance.leases import LeaseBusyError

MiB = 1 << 20


@dataclass(frozen=True)
class Profile:
    """How much each campaign does: `quick` runs in CI, `soak` on demand (--soak, CKPT_SOAK=1)."""

    name: str
    kills_local: int  # SIGKILLs of the worker saving into a local folder
    kills_s3: int  # ... into S3 (moto)
    kill_delay: tuple[float, float]  # seconds after "ready" before the SIGKILL (uniform)
    powerloss_sequences: int  # the fixed scenario plus seeded random ones
    powerloss_eager_every: int  # "eager-names" mode: every n-th crash point ("strict": all)
    powerloss_teeth_all: bool  # teeth tests: sweep every crash point, not up to the first hit
    s3_rounds: int  # saves and loads per fault rate
    s3_rates: tuple[float, ...]
    seaweed_rounds: int
    corruption_mutations: int  # blob mutations (all blobs touched)
    manifest_flips: int  # single-bit flips of a manifest (0: every bit)
    manifest_cuts: int  # truncations of a manifest (0: every length)
    sm_examples: int  # hypothesis examples of the gc state machine
    sm_steps: int  # rules per example

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


QUICK = Profile(
    name="quick", kills_local=20, kills_s3=7, kill_delay=(0.05, 0.6), powerloss_sequences=1,
    powerloss_eager_every=3, powerloss_teeth_all=False,
    s3_rounds=4, s3_rates=(0.0, 0.01, 0.05, 0.20), seaweed_rounds=2, corruption_mutations=320,
    manifest_flips=400, manifest_cuts=60, sm_examples=20, sm_steps=25)
SOAK = Profile(
    name="soak", kills_local=160, kills_s3=60, kill_delay=(0.02, 1.5), powerloss_sequences=8,
    powerloss_eager_every=1, powerloss_teeth_all=True,
    s3_rounds=30, s3_rates=(0.0, 0.01, 0.05, 0.20), seaweed_rounds=10,
    corruption_mutations=3000, manifest_flips=0, manifest_cuts=0, sm_examples=250,
    sm_steps=50)


# -- states -----------------------------------------------------------------------------------


def name_seed(name: str) -> int:
    """A 64-bit seed derived from a checkpoint name."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def make_state(name: str, *, base_bytes: int = 2 * MiB, delta_bytes: int = 1 * MiB,
               small: int = 24) -> dict[str, Any]:
    """The state a checkpoint named `name` holds in the campaigns: a `base` array shared by
    every checkpoint (so blobs are deduplicated across checkpoints and gc must not take them
    while any checkpoint uses them), a `delta` unique to the name, small arrays packed
    together, and plain values."""
    rng = np.random.default_rng(name_seed(name))
    base = np.random.default_rng(12345).standard_normal(base_bytes // 4, dtype=np.float32)
    delta = rng.standard_normal(max(1, delta_bytes // 8)).reshape(-1, 8 if delta_bytes >= 64
                                                                  else 1)
    return {
        "base": base,
        "delta": delta,
        "small": [rng.integers(0, 1 << 30, size=int(rng.integers(1, 40)), dtype=np.int64)
                  for _ in range(small)],
        "meta": {"name": name, "step": int(rng.integers(0, 1 << 40)), "lr": float(rng.random())},
    }


def state_digest(state: Any) -> str:
    """SHA-256 over a canonical walk of a nested state (types, keys, dtypes, shapes and bytes).
    Independent of the store's own xxh3 digests, and equal for a saved and a restored state
    exactly when they hold the same values."""
    h = hashlib.sha256()
    _feed(h, state)
    return h.hexdigest()


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, Mapping):
        h.update(b"{%d" % len(value))
        for k in sorted(value, key=lambda k: (type(k).__name__, str(k))):
            h.update(f"{type(k).__name__}:{k!s}".encode() + b"\0")
            _feed(h, value[k])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[%s%d" % (type(value).__name__.encode(), len(value)))
        for v in value:
            _feed(h, v)
        h.update(b"]")
    elif isinstance(value, np.ndarray):
        h.update(f"nd:{value.dtype.str}:{value.shape}".encode() + b"\0")
        h.update(np.ascontiguousarray(value).tobytes())
    elif type(value).__module__ == "torch" or type(value).__name__ in ("Tensor", "Parameter"):
        import torch

        t = value.detach().contiguous().reshape(-1)
        h.update(f"pt:{t.dtype}:{tuple(value.shape)}".encode() + b"\0")
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, float):
        h.update(b"f" + value.hex().encode() + b"\0")
    elif isinstance(value, (bytes, bytearray)):
        h.update(b"b%d:" % len(value) + bytes(value))
    else:
        h.update(f"{type(value).__name__}:{value!r}".encode() + b"\0")


# -- JSON lines between processes -------------------------------------------------------------


def append_json_line(path: str | os.PathLike[str], doc: Mapping[str, Any]) -> None:
    """Append one JSON line with a single O_APPEND write (whole or absent after a kill -9)."""
    data = (json.dumps(doc, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(f"short append to {path}")
    finally:
        os.close(fd)


def read_json_lines(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every line of a JSON-lines file (empty list if it does not exist)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def walk_files(root: Path) -> Iterator[Path]:
    """Every regular file under `root`, sorted (stable across runs)."""
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            yield Path(dirpath, name)


# -- the library, through its public API where there is one ------------------------------------
#
# ckptstore's internals are being reorganized (modules moved into packages, functions taking a
# store instead of a repository). The campaigns use the public API; these helpers hold the few
# places that need more, each preferring the public form and naming what it falls back to.

def referenced_blobs(repo: Any) -> set[str]:
    """Every blob digest referenced by a listed checkpoint (a deleted one is skipped)."""
    refs: set[str] = repo.referenced_blobs()
    return refs


def unreferenced_blob_bytes(repo: Any) -> int:
    refs = {blob_key(d) for d in referenced_blobs(repo)}
    return sum(i.size for i in repo.store.list(BLOB_PREFIX) if i.key not in refs)


def lease_busy_error() -> type[Exception]:
    """The error a gc raises while a save holds a lease."""
    return LeaseBusyError


def gc_at(repo: Any, grace_seconds: float, now: float | None = None,
          leased: bool = True) -> Any:
    """gc of `repo` judging blob ages as if the store's clock read `now` (None: the store's
    real clock). `leased=False` runs gc without taking a lease, which is safe only while no
    save runs. Returns the GcReport."""
    if leased:
        return repo.gc(grace_seconds=grace_seconds, now=now)
    return checks.gc(repo.store, repo.referenced_blobs, grace_seconds, False, now)


def lease_objects(repo: Any) -> int:
    """Lease objects (live or left by dead processes) in the store."""
    return sum(1 for i in repo.store.list("locks/")
               if i.key.rsplit("/", 1)[-1].startswith(("save-", "gc-")))
