"""`ckpt-data` (also ``python -m dataloader``): convert data into datasets, inspect, verify.

    ckpt-data convert SRC DEST [--format F] [--workers N] ...   SRC: a file or a folder
    ckpt-data info URI [--json]                                 the dataset's summary
    ckpt-data verify URI [--json]                               check every object readers use

Source formats (`--format`, default auto): jsonl, parquet, numpy (.npy/.npz), files (a folder,
one file = one sample), webdataset (tar shards), hf (a Hugging Face dataset saved to disk, a
load_dataset cache folder or an .arrow file);
see dataloader.sources. DEST: a folder, file://, memory:// or s3:// URI.

Conventions shared with `ckpt`: errors are one line on stderr starting with 'ckpt-data:', exit
codes 0 ok, 1 verify found bad or missing objects, 2 error (bad arguments, bad input, missing
dataset, unreachable store), 130 interrupted; sizes in binary units (KiB, MiB); progress bars
on stderr only when it is a terminal; `--version`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ckptstore.errors import CkptStoreError, IntegrityError
from ckptstore.stores import open_store
from ckptstore.toolkit import (
    EXIT_ERROR,
    EXIT_FOUND,
    EXIT_INTERRUPTED,
    EXIT_OK,
    human_bytes,
    one_line,
    positive_int,
    redact_text,
)

from ..errors import MissingShardError
from ..format.index import DatasetIndex
from ..format.spec import INDEX_KEY
from ..sources import FORMATS, open_source
from .progress import counted, progress_bar

PROG = "ckpt-data"


class UsageError(Exception):
    """Bad command-line arguments (one line, exit 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage dump), raised as UsageError."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{PROG} --help')")


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
    print(f"stored       {human_bytes(s['stored_bytes'])}")
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
            f"/shard, {a['shards']} shards, {human_bytes(a['bytes'])}"
        )


