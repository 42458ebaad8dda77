"""The synthetic data every contestant gets: deterministic, numpy only (runs in any venv).

* ``tokens``: about 256M tokens (x scale) as samples of 2,049 int32 tokens (vocab 50,257).
* ``bytes``: about 2 GB (x scale) of byte samples of uniform random size 1 KiB..63 KiB.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

SEQ = 2049
VOCAB = 50_257
TOKENS_TOTAL = 256_000_000
BYTES_TOTAL = 2_000_000_000
MIN_B, MAX_B = 1 << 10, 63 << 10
POOL = 64 << 20


def count(kind: str, scale: float) -> int:
    if kind == "tokens":
        return max(1, int(TOKENS_TOTAL * scale) // SEQ)
    sizes = byte_sizes(scale)
    return len(sizes)


def byte_sizes(scale: float) -> np.ndarray:
    rng = np.random.default_rng(12345)
    n = max(1, int(BYTES_TOTAL * scale / ((MIN_B + MAX_B) / 2)))
    return rng.integers(MIN_B, MAX_B + 1, size=n)


def samples(kind: str, scale: float, block: int = 4096) -> Iterator[np.ndarray | bytes]:
    """Yield every sample of the dataset in order (the same on every call)."""
    if kind == "tokens":
        n = count(kind, scale)
        for start in range(0, n, block):
            rng = np.random.default_rng([7, start])
            m = min(block, n - start)
            arr = rng.integers(0, VOCAB, size=(m, SEQ), dtype=np.int32)
            yield from arr
        return
    sizes = byte_sizes(scale)
    pool = np.random.default_rng(9).bytes(POOL)  # samples are slices of one random pool
    for i, s in enumerate(sizes):
        off = (i * 7919 * 4099) % (POOL - int(s))
        yield pool[off : off + int(s)]


def sample_range(kind: str, scale: float, start: int, stop: int) -> Iterator[np.ndarray | bytes]:
    """Samples [start, stop) (start a multiple of 4,096 for tokens): the same values as
    `samples`, for writers that split the work (litdata's optimize)."""
    if kind == "tokens":
        assert start % 4096 == 0
        n = count(kind, scale)
        for b0 in range(start, min(stop, n), 4096):
            rng = np.random.default_rng([7, b0])
            m = min(4096, n - b0)
            arr = rng.integers(0, VOCAB, size=(m, SEQ), dtype=np.int32)
            yield from arr[: max(0, min(m, stop - b0))]
        return
    sizes = byte_sizes(scale)
    pool = np.random.default_rng(9).bytes(POOL)
    for i in range(start, min(stop, len(sizes))):
        s = int(sizes[i])
        off = (i * 7919 * 4099) % (POOL - s)
        yield pool[off : off + s]


def order_samples(n: int = 8192, size: int = 1024) -> Iterator[tuple[int, bytes]]:
    """A small dataset for the shuffle-quality statistic: (id, payload) pairs."""
    rng = np.random.default_rng(3)
    for i in range(n):
        yield i, rng.bytes(size)


class LazySamples(Sequence[dict[str, np.ndarray | bytes]]):
    """The samples as a read-only sequence of ``{field: value}`` dicts that makes each slice on
    demand (the same values as `samples`): forked writer processes slice it, so every process
    generates its own partitions' samples and nothing is copied between processes."""

    def __init__(self, kind: str, scale: float, field: str) -> None:
        self.kind, self.scale, self.field = kind, scale, field
        self.n = count(kind, scale)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[dict[str, np.ndarray | bytes]]:
        return ({self.field: x} for x in samples(self.kind, self.scale))

    def __getitem__(self, key: int | slice) -> Any:  # type: ignore[override]
        if isinstance(key, int):
            got = self[key : key + 1] if key >= 0 else self[self.n + key : self.n + key + 1]
            assert isinstance(got, list) and got, key
            return got[0]
        start, stop, step = key.indices(self.n)
        assert step == 1, "only contiguous slices"
        out: list[np.ndarray | bytes] = []
        if self.kind == "tokens":  # from the 4,096-sample blocks covering [start, stop)
            for b0 in range(start - start % 4096, stop, 4096):
                block = self._token_block(b0)
                out.extend(block[max(0, start - b0) : max(0, min(len(block), stop - b0))])
        else:  # slices of the random pool, made once per process (as `samples` makes it once)
            if self._sizes is None:
                self._sizes = byte_sizes(self.scale)
                self._pool = np.random.default_rng(9).bytes(POOL)
            for i in range(start, stop):
                s = int(self._sizes[i])
                off = (i * 7919 * 4099) % (POOL - s)
                out.append(self._pool[off : off + s])
        return [{self.field: x} for x in out]

    _sizes: np.ndarray | None = None
    _pool: bytes = b""
    _block: tuple[int, np.ndarray] | None = None

    def _token_block(self, b0: int) -> np.ndarray:
        """Samples [b0, b0 + 4096) as `samples` makes them (the last block is kept)."""
        if self._block is None or self._block[0] != b0:
            m = min(4096, self.n - b0)
            arr = np.random.default_rng([7, b0]).integers(0, VOCAB, size=(m, SEQ), dtype=np.int32)
            self._block = (b0, arr)
        return self._block[1]
