"""Hugging Face ``datasets`` inputs, read with pyarrow alone (the ``datasets`` package is only
needed for `dataset_samples`, which takes the library's own objects).

Three on-disk layouts, all Arrow IPC files that ``datasets`` writes:

* ``save_to_disk``: a folder with ``state.json`` (its ``_data_files`` list names the Arrow
  files, in order), ``dataset_info.json`` and the Arrow files. A ``DatasetDict`` is a folder
  with ``dataset_dict.json`` (``{"splits": [...]}``) and one such folder per split.
* the ``load_dataset`` cache: a folder (``<cache>/<builder>/<config>/<version>/<hash>/``) of
  ``<name>-<split>.arrow`` or ``<name>-<split>-<i:05d>-of-<n:05d>.arrow`` files plus
  ``dataset_info.json``; the folder may be given directly or as any folder above it that
  holds only one such folder. ``cache-*.arrow`` files (results of ``map``/``filter``) and
  unfinished ``*.incomplete`` folders are not the dataset and are skipped.
* a single ``.arrow`` file.

Choose a split with `split` where there are several. ``dataset_info.json``'s feature types are
kept in the metadata. The files are Arrow IPC *stream* format (what ``datasets`` writes); the
IPC *file* format is accepted too. Column types as in arrow_rows (a ``ClassLabel`` is an
integer, an ``Image`` a struct and is refused, naming the column)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .arrow_rows import file_samples, require_pyarrow
from .base import Sample, Source

_SHARD_RE = re.compile(r"-(\d{5})-of-(\d{5})$")
_SPLIT_RE = re.compile(r"\w+(\.\w+)*")  # what datasets accepts as a split name
_BATCH_ROWS = 4096


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


def _open_arrow(path: Path) -> tuple[Any, Iterable[Any]]:
    """(schema, record batches) of an Arrow IPC file, stream format first (what datasets
    writes), then file format; ValueError naming the file if it is neither."""
    require_pyarrow("Hugging Face datasets")
    import pyarrow as pa

    try:
        stream = pa.ipc.open_stream(pa.memory_map(str(path)))
        return stream.schema, stream
    except (pa.ArrowException, OSError) as stream_error:
        try:
            f = pa.ipc.open_file(pa.memory_map(str(path)))
        except (pa.ArrowException, OSError):
            raise ValueError(
                f"{path}: not an Arrow IPC file (neither stream nor file format: "
                f"{stream_error})") from None
        return f.schema, (f.get_batch(i) for i in range(f.num_record_batches))


def iter_hf(files: Sequence[Path]) -> Iterator[Sample]:
    for path in files:
        schema, batches = _open_arrow(path)
        yield from file_samples(path, schema, batches)


def _features(info_path: Path) -> dict[str, str] | None:
    """Feature name -> its type's name, from a dataset_info.json (None if it has none)."""
    info = _json(info_path)
    features = info.get("features") if isinstance(info, dict) else None
    if not isinstance(features, dict):
        return None
    return {  # only the type's name: the full spec can nest deep
        str(k): str(v.get("dtype") or v.get("_type")) if isinstance(v, dict) else "?"
        for k, v in features.items()
    }


def hf_source(src: Path, split: str | None) -> Source:
    """A saved dataset, a load_dataset cache folder or one .arrow file (see the module doc)."""
    if src.is_file() or not ((src / "state.json").is_file()
                             or (src / "dataset_dict.json").is_file()):
        return _cache_source(src, split)
    folder, split = _split_dir(src, split)
    files = _data_files(folder)
    return _source(files, folder, split, "saved")


def _source(files: list[Path], folder: Path, split: str | None, layout: str,
            num_samples: int | None = None) -> Source:
    details: dict[str, Any] = {"layout": layout} if layout != "saved" else {}
    if split:
        details["split"] = split
    info_path = folder / "dataset_info.json"
    if info_path.is_file():
        features = _features(info_path)
        if features is not None:
            details["features"] = features
    return Source("hf", files, lambda: iter_hf(files), num_samples, details,
                  file_samples=lambda i: iter_hf(files[i : i + 1]))


def _split_of(name: str) -> tuple[str, int, int] | None:
    """(split, shard, shards) of a cache file name ``<name>-<split>[-<i>-of-<n>].arrow``."""
    stem = name[: -len(".arrow")]
    shard, shards = 0, 1
    m = _SHARD_RE.search(stem)
    if m is not None:
        shard, shards = int(m.group(1)), int(m.group(2))
        stem = stem[: m.start()]
    prefix, sep, split = stem.rpartition("-")
    if not sep or not prefix or _SPLIT_RE.fullmatch(split) is None:
        return None
    return split, shard, shards


