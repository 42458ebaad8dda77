"""Turning numpy batches into what the training loop wants. torch is imported only here, and
only when torch output is asked for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

Collate = str | Callable[[dict[str, Any]], Any]


def to_torch(batch: dict[str, Any]) -> dict[str, Any]:
    """numpy arrays -> torch tensors (zero-copy); lists of arrays -> lists of tensors; other
    values (bytes, str, ints) unchanged."""
    from ckptstore.toolkit import require

    torch = require("torch")

    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, np.ndarray):
            out[k] = torch.from_numpy(v if v.flags.writeable else v.copy())
        elif isinstance(v, list) and v and isinstance(v[0], np.ndarray):
            out[k] = [torch.from_numpy(x.copy()) for x in v]
        else:
            out[k] = v
    return out


def resolve(collate: Collate) -> Callable[[dict[str, Any]], Any]:
    if callable(collate):
        return collate
    if collate == "numpy":
        return lambda b: b
    if collate == "torch":
        return to_torch
    raise ValueError(f"collate must be 'numpy', 'torch' or a callable, got {collate!r}")
