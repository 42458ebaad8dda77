"""`ckpt`: inspect and maintain checkpoint repositories from the shell (docs/cli.md).

    ckpt ls URI                       ckpt verify URI [NAME ...] [--sample F]
    ckpt show URI NAME [--keys GLOB]  ckpt gc URI [--grace 1h] [--dry-run] [--wait 0]
    ckpt diff URI A B                 ckpt rm URI NAME ...
    ckpt diff URI_A A URI_B B         ckpt cp SRC_URI DST_URI NAME ...
    ckpt du URI                       ckpt export URI NAME OUT / ckpt import URI NAME IN
    ckpt ls NEAR FAR...               ckpt replicate NEAR FAR [--name N]   (tiers: cli/tiers.py)

Output: tables on a terminal; one JSON document when stdout is not a terminal or with --json
(--table forces tables). Exit codes: 0 ok; 1 the command ran and found a difference or a
problem (diff: different; verify: bad/missing blobs or manifests; ls/du: unreadable manifests
or missing blobs); 2 error (bad arguments, bad URI, unknown checkpoint, corrupt store,
credentials, unreachable endpoint, ...), always one line on stderr; 75 gc did not run because
saves are in progress (try again); 130 interrupted. CKPT_DEBUG=1 adds the traceback of an error
to stderr and changes nothing else (not the exit code). URIs and URLs are shown redacted (user
info, query and fragment hidden: `ckptstore.redact`).

Import path: this module imports neither torch nor boto3; `export`/`import` import torch, S3
URIs import boto3, when used.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from ..redact import redact_text
from .args import positive_int
from .exits import (
    EXIT_BUSY,
    EXIT_ERROR,
    EXIT_FOUND,
    EXIT_INTERRUPTED,
    EXIT_OK,
    UsageError,
    one_line,
)

__all__ = ["EXIT_BUSY", "EXIT_ERROR", "EXIT_FOUND", "EXIT_INTERRUPTED", "EXIT_OK", "UsageError",
           "build_parser", "main", "one_line"]


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (no usage dump) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}{_did_you_mean(message)} (see '{self.prog} --help')")


_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


def _did_you_mean(message: str) -> str:
    """'; did you mean 'ls'?' for argparse's "invalid choice" of a near miss, else ''."""
    found = _INVALID_CHOICE.search(message)
    if found is None:
        return ""
    choices = re.findall(r"'([^']*)'", found.group(2))
    close = difflib.get_close_matches(found.group(1), choices, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def _duration(text: str) -> float:
    from .output import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(text: str) -> int:
    from ..tools.exports import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1]")
    return value


def _add_hf_model_args(p: argparse.ArgumentParser, config_help: str) -> None:
    """The two options naming a Hugging Face model, shared by export and import."""
    p.add_argument("--hf-config", metavar="PATH", help=config_help)
    p.add_argument("--hf-model", metavar="CLASS",
                   help="the transformers model class (default: the config's architectures)")


