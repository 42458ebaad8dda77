"""Small datasets shared by the dataloader tests."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

import dataloader


def make_samples(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "id": i,
            "score": float(i) / 2,
            "tokens": rng.integers(0, 1000, size=int(rng.integers(0, 40))).astype(np.int32),
            "image": np.full((2, 3), i % 128, dtype=np.uint8),
            "blob": bytes([i % 256]) * int(rng.integers(0, 50)),
            "text": f"sample-{i}-é",
        }
        for i in range(n)
    ]


@pytest.fixture(scope="session")
def small_samples() -> list[dict]:
    return make_samples(523)


@pytest.fixture(scope="session")
def small_uri(small_samples: list[dict]) -> str:
    """A 523-sample dataset (blocks of 16 samples, small data chunks) in a memory store."""
    uri = f"memory://ds-{uuid.uuid4().hex}"
    dataloader.write_dataset(
        uri,
        small_samples,
        schema={"image": "fixed"},
        rows_per_chunk=16,
        data_chunk_bytes=512,
        shard_bytes=4096,
    )
    return uri


def ids_of(batches) -> list[int]:
    return [int(x) for b in batches for x in b["_index"]]
