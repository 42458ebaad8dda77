"""A Hugging Face ``datasets`` dataset saved with ``save_to_disk``, read with pyarrow alone.

What ``save_to_disk`` writes (and this reads): a folder with ``state.json`` (its
``_data_files`` list names the Arrow files, in order), ``dataset_info.json`` (features, kept
in the metadata as-is) and the Arrow files (Arrow IPC *stream* format). A ``DatasetDict`` is a
folder with ``dataset_dict.json`` (``{"splits": [...]}``) and one such folder per split:
choose one with `split`. Column types as in arrow_rows (a ``ClassLabel`` is an integer, an
``Image`` a struct and is refused)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .arrow_rows import file_samples, require_pyarrow
from .base import Sample, Source


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None


def _split_dir(src: Path, split: str | None) -> tuple[Path, str | None]:
    dd = src / "dataset_dict.json"
    if not dd.is_file():
        if split is not None:
            raise ValueError(f"{src}: a single dataset, not a DatasetDict (drop --split)")
        return src, None
    splits = _json(dd).get("splits")
    if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
        raise ValueError(f"{dd}: 'splits' must be a list of names")
    if split is None:
        if len(splits) != 1:
            raise ValueError(f"{src}: a DatasetDict with splits {splits}: pass --split NAME")
        split = splits[0]
    if split not in splits or "/" in split or split.startswith("."):
        raise ValueError(f"{src}: no split {split!r} (splits: {splits})")
    return src / split, split


def _data_files(folder: Path) -> list[Path]:
    state = _json(folder / "state.json")
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{folder / 'state.json'}: no '_data_files' list")
    files = []
    for e in entries:
        name = e.get("filename") if isinstance(e, dict) else None
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            raise ValueError(f"{folder / 'state.json'}: bad data file entry {e!r}")
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"{path}: listed in state.json but missing")
        files.append(path)
    return files


def _stream(path: Path) -> Any:
    require_pyarrow("Hugging Face datasets")
    import pyarrow as pa

    try:
        return pa.ipc.open_stream(pa.memory_map(str(path)))
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not an Arrow stream file ({exc})") from None


def iter_hf(files: Sequence[Path]) -> Iterator[Sample]:
    for path in files:
        reader = _stream(path)
        yield from file_samples(path, reader.schema, reader)


def hf_source(src: Path, split: str | None) -> Source:
    if not src.is_dir():
        raise ValueError(f"{src}: a saved Hugging Face dataset is a folder")
    folder, split = _split_dir(src, split)
    files = _data_files(folder)
    info_path = folder / "dataset_info.json"
    details: dict[str, Any] = {"split": split} if split else {}
    if info_path.is_file():
        info = _json(info_path)
        features = info.get("features") if isinstance(info, dict) else None
        if isinstance(features, dict):  # name -> its type's name (the full spec can nest deep)
            details["features"] = {
                str(k): str(v.get("dtype") or v.get("_type")) if isinstance(v, dict) else "?"
                for k, v in features.items()
            }
    return Source("hf", files, lambda: iter_hf(files), None, details,
                  file_samples=lambda i: iter_hf(files[i : i + 1]))
