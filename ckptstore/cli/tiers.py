"""`ckpt ls NEAR FAR...` (on which tiers each checkpoint is) and `ckpt replicate NEAR FAR`
(copy what FAR lacks, verified, create-only, with a progress bar).

`replicate` runs the same step as a tiered store's background replication
(ckptstore.tiers.replication.replicate_checkpoint): blobs FAR lacks, each re-hashed on the
way, made durable, then the manifest create-only; it resumes where a killed run stopped.
It leaves the pending records of tier 0 alone: a tiered store reopened later finds those
checkpoints already replicated and clears them.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from .args import positive_int
from .exits import EXIT_FOUND, EXIT_OK

if TYPE_CHECKING:  # the parser imports this module: the rest is imported when a command runs
    from ..repository import CheckpointStore
    from .output import Output


def open_tiers(uris: list[str], args: argparse.Namespace, *, create: bool = False,
               workers: int = 8) -> list[CheckpointStore]:
    """Each URI opened as its own repository (as every other command opens one)."""
    from .repos import open_repo

    repos: list[CheckpointStore] = []
    try:
        for i, uri in enumerate(uris):
            repos.append(open_repo(uri, args, create=create and i > 0, workers=workers))
    except BaseException:
        for r in repos:
            r.close()
        raise
    return repos


def cmd_ls_tiers(args: argparse.Namespace, out: Output) -> int:
    """`ckpt ls NEAR FAR...`: the union of the tiers' checkpoints, oldest first, and where
    each one is committed (and whether tier 0 still has to replicate it)."""
    from ..repository import CheckpointStore
    from ..tiers import pending
    from .output import human_bytes, iso_time, line, table

    repos = open_tiers([args.uri, *args.far], args)
    try:
        tiered = CheckpointStore([r.store for r in repos], create=False, replicate=False)
        records = {r.name: r.tiers for r in pending.read_records(repos[0].store)}
        rows: list[dict[str, Any]] = []
        for name in tiered.history():
            m = tiered.find_manifest(name)
            if m is None:
                continue
            rows.append({"name": name, "created": iso_time(m.created),
                         "created_unix": m.created, "metadata": m.metadata,
                         "logical_bytes": m.logical_bytes,
                         "tiers": [r.uri for r in repos if r.exists(name)],
                         "pending_tiers": [repos[t].uri for t in records.get(name, ())
                                           if t < len(repos) and not repos[t].exists(name)]})
        doc: dict[str, Any] = {"tiers": [r.uri for r in repos], "checkpoints": rows}

        def render(console: Any) -> None:
            if not rows:
                line(console, f"no checkpoints on {', '.join(doc['tiers'])}")
                return
            cols = ["NAME", "CREATED (UTC)", "STEP", "SIZE",
                    *[f"T{i}" for i in range(len(repos))]]
            body = []
            for r in rows:
                marks = ["yes" if u in r["tiers"] else "pending" if u in r["pending_tiers"]
                         else "-" for u in doc["tiers"]]
                body.append([r["name"], r["created"].replace("T", " ").rstrip("Z"),
                             r["metadata"].get("step"), human_bytes(r["logical_bytes"]),
                             *marks])
            table(console, cols, body, right=("STEP", "SIZE"))
            for i, uri in enumerate(doc["tiers"]):
                line(console, f"T{i}: {uri}")

        out.emit(doc, render)  # `tiered` shares the stores of `repos`, closed below
    finally:
        for r in repos:
            r.close()
    return EXIT_OK


def cmd_replicate(args: argparse.Namespace, out: Output) -> int:
    """`ckpt replicate NEAR FAR [--name N ...]`: copy the checkpoints of NEAR that FAR lacks
    (default: all of them, oldest first)."""
    from ..tiers.replication import replicate_checkpoint
    from .output import human_bytes, line

    near, far = open_tiers([args.near, args.far], args, create=True, workers=args.workers)
    try:
        conflicts: list[str] = []
        if args.name:
            names = [near.manifest(n).name for n in args.name]
        else:  # FAR's checkpoint of a name NEAR holds is the same one iff created the same
            theirs, ours = far.known_created(), near.known_created()
            names = [n for n in near.history() if n not in theirs]
            conflicts = sorted(n for n in ours if n in theirs and theirs[n] != ours[n])
        done: list[dict[str, Any]] = []
        total = 0
        with out.progress(f"replicating to {far.uri}") as bar:
            def add_total(n: int) -> None:
                nonlocal total
                total += n
                bar.set_total(total)

            for name in names:
                result = replicate_checkpoint(name, [near.store], far.store, near.hash,
                                              workers=args.workers, progress=bar.advance,
                                              on_total=add_total)
                if result is not None:
                    done.append({"name": name, "already_there": result.already_there,
                                 "blobs_needed": result.blobs_needed,
                                 "blobs_sent": result.blobs_sent,
                                 "bytes_sent": result.bytes_sent,
                                 "seconds": round(result.seconds, 3)})
        doc: dict[str, Any] = {"near": near.uri, "far": far.uri, "replicated": done,
               "bytes_sent": sum(d["bytes_sent"] for d in done), "conflicts": conflicts}

        def render(console: Any) -> None:
            for name in conflicts:
                line(console, f"{name}: {far.uri} holds another checkpoint under this name "
                              "(not replaced)")
            if not done:
                if not conflicts:
                    line(console, f"{far.uri} already holds every checkpoint of {near.uri}")
                return
            for d in done:
                what = ("already there" if d["already_there"] else
                        f"sent {d['blobs_sent']} of {d['blobs_needed']} blob(s), "
                        f"{human_bytes(d['bytes_sent'])}")
                line(console, f"{d['name']}: {what}")
            line(console, f"{len(done)} checkpoint(s) on {far.uri}, "
                          f"{human_bytes(doc['bytes_sent'])} sent")

        out.emit(doc, render)
        if conflicts and out.json_mode:
            out.note(f"{len(conflicts)} checkpoint name(s) on {far.uri} hold other "
                     f"checkpoints: {', '.join(conflicts[:5])}")
    finally:
        near.close()
        far.close()
    return EXIT_FOUND if conflicts else EXIT_OK


def add_replicate_parser(add: Any) -> None:
    """Register `ckpt replicate` (called by cli.build_parser)."""
    p = add("replicate", "copy the checkpoints NEAR has and FAR lacks (verified, resumable)")
    p.add_argument("near", metavar="NEAR")
    p.add_argument("far", metavar="FAR")
    p.add_argument("--name", action="append", metavar="NAME",
                   help="only this checkpoint (repeatable; default: every one FAR lacks)")
    p.add_argument("--workers", type=positive_int, default=8, metavar="N")
