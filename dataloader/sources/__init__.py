"""Converters: samples read from common dataset formats, for `ckpt-data convert`.

    source = open_source(path, "auto")        # a Source: its format, size and samples
    dataloader.write_dataset(uri, source.samples(), workers=2)

One module per format, each turning its files into sample dicts (field -> numpy array, int,
float, bool, bytes or str) that the writer accepts:

* ``jsonl``: JSON Lines, one object per line (lists of numbers become arrays);
* ``parquet``: Parquet files, one row per sample (needs pyarrow: the ``parquet`` extra);
* ``numpy``: ``.npy`` files (one file = one sample, in one field) and ``.npz`` files (one
  array per field, samples along the first axis);
* ``files``: every file of a folder tree, one sample each (``path`` and ``data``);
* ``webdataset``: WebDataset tar shards (members grouped by key, one field per extension);
* ``hf``: a Hugging Face ``datasets`` dataset saved with ``save_to_disk``, a ``load_dataset``
  cache folder (``<name>-<split>.arrow`` files and ``dataset_info.json``) or a single
  ``.arrow`` file (Arrow IPC files, read with pyarrow; the ``datasets`` package is not needed).
  `write_dataset` also takes ``datasets.Dataset`` objects themselves (sources/hf.py).

Contract: a bad input raises ValueError/TypeError/FileNotFoundError naming the file (and line,
row or member) before the sample is handed on; the writer then makes nothing visible.
"""

from __future__ import annotations

from pathlib import Path

from .base import FORMATS, Source
from .detect import detect_format


def open_source(
    path: str | Path, fmt: str = "auto", *, field: str = "data", split: str | None = None
) -> Source:
    """The samples of `path` read as format `fmt` ('auto': detected from the files)."""
    src = Path(path)
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such file or folder")
    if fmt == "auto":
        fmt = detect_format(src)
    if fmt not in FORMATS:
        raise ValueError(f"unknown source format {fmt!r} (use one of {', '.join(FORMATS)})")
    if fmt == "jsonl":
        from .jsonl import jsonl_source

        return jsonl_source(src)
    if fmt == "parquet":
        from .parquet import parquet_source

        return parquet_source(src)
    if fmt == "numpy":
        from .numpy_files import numpy_source

        return numpy_source(src, field)
    if fmt == "files":
        from .files import files_source

        return files_source(src)
    if fmt == "webdataset":
        from .webdataset import webdataset_source

        return webdataset_source(src)
    from .hf import hf_source

    return hf_source(src, split)


__all__ = ["FORMATS", "Source", "detect_format", "open_source"]
