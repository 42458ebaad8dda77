"""NumPy files. A ``.npy`` file is one sample (its array, in field `field`); a ``.npz`` file
holds one array per field with the samples along the first axis (``np.savez(f, tokens=T,
label=L)`` with ``len(T) == len(L)`` gives len(T) samples). Never unpickles (object arrays
are refused)."""

from __future__ import annotations

import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..format.spec import validate_field_name
from .base import Sample, Source, files_with


def _load(path: Path) -> Any:
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as exc:
        if "allow_pickle" in str(exc) or "Object arrays" in str(exc):
            raise TypeError(f"{path}: holds Python objects (only numeric arrays convert)") from None
        raise ValueError(f"{path}: not a readable NumPy file ({exc})") from None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: not a readable NumPy file ({exc})") from None


def _npz_samples(path: Path) -> Iterator[Sample]:
    with _load(path) as npz:
        names = list(npz.files)
        if not names:
            raise ValueError(f"{path}: an empty .npz file (no arrays)")
        arrays = {}
        for name in names:
            try:
                validate_field_name(name)
            except ValueError as exc:
                raise ValueError(f"{path}: array {name!r}: {exc}") from None
            try:
                arr = npz[name]
            except ValueError as exc:
                raise TypeError(f"{path}: array {name!r} holds Python objects ({exc})") from None
            if arr.ndim == 0:
                raise ValueError(f"{path}: array {name!r} is 0-d (samples go along axis 0)")
            arrays[name] = arr
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{path}: arrays differ in length along axis 0: {lengths}")
    n = next(iter(lengths.values()))
    for i in range(n):
        yield {k: (v[i] if v.ndim > 1 else v[i : i + 1].reshape(())) for k, v in arrays.items()}


def iter_numpy(files: Sequence[Path], field: str) -> Iterator[Sample]:
    for path in files:
        if path.name.endswith(".npz"):
            yield from _npz_samples(path)
        else:
            arr = _load(path)
            if not isinstance(arr, np.ndarray):
                raise ValueError(f"{path}: not a .npy array")
            yield {field: arr}


def numpy_source(src: Path, field: str) -> Source:
    validate_field_name(field)
    files = files_with(src, (".npy", ".npz"), "NumPy")
    kinds = {p.suffix for p in files}
    if len(kinds) > 1:
        raise ValueError(f"{src} holds both .npy and .npz files: convert them separately")
    count = len(files) if kinds == {".npy"} else None
    per_file = (lambda i: iter_numpy(files[i : i + 1], field)) if count is None else None
    return Source("numpy", files, lambda: iter_numpy(files, field), count, file_samples=per_file)