def build_parser() -> argparse.ArgumentParser:
    from ..version import __version__

    common = _Parser(add_help=False)
    g = common.add_argument_group("common options")
    g.add_argument("--endpoint-url", metavar="URL", default=argparse.SUPPRESS,
                   help="S3 endpoint (MinIO, moto); default: $AWS_ENDPOINT_URL_S3, "
                        "$AWS_ENDPOINT_URL, else AWS")
    g.add_argument("--region", metavar="NAME", default=argparse.SUPPRESS,
                   help="S3 region (default: the standard AWS configuration)")
    g.add_argument("--max-attempts", type=positive_int, metavar="N", default=argparse.SUPPRESS,
                   help="S3: total attempts per request, retries included (default 5)")
    fmt = g.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                     help="print one JSON document (the default when stdout is not a terminal)")
    fmt.add_argument("--table", action="store_true", default=argparse.SUPPRESS,
                     help="print tables even when stdout is not a terminal")

    parser = _Parser(prog="ckpt", parents=[common],
                     description="Inspect and maintain ckptstore checkpoint repositories. "
                                 "URI: a folder, file:///path, or s3://bucket/prefix.",
                     epilog="Exit codes: 0 ok, 1 difference/problem found, 2 error, "
                            "75 gc busy (saves in progress), 130 interrupted.")
    parser.add_argument("--version", action="version", version=f"ckpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_, parents=[common])
        return p

    p = add("ls", "list checkpoints, oldest first")
    p.add_argument("uri", metavar="URI")
    p.add_argument("far", nargs="*", metavar="FAR_URI",
                   help="farther tiers: list the union and on which tiers each checkpoint is")

    p = add("show", "one checkpoint's tensors and values")
    p.add_argument("uri", metavar="URI")
    p.add_argument("name", metavar="NAME", help="checkpoint name, or 'latest'")
    p.add_argument("--keys", metavar="GLOB", action="append",
                   help="only keys matching GLOB (fnmatch; a plain key selects its subtree); "
                        "repeatable")

    p = add("diff", "compare two checkpoints by digest (exit 0 same, 1 different)")
    p.add_argument("args", nargs="+", metavar="ARG", help="URI A B, or URI_A A URI_B B")

    p = add("du", "space used: logical vs stored, dedup, what deleting each would free")
    p.add_argument("uri", metavar="URI")

    p = add("verify", "re-read and re-hash the blobs of checkpoints (exit 1 on problems)")
    p.add_argument("uri", metavar="URI")
    p.add_argument("names", nargs="*", metavar="NAME", help="default: every checkpoint")
    p.add_argument("--sample", type=_fraction, default=1.0, metavar="FRACTION",
                   help="check a random fraction of the blobs (default 1: all)")
    p.add_argument("--workers", type=positive_int, default=8, metavar="N")

    p = add("gc", "delete blobs no checkpoint references, older than the grace period")
    p.add_argument("uri", metavar="URI")
    p.add_argument("--grace", type=_duration, default=3600.0, metavar="DURATION",
                   help="keep unreferenced blobs younger than this (default 1h; e.g. 0, 30s, "
                        "10m)")
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    p.add_argument("--wait", type=_duration, default=0.0, metavar="DURATION",
                   help="while saves are in progress, retry for this long (default 0: give "
                        "up at once with exit code 75)")

    p = add("rm", "delete checkpoints (their blobs are freed by a later gc)")
    p.add_argument("uri", metavar="URI")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.add_argument("--dry-run", action="store_true",
                   help="say which checkpoints would be deleted, delete nothing")

    p = add("cp", "copy checkpoints between stores, sending only missing blobs")
    p.add_argument("src", metavar="SRC_URI")
    p.add_argument("dst", metavar="DST_URI")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.add_argument("--workers", type=positive_int, default=8, metavar="N")
    p.add_argument("--verify", action="store_true",
                   help="after the copy, re-read and re-hash the copied checkpoints in DST")
    p.add_argument("--src-endpoint-url", metavar="URL",
                   help="endpoint of SRC when it differs from --endpoint-url")

    p = add("export", "write a checkpoint as safetensors (one file, or Hugging Face-style "
                      "shards), a weights-only torch file, or a zarr v3 group")
    p.add_argument("uri", metavar="URI")
    p.add_argument("name", metavar="NAME")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--format", choices=("safetensors", "torch", "zarr"),
                   help="default: from OUT's suffix (.safetensors; .pt/.pth/.bin; .zarr); "
                        "safetensors to an OUT not ending in .safetensors writes a folder of "
                        "shards with model.safetensors.index.json")
    p.add_argument("--max-shard-size", type=_size, default=None, metavar="SIZE",
                   help="largest safetensors shard (default 5GB; GB = 10^9, GiB = 2^30)")
    p.add_argument("--keys", metavar="GLOB", action="append",
                   help="only these keys; one plain name of a subtree (--keys model) exports "
                        "its keys relative to it (model.x -> x)")
    p.add_argument("--strip-prefix", metavar="PREFIX",
                   help="export only the keys below PREFIX, named relative to it")
    p.add_argument("--keep-prefix", action="store_true",
                   help="with --keys NAME, keep the full keys (model.x)")
    _add_hf_model_args(p, "(safetensors folder) a Hugging Face config.json or its folder: "
                          "copied into OUT, and the keys checked against that model")
    p.add_argument("--keep-tied", action="store_true",
                   help="(safetensors folder) write tied tensors as copies, not once")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")

    p = add("import", "save a safetensors file or Hugging Face folder, torch file or DCP "
                      "directory as a checkpoint")
    p.add_argument("uri", metavar="URI")
    p.add_argument("name", metavar="NAME")
    p.add_argument("source", metavar="IN")
    p.add_argument("--format", choices=("safetensors", "torch", "dcp"),
                   help="default: detected from IN")
    p.add_argument("--metadata", metavar="JSON", help="user metadata, a JSON object")
    p.add_argument("--compression", metavar="CODEC",
                   help="zstd, zstd:LEVEL, lz4, blosc or none (default: the store's default)")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow reading a DCP directory, whose .metadata is a pickle that can "
                        "run code: only for sources you trust")
    p.add_argument("--prefix", metavar="NAME",
                   help="store everything below this dotted key (model: {\"model\": state})")
    _add_hf_model_args(p, "(safetensors) the model's config.json, to tie again the tied "
                          "weights the files leave out (default: config.json in the folder "
                          "imported)")
    from .tiers import add_replicate_parser

    add_replicate_parser(add)
    return parser


def debug_enabled() -> bool:
    """CKPT_DEBUG set to anything but '' or '0'."""
    return os.environ.get("CKPT_DEBUG", "") not in ("", "0")


def _write_traceback(exc: BaseException) -> None:
    """The traceback of `exc` on stderr (CKPT_DEBUG), every URL in it redacted."""
    import traceback

    sys.stderr.write(redact_text("".join(traceback.format_exception(exc))))


def main(argv: Sequence[str] | None = None) -> int:
    """Run `ckpt` with `argv` (default sys.argv[1:]); returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        sys.stderr.write(f"ckpt: error: {one_line(exc)}\n")
        return EXIT_ERROR
    if args.command is None:
        sys.stderr.write("ckpt: error: choose a command: ls, show, diff, du, verify, gc, rm, "
                         "cp, export, import, replicate (see 'ckpt --help')\n")
        return EXIT_ERROR
    from . import commands
    from .output import Output

    json_mode = getattr(args, "json", False) or (
        not getattr(args, "table", False) and not sys.stdout.isatty())
    out = Output(json_mode)
    try:
        return commands.run(args, out)
    except KeyboardInterrupt:
        sys.stderr.write("ckpt: interrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `ckpt ls | head`: the reader left; not an error
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - every error is one line, never a traceback
        if debug_enabled():  # adds the traceback; the line and exit code stay the same
            _write_traceback(exc)
        code, message = commands.classify(exc)
        sys.stderr.write(f"ckpt: {message}\n")
        return code