def _arrow_files(src: Path) -> list[Path]:
    """The dataset's .arrow files under folder `src`, without map/filter caches, hidden files
    and unfinished (``*.incomplete``) folders."""
    found = []
    for p in sorted(src.rglob("*.arrow")):
        parts = p.relative_to(src).parts
        if (p.is_file() and not p.name.startswith("cache-")
                and not any(x.startswith(".") or x.endswith(".incomplete") for x in parts)):
            found.append(p)
    return found


def _cache_source(src: Path, split: str | None) -> Source:
    if src.is_file():
        if not src.name.endswith(".arrow"):
            raise ValueError(f"{src}: not an Arrow file (.arrow) or a Hugging Face dataset folder")
        parsed = _split_of(src.name)
        if split is not None and (parsed is None or parsed[0] != split):
            raise ValueError(f"{src}: one Arrow file, not split {split!r} (drop --split)")
        return _source([src], src.parent, parsed[0] if parsed else None, "arrow")
    found = _arrow_files(src)
    if not found:
        raise FileNotFoundError(
            f"{src}: no Hugging Face dataset here (no state.json, dataset_dict.json or .arrow"
            " files)")
    folders = sorted({p.parent for p in found})
    if len(folders) > 1:
        shown = ", ".join(str(f) for f in folders[:3]) + (", ..." if len(folders) > 3 else "")
        raise ValueError(
            f"{src} holds Arrow files in {len(folders)} folders ({shown}): pass one of them")
    folder = folders[0]
    names = {p: _split_of(p.name) for p in found}
    if any(v is None for v in names.values()):  # not a cache's names: every file, in order
        if split is not None:
            raise ValueError(f"{folder}: its Arrow file names name no splits (drop --split)")
        return _source(found, folder, None, "arrow")
    splits = sorted({v[0] for v in names.values() if v is not None})
    if split is None:
        if len(splits) != 1:
            raise ValueError(f"{folder}: a dataset with splits {splits}: pass --split NAME")
        split = splits[0]
    if split not in splits:
        raise ValueError(f"{folder}: no split {split!r} (splits: {splits})")
    shards = sorted((v[1], v[2], p) for p, v in names.items() if v is not None and v[0] == split)
    count = shards[0][1]
    if [(i, n) for i, n, _ in shards] != [(i, count) for i in range(count)]:
        raise ValueError(
            f"{folder}: split {split!r} has shard files {[p.name for _, _, p in shards]},"
            f" not 0..{count - 1} of {count} (an incomplete download or build?)")
    return _source([p for _, _, p in shards], folder, split, "cache",
                   _num_examples(folder / "dataset_info.json", split))


def _num_examples(info_path: Path, split: str) -> int | None:
    """The split's row count recorded in dataset_info.json (for progress), if any."""
    if not info_path.is_file():
        return None
    info = _json(info_path)
    splits = info.get("splits") if isinstance(info, dict) else None
    entry = splits.get(split) if isinstance(splits, dict) else None
    n = entry.get("num_examples") if isinstance(entry, dict) else None
    return n if type(n) is int and n >= 0 else None


def is_hf_dataset(obj: object) -> bool:
    """Whether `obj` is one of the ``datasets`` library's dataset objects (only checked when
    that library was imported: nothing else can make one)."""
    mod = sys.modules.get("datasets")
    kinds = tuple(getattr(mod, n) for n in ("Dataset", "IterableDataset", "DatasetDict",
                                             "IterableDatasetDict") if hasattr(mod, n))
    return bool(kinds) and isinstance(obj, kinds)


def dataset_samples(ds: Any) -> Iterator[Sample]:
    """The rows of a ``datasets.Dataset`` (or ``IterableDataset``) as samples, in its order
    (selections and shuffles included), read as Arrow record batches: types as for the saved
    formats. A ``DatasetDict`` is refused at once (TypeError naming its splits)."""
    if not hasattr(ds, "with_format") or isinstance(ds, dict):
        splits = sorted(ds) if isinstance(ds, dict) else []
        raise TypeError(
            f"a Hugging Face DatasetDict with splits {splits}: pass one split, e.g."
            f" d[{splits[0]!r}]" if splits else f"not a Hugging Face dataset: {type(ds).__name__}")
    return _dataset_rows(ds)


def _dataset_rows(ds: Any) -> Iterator[Sample]:
    tables = iter(ds.with_format("arrow").iter(batch_size=_BATCH_ROWS))
    first = next(tables, None)
    if first is None:
        return

    def all_batches() -> Iterator[Any]:
        yield from first.to_batches()
        for t in tables:
            yield from t.to_batches()

    yield from file_samples(f"datasets.{type(ds).__name__}", first.schema, all_batches())
