"""Command line: ``python -m dataloader {convert,info,verify} ...``.

* ``convert SRC DEST``: a folder of ``.jsonl`` files (one JSON object per line = one sample;
  lists of numbers become arrays) or ``.npy`` files (one file = one sample, stored in field
  ``--field``) -> a dataset at DEST (path, file://, s3://).
* ``info URI``: the dataset's summary (``--json`` for machine-readable output).
* ``verify URI``: read every chunk and check it against its digest.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ckptstore.errors import CkptStoreError
from ckptstore.stores import open_store

from .format import INDEX_KEY, DatasetIndex
from .writer import write_dataset


def _json_value(v: Any, where: str) -> Any:
    if isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, list):
        if not v:
            return np.zeros(0, dtype=np.int64)
        if all(isinstance(x, bool) for x in v):
            return np.asarray(v, dtype=np.bool_)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return np.asarray(v, dtype=np.int64)
        if all(isinstance(x, int | float) and not isinstance(x, bool) for x in v):
            return np.asarray(v, dtype=np.float64)
        raise TypeError(f"{where}: lists must hold only numbers (or only bools)")
    raise TypeError(
        f"{where}: unsupported JSON value {type(v).__name__} (use numbers, str, lists of numbers)"
    )


def iter_jsonl(files: Sequence[Path]) -> Iterator[dict[str, Any]]:
    for path in files:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{where}: invalid JSON ({exc})") from None
                if not isinstance(obj, dict):
                    raise TypeError(f"{where}: each line must be a JSON object")
                yield {k: _json_value(v, f"{where}, field {k!r}") for k, v in obj.items()}


def iter_npy(files: Sequence[Path], field: str) -> Iterator[dict[str, Any]]:
    for path in files:
        yield {field: np.load(path, allow_pickle=False)}


def _source_files(src: Path, fmt: str) -> tuple[str, list[Path]]:
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: not a folder")
    jsonl = sorted(src.glob("*.jsonl"))
    npy = sorted(src.glob("*.npy"))
    if fmt == "auto":
        if jsonl and npy:
            raise ValueError(f"{src} holds both .jsonl and .npy files: pass --format")
        fmt = "jsonl" if jsonl else "npy"
    files = jsonl if fmt == "jsonl" else npy
    if not files:
        raise FileNotFoundError(f"{src}: no .{fmt} files")
    return fmt, files


def summary(index: DatasetIndex, uri: str) -> dict[str, Any]:
    stored = sum(s.nbytes for a in index.arrays.values() for s in a.shards)
    return {
        "uri": uri,
        "fingerprint": index.fingerprint,
        "num_samples": index.num_samples,
        "rows_per_chunk": index.rows_per_chunk,
        "num_blocks": index.num_blocks,
        "partitions": len(index.partitions),  # 0: a single-stream (v1) dataset
        "stored_bytes": stored,
        "fields": [
            {
                "name": f.name,
                "kind": f.kind,
                "dtype": f.dtype,
                **({"shape": list(f.shape)} if f.shape is not None else {}),
                **({"elements": f.block_bounds[-1]} if f.block_bounds else {}),
            }
            for f in index.fields
        ],
        "arrays": {
            k: {
                "shape": list(a.shape),
                "chunk_shape": list(a.chunk_shape),
                "chunks_per_shard": a.chunks_per_shard,
                "shards": len(a.shards),
                "compressor": a.compressor,
                "bytes": sum(s.nbytes for s in a.shards),
            }
            for k, a in sorted(index.arrays.items())
        },
        "metadata": index.metadata,
    }


def _print_summary(s: dict[str, Any]) -> None:
    print(f"dataset      {s['uri']}")
    print(f"fingerprint  {s['fingerprint']}")
    print(
        f"samples      {s['num_samples']:,} in {s['num_blocks']:,} blocks"
        + (
            f" of up to {s['rows_per_chunk']:,}, in {s['partitions']:,} partitions"
            if s["partitions"]
            else f" of {s['rows_per_chunk']:,}"
        )
    )
    print(f"stored       {s['stored_bytes'] / 1e6:,.1f} MB")
    print("fields:")
    for f in s["fields"]:
        extra = f" shape {tuple(f['shape'])}" if "shape" in f else ""
        extra += f" ({f['elements']:,} elements)" if "elements" in f else ""
        print(f"  {f['name']:<20} {f['kind']:<7} {f['dtype']:<6}{extra}")
    print("arrays:")
    for k, a in s["arrays"].items():
        print(
            f"  {k:<24} shape {tuple(a['shape'])} chunks {tuple(a['chunk_shape'])}"
            f" x{a['chunks_per_shard']}"
            f"/shard, {a['shards']} shards, {a['bytes'] / 1e6:,.1f} MB"
        )


def _store_opts(args: argparse.Namespace) -> dict[str, Any]:
    return {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataloader", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="convert a folder of .jsonl/.npy files into a dataset")
    c.add_argument("src", type=Path)
    c.add_argument("dest")
    c.add_argument("--format", choices=["auto", "jsonl", "npy"], default="auto")
    c.add_argument("--field", default="data", help="field name for .npy samples")
    c.add_argument(
        "--schema",
        action="append",
        default=[],
        metavar="FIELD=KIND",
        help="declare a field's kind (scalar, fixed, ragged, bytes, str)",
    )
    c.add_argument("--rows-per-chunk", type=int)
    c.add_argument("--compression", choices=["zstd"])
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("--json", action="store_true", help="print the summary as JSON")
    for name in ("info", "verify"):
        q = sub.add_parser(
            name, help="print a dataset's summary" if name == "info" else "check every chunk"
        )
        q.add_argument("uri")
        q.add_argument("--json", action="store_true")
    for sp in sub.choices.values():
        sp.add_argument("--endpoint-url", help="S3 endpoint (e.g. http://127.0.0.1:9000)")
    args = p.parse_args(argv)
    try:
        return _run(args)
    except (CkptStoreError, OSError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    opts = _store_opts(args)
    if args.cmd == "convert":
        fmt, files = _source_files(args.src, args.format)
        schema = {}
        for item in args.schema:
            name, sep, kind = item.partition("=")
            if not sep:
                raise ValueError(f"--schema wants FIELD=KIND, got {item!r}")
            schema[name] = kind
        samples = iter_jsonl(files) if fmt == "jsonl" else iter_npy(files, args.field)
        index = write_dataset(
            args.dest,
            samples,
            schema=schema,
            rows_per_chunk=args.rows_per_chunk,
            compression=args.compression,
            overwrite=args.overwrite,
            store_options=opts,
            metadata={"source": {"format": fmt, "files": len(files)}},
        )
        s = summary(index, args.dest)
    else:
        store = open_store(args.uri, **opts)
        from .dataset import StreamingDataset

        ds = StreamingDataset(store)
        s = summary(ds.index, args.uri)
        if args.cmd == "verify":
            from .pipeline import Executors

            ex = Executors(4)
            try:
                for b0 in range(0, ds.index.num_blocks, 16):
                    ds.reader.load_blocks(list(range(b0, min(b0 + 16, ds.index.num_blocks))), ex.io)
            finally:
                ex.shutdown()
            s["verified"] = True
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        _print_summary(s)
        if s.get("verified"):
            print("verified     every chunk matches its digest")
    return 0


__all__ = ["INDEX_KEY", "main", "summary"]
