"""Assertions shared by tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact equality of nested states: types, key types, dtypes, shapes and bits."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys differ"
        for k in a:
            assert type(k) is type(list(b.keys())[list(a.keys()).index(k)])
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}")
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad differs"
        x, y = a.detach().contiguous(), b.detach().contiguous()
        if x.numel():
            same = torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
            assert same, path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape}"
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert a.hex() == b.hex(), path
    else:
        assert a == b, path


def json_paths(doc: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path (tuple of keys and indexes) in a JSON document, the root () first."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from json_paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from json_paths(v, (*prefix, i))


def sealed_manifest(doc: dict) -> bytes:
    """Manifest bytes for a (possibly tampered) manifest document, with a correct seal: lets
    tests reach the parser's structural checks behind the self-digest check."""
    from ckptstore.format.canonical import SEAL_FIELD, canonical_json, seal

    body = {k: v for k, v in doc.items() if k != SEAL_FIELD}
    try:
        raw = canonical_json(body)
    except ValueError:  # NaN and the like: no canonical form, sent as they are
        return json.dumps(doc).encode()
    return raw if body.get("version") == 1 else seal(raw)