def build_parser() -> argparse.ArgumentParser:
    from ckptstore.toolkit import __version__

    common = _Parser(add_help=False)
    common.add_argument("--endpoint-url", metavar="URL",
                        help="S3 endpoint (MinIO, moto, SeaweedFS), e.g. http://127.0.0.1:9000")
    common.add_argument("--json", action="store_true",
                        help="print the summary as one JSON document")
    p = _Parser(prog=PROG, description="Convert files into datasets for the dataloader; "
                "inspect and verify them. DEST/URI: a folder, file://, memory:// or s3://.",
                epilog="Exit codes: 0 ok, 1 verify found bad or missing objects, 2 error, 130"
                       " interrupted.")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)
    c = sub.add_parser("convert", parents=[common], help="convert files into a dataset",
                       description="Convert SRC (a file or a folder) into a dataset at DEST.")
    c.add_argument("src", metavar="SRC")
    c.add_argument("dest", metavar="DEST")
    c.add_argument("--format", choices=["auto", *FORMATS, "npy"], default="auto",
                   help="source format (default: detected from the file names; npy = numpy)")
    c.add_argument("--field", default="data", metavar="NAME",
                   help="field of each .npy file's array (default: data)")
    c.add_argument("--split", metavar="NAME",
                   help="the split of a Hugging Face DatasetDict or load_dataset cache")
    c.add_argument("--schema", action="append", default=[], metavar="FIELD=KIND",
                   help="declare a field's kind: scalar, fixed, ragged, bytes, str (repeatable)")
    c.add_argument("--rows-per-chunk", type=positive_int, metavar="N",
                   help="samples per block (default: about 4 MiB of data)")
    c.add_argument("--compression", choices=["zstd"])
    c.add_argument("--workers", type=positive_int, metavar="N", default=os.cpu_count() or 1,
                   help="threads encoding and writing partitions (default: the number of cores;"
                        " the dataset is the same for every N)")
    c.add_argument("--overwrite", action="store_true",
                   help="replace a dataset at DEST (it is removed before the new one is written)")
    c.add_argument("--no-progress", action="store_true", help="never draw a progress bar")
    for name, help_ in (("info", "print a dataset's summary"),
                        ("verify", "check every chunk, shard index and zarr.json against"
                                   " dataset.json")):
        q = sub.add_parser(name, parents=[common], help=help_, description=help_)
        q.add_argument("uri", metavar="URI")
        if name == "verify":
            q.add_argument("--no-progress", action="store_true", help="never draw a progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run `ckpt-data` with `argv` (default sys.argv[1:]); returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        if args.cmd is None:
            raise UsageError(f"choose a command: convert, info, verify (see '{PROG} --help')")
    except UsageError as exc:
        sys.stderr.write(f"{PROG}: error: {one_line(exc)}\n")
        return EXIT_ERROR
    try:
        return _run(args)
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return EXIT_INTERRUPTED
    except (IntegrityError, MissingShardError) as exc:
        if args.cmd != "verify":
            sys.stderr.write(f"{PROG}: error: {one_line(exc)}\n")
            return EXIT_ERROR
        sys.stderr.write(f"{PROG}: verify failed: {one_line(exc)}\n")
        return EXIT_FOUND
    except (CkptStoreError, OSError, ValueError, TypeError, ImportError, UsageError) as exc:
        sys.stderr.write(f"{PROG}: error: {one_line(exc)}\n")
        return EXIT_ERROR


def _store_opts(args: argparse.Namespace) -> dict[str, Any]:
    return {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}


def _schema(items: list[str]) -> dict[str, str]:
    schema = {}
    for item in items:
        name, sep, kind = item.partition("=")
        if not sep:
            raise UsageError(f"--schema wants FIELD=KIND, got {item!r}")
        schema[name] = kind
    return schema


def convert(args: argparse.Namespace) -> dict[str, Any]:
    """The `convert` command: returns the new dataset's summary."""
    from ..write.api import write_dataset
    from ..write.dataset_writer import clear_target
    from ..write.partitions import gc_partitions

    opts = _store_opts(args)
    fmt = "numpy" if args.format == "npy" else args.format
    source = open_source(args.src, fmt, field=args.field, split=args.split)
    schema = _schema(args.schema)
    store = open_store(args.dest, **opts)
    try:
        if store.exists(INDEX_KEY) and not args.overwrite:
            raise FileExistsError(
                f"{store.uri}: a dataset exists here already (pass --overwrite to replace it)"
            )
        show = not (args.no_progress or args.json)
        try:
            if source.file_samples is not None and isinstance(args.dest, str) and not (
                args.dest.startswith("memory://")
            ):  # file by file, in processes: parsing scales too
                from ..write.by_file import convert_by_file

                if args.overwrite:
                    clear_target(store, True)
                with progress_bar(f"converting {source.format}", source.num_samples,
                                  show) as advance:
                    index = convert_by_file(
                        args.dest, source, args.workers, schema=schema,
                        rows_per_chunk=args.rows_per_chunk, compression=args.compression,
                        store_options=opts, metadata={"source": source.metadata()},
                        on_samples=advance,
                    )
            else:
                samples = counted(source.samples(), f"converting {source.format}",
                                  source.num_samples, show)
                index = write_dataset(
                    store, samples, workers=args.workers, schema=schema,
                    rows_per_chunk=args.rows_per_chunk, compression=args.compression,
                    overwrite=args.overwrite, metadata={"source": source.metadata()},
                )
        except BaseException:
            if not store.exists(INDEX_KEY):  # nothing was committed: drop the partial parts
                gc_partitions(store, grace_seconds=0)
            raise
        return summary(index, args.dest)
    finally:
        store.close()


def verify(args: argparse.Namespace) -> int:
    """The `verify` command: every object a zarr reader or ours uses, checked against
    dataset.json (dataloader/read/verify.py); each problem is one line on stderr. Exit 1 if any."""
    from ..read.verify import verify_dataset

    show = not (args.no_progress or args.json)
    store = open_store(args.uri, **_store_opts(args))
    try:
        report = verify_dataset(
            store, progress=lambda total: progress_bar("verifying shards", total, show))
    finally:
        store.close()
    s = summary(report.index, args.uri) if report.index is not None else {"uri": args.uri}
    s["verified"] = report.ok
    s["checked"] = {"shards": report.shards, "chunks": report.chunks,
                    "bytes_read": report.bytes_read}
    if not report.ok:
        s["problems"] = report.problems
        s["problem_count"] = report.total_problems
    if args.json:
        print(json.dumps(s, indent=2))
    elif report.index is not None:
        _print_summary(s)
        if report.ok:
            print(f"verified     {report.shards:,} shards and {report.chunks:,} chunks, their "
                  "shard indexes and every zarr.json match dataset.json")
    for problem in report.problems:
        sys.stderr.write(f"{PROG}: verify failed: {redact_text(' '.join(problem.split()))}\n")
    if report.total_problems > len(report.problems):
        sys.stderr.write(f"{PROG}: verify failed: {report.total_problems - len(report.problems):,}"
                         " more problems not listed\n")
    return EXIT_OK if report.ok else EXIT_FOUND


def _run(args: argparse.Namespace) -> int:
    if args.cmd == "verify":
        return verify(args)
    if args.cmd == "convert":
        s = convert(args)
    else:
        from ..loading.dataset import StreamingDataset

        ds = StreamingDataset(args.uri, store_options=_store_opts(args))
        s = summary(ds.index, args.uri)
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        _print_summary(s)
    return EXIT_OK


__all__ = ["INDEX_KEY", "PROG", "build_parser", "main", "summary"]
