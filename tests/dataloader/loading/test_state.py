"""The one resume contract (resume_contract.assert_resumes_exactly) on every loader kind:
a plain loader in-process and with workers, a token-packing loader, a mixed loader."""

from __future__ import annotations

from typing import Any

import pytest

import dataloader
from tests.dataloader.resume_contract import assert_resumes_exactly


def _ids(batch: Any) -> list[int]:
    return [int(x) for x in batch["_index"]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_streaming_loader(small_uri: str, num_workers: int) -> None:
    def make() -> dataloader.StreamingLoader:
        ds = dataloader.StreamingDataset(small_uri, fields=["id"], shuffle=True, seed=5,
                                         shuffle_window=64)
        return dataloader.StreamingLoader(ds, batch_size=8, num_workers=num_workers)

    assert_resumes_exactly(make, _ids, stops=[0, 1, 13, 65])


def test_token_loader(small_uri: str) -> None:
    def make() -> dataloader.StreamingLoader:
        ds = dataloader.TokenDataset(small_uri, 16, field="tokens", shuffle=True, seed=2)
        return dataloader.StreamingLoader(ds, batch_size=3)

    assert_resumes_exactly(make, lambda b: b["tokens"].tolist(), stops=[1, 7])


def test_mixed_loader(small_uri: str) -> None:
    def make() -> dataloader.MixedLoader:
        sources = [dataloader.StreamingDataset(small_uri, fields=["id"], shuffle=True, seed=s)
                   for s in (1, 2)]
        return dataloader.MixedLoader(sources, [0.3, 0.7], 8, seed=4)

    assert_resumes_exactly(make, lambda b: b["id"].tolist(), stops=[1, 20, 90], limit=150)
