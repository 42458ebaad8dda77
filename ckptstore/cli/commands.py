"""The `ckpt` sub-commands. Each takes the parsed arguments and an Output, prints one result
(JSON document or tables) and returns an exit code; errors propagate to `main`, which prints
them as one line (see `classify`).

Why one module: one short function per sub-command, sharing the repository
opening and error classification above them; a file per command would repeat those.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from ..errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    ExportWarning,
    FormatError,
    LeaseBusyError,
)
from ..format.manifest import Manifest
from ..layout import BLOB_PREFIX, MANIFEST_PREFIX, manifest_key
from ..maintenance import checks as maintenance
from ..maintenance import leases
from ..redact import redact_uri
from ..repository import REPO_DEFAULT, CheckpointStore, Compression, ManifestProblem
from ..tools import inspection
from .exits import EXIT_BUSY, EXIT_ERROR, EXIT_FOUND, EXIT_OK, UsageError, one_line
from .output import Output, finite, human_bytes, human_duration, iso_time, line, table
from .repos import open_repo


# --------------------------------------------------------------------------- plumbing
def classify(exc: BaseException) -> tuple[int, str]:
    """Exit code and one-line message (URLs redacted) for an error that reached `main`."""
    text = one_line(exc)
    if isinstance(exc, LeaseBusyError):
        return EXIT_BUSY, f"busy: {text}"
    if isinstance(exc, UsageError):
        return EXIT_ERROR, f"error: {text}"
    if isinstance(exc, CkptStoreError):
        return EXIT_ERROR, f"error: {text}"
    if isinstance(exc, OSError):
        return EXIT_ERROR, f"error: {text}"
    if isinstance(exc, (ValueError, TypeError, KeyError)):
        return EXIT_ERROR, f"error: {text}"
    return EXIT_ERROR, (f"internal error: {type(exc).__name__}: {text} (set CKPT_DEBUG=1 for a "
                        "traceback, and please report it)")


def load_manifests(repo: CheckpointStore) -> tuple[list[Manifest], list[dict[str, str]]]:
    """Every readable manifest in commit order, and every object under checkpoints/ that is
    not one (a torn or corrupt manifest, a stray file such as `._step-1.json`) as problems."""
    problems = repo.problems()  # reads every manifest once; the repository caches them
    bad = {p.key for p in problems}
    manifests = [m for name in repo.history() if manifest_key(name) not in bad
                 and (m := repo.find_manifest(name)) is not None]
    return manifests, _errors_of(problems)


def _errors_of(problems: list[ManifestProblem]) -> list[dict[str, str]]:
    return [{"name": _shown_name(p.key), "key": p.key, "error": " ".join(p.reason.split())}
            for p in problems]


def _index_errors(scan: inspection.UsageScan) -> list[dict[str, str]]:
    """The checkpoints a space accounting left out: an index blob of theirs is missing or
    damaged (reported like an unreadable manifest; `ckpt verify` names the blob)."""
    return [{"name": name, "key": manifest_key(name),
             "error": f"{why} (its index cannot be read: run 'ckpt verify')"}
            for name, why in scan.unreadable]


def _shown_name(key: str) -> str:
    """The checkpoint name a key under checkpoints/ would have (for junk: its file name)."""
    name = key[len(MANIFEST_PREFIX):]
    return name[: -len(".json")] if name.endswith(".json") else name


def _report_manifest_errors(out: Output, errors: list[dict[str, str]]) -> None:
    for e in errors:
        out.note(f"warning: unreadable manifest of {e['name']!r}: {e['error']}")


def _step(meta: dict[str, Any]) -> Any:
    return meta.get("step")


def _compact(value: Any, limit: int = 48) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run(args: argparse.Namespace, out: Output) -> int:
    handler = COMMANDS[args.command]
    return handler(args, out)


# --------------------------------------------------------------------------- ls
def cmd_ls(args: argparse.Namespace, out: Output) -> int:
    if getattr(args, "far", None):  # several tiers: cli/tiers.py
        from .tiers import cmd_ls_tiers

        return cmd_ls_tiers(args, out)
    with open_repo(args.uri, args) as repo:
        # two parsed manifests at a time (UsageScan.added): each summarized, then dropped
        problems: list[ManifestProblem] = []
        scan = inspection.UsageScan(skip_unreadable=True)
        rows: list[dict[str, Any]] = []
        for m in scan.added(repo.each_manifest(problems)):
            rows.append({"name": m.name, "created": iso_time(m.created),
                         "created_unix": m.created, "parent": m.parent, "metadata": m.metadata,
                         "tensors": len(m.tensors)})
        errors = _errors_of(problems) + _index_errors(scan)
        use = scan.usage()
        for r, u in zip(rows, use.checkpoints):
            r.update(logical_bytes=u.logical_bytes, unique_bytes=u.unique_bytes)
        doc = {"uri": repo.uri, "checkpoints": rows, "errors": errors}

        def render(console: Any) -> None:
            if not rows and not errors:
                line(console, f"no checkpoints in {repo.uri}")
                return
            extra = any(set(r["metadata"]) - {"step"} for r in rows)
            cols = ["NAME", "CREATED (UTC)", "STEP", "TENSORS", "SIZE", "UNIQUE"]
            cols += ["METADATA"] if extra else []
            body = []
            for r in rows:
                row = [r["name"], r["created"].replace("T", " ").rstrip("Z"),
                       _step(r["metadata"]), r["tensors"], human_bytes(r["logical_bytes"]),
                       human_bytes(r["unique_bytes"])]
                if extra:
                    row.append(_compact({k: v for k, v in r["metadata"].items() if k != "step"}))
                body.append(row)
            for e in errors:
                body.append([e["name"], "UNREADABLE", "", "", "", ""] + ([""] if extra else []))
            table(console, cols, body, right=("STEP", "TENSORS", "SIZE", "UNIQUE"))
            line(console, f"{len(rows)} checkpoint(s), {human_bytes(use.logical_bytes)} logical, "
                          f"{human_bytes(use.referenced_bytes)} stored. UNIQUE: stored bytes only "
                          "that checkpoint uses (freed by rm + gc).")

        out.emit(doc, render)
        _report_manifest_errors(out, errors)
        return EXIT_FOUND if errors else EXIT_OK


# --------------------------------------------------------------------------- show
def cmd_show(args: argparse.Namespace, out: Output) -> int:
    with open_repo(args.uri, args) as repo:
        m = repo.manifest(args.name)
        match = inspection.key_matcher(args.keys)
        chosen = [leaf for leaf in inspection.leaves(m) if match(leaf.key)]
        if args.keys and not chosen:
            raise CheckpointNotFoundError(
                f"checkpoint {m.name!r} has no keys matching {', '.join(args.keys)}")
        tensors, values = [], []
        for leaf in chosen:
            if leaf.entry is not None:
                d = {"key": leaf.key, **inspection.describe_tensor(leaf.entry),
                     "alias_of": leaf.alias_of}
                tensors.append(d)
            else:
                typ, val = inspection.value_of(leaf.node)
                values.append({"key": leaf.key, "type": typ, "value": val})
        entries = {id(leaf.entry): leaf.entry for leaf in chosen if leaf.entry is not None}
        blobs = {c.blob for e in entries.values() for c in e.chunks}
        totals = {
            "tensors": len(tensors), "values": len(values),
            "logical_bytes": sum(e.nbytes for e in entries.values()),
            "stored_bytes": sum(c.size for e in entries.values() for c in e.chunks),
            "chunks": sum(len(e.chunks) for e in entries.values()), "blobs": len(blobs),
        }
        doc = {"uri": repo.uri, "name": m.name, "created": iso_time(m.created),
               "created_unix": m.created, "parent": m.parent, "metadata": m.metadata,
               "tensors": tensors, "values": values, "totals": totals}

        def render(console: Any) -> None:
            line(console, f"{m.name}  created {iso_time(m.created)}"
                          + (f"  parent {m.parent}" if m.parent else ""))
            if m.metadata:
                line(console, f"metadata: {_compact(m.metadata, 200)}")
            if tensors:
                table(console, ["KEY", "DTYPE", "SHAPE", "SIZE", "CHUNKS", "CODEC", "NOTE"],
                      [[t["key"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar",
                        human_bytes(t["bytes"]), t["chunks"], t["codec"] or "raw",
                        (f"= {t['alias_of']}" if t["alias_of"] else
                         ("" if t["kind"] == "torch" else t["kind"]))] for t in tensors],
                      right=("SIZE", "CHUNKS"))
            if values:
                table(console, ["KEY", "TYPE", "VALUE"],
                      [[v["key"], v["type"], _compact(v["value"], 60)] for v in values])
            line(console, f"{totals['tensors']} tensor(s), {totals['values']} value(s); "
                          f"{human_bytes(totals['logical_bytes'])} logical, "
                          f"{human_bytes(totals['stored_bytes'])} stored in "
                          f"{totals['chunks']} chunk(s), {totals['blobs']} blob(s)")

        out.emit(doc, render)
        return EXIT_OK


# --------------------------------------------------------------------------- diff
def cmd_diff(args: argparse.Namespace, out: Output) -> int:
    if len(args.args) == 3:
        uri_a, a, b = args.args
        uri_b = uri_a
    elif len(args.args) == 4:
        uri_a, a, uri_b, b = args.args
    else:
        raise UsageError("diff takes URI A B, or URI_A A URI_B B (see 'ckpt diff --help')")
    with open_repo(uri_a, args) as repo_a:
        if uri_b == uri_a:
            ma, mb = repo_a.manifest(a), repo_a.manifest(b)
            where_b = repo_a.uri
        else:
            with open_repo(uri_b, args) as repo_b:
                ma, mb = repo_a.manifest(a), repo_b.manifest(b)
                where_b = repo_b.uri
        d = inspection.diff(ma, mb)
        doc = {
            "a": {"uri": repo_a.uri, "name": ma.name}, "b": {"uri": where_b, "name": mb.name},
            "same": d.same, "added": list(d.added), "removed": list(d.removed),
            "changed": [{"key": c.key, "detail": c.detail} for c in d.changed],
            "unchanged": list(d.unchanged),
            "counts": {"added": len(d.added), "removed": len(d.removed),
                       "changed": len(d.changed), "unchanged": len(d.unchanged)},
            "metadata": {k: {"a": va, "b": vb} for k, (va, vb) in d.metadata.items()},
        }

        def render(console: Any) -> None:
            rows = ([["+", k, "added"] for k in d.added]
                    + [["-", k, "removed"] for k in d.removed]
                    + [["~", c.key, c.detail] for c in d.changed])
            if rows:
                table(console, ["", "KEY", "CHANGE"], rows)
            for k, (va, vb) in d.metadata.items():
                line(console, f"metadata {k}: {_compact(va)} -> {_compact(vb)}")
            verdict = "same contents" if d.same else "different"
            line(console, f"{ma.name} -> {mb.name}: {verdict} ({len(d.added)} added, "
                          f"{len(d.removed)} removed, {len(d.changed)} changed, "
                          f"{len(d.unchanged)} unchanged; compared by digest)")

        out.emit(doc, render)
        return EXIT_OK if d.same else EXIT_FOUND


# --------------------------------------------------------------------------- du
def cmd_du(args: argparse.Namespace, out: Output) -> int:
    with open_repo(args.uri, args) as repo:
        problems: list[ManifestProblem] = []
        scan = inspection.UsageScan(live=True, skip_unreadable=True)
        checkpoints = 0
        for _m in scan.added(repo.each_manifest(problems)):  # two parsed at a time
            checkpoints += 1
        errors = _errors_of(problems) + _index_errors(scan)
        sizes: dict[str, int] = {}
        for info in repo.store.list(BLOB_PREFIX):
            sizes[info.key.rsplit("/", 1)[-1]] = info.size
        manifest_bytes = sum(i.size for i in repo.store.list(MANIFEST_PREFIX))
        use = scan.usage(sizes)
        live = scan.live_bytes
        rows: list[dict[str, Any]] = [{"name": u.name, "logical_bytes": u.logical_bytes,
                 "referenced_bytes": u.referenced_bytes, "unique_bytes": u.unique_bytes,
                 "blobs": u.blobs, "unique_blobs": u.unique_blobs} for u in use.checkpoints]
        totals = {
            "checkpoints": checkpoints, "logical_bytes": use.logical_bytes,
            "referenced_bytes": use.referenced_bytes, "referenced_blobs": use.referenced_blobs,
            "dedup_ratio": finite(use.dedup_ratio), "blob_bytes": use.blob_bytes,
            "blobs": use.blobs, "unreferenced_blobs": use.unreferenced_blobs,
            "unreferenced_bytes": use.unreferenced_bytes, "manifest_bytes": manifest_bytes,
            "missing_blobs": len(use.missing_blobs), "live_bytes": live,
        }
        doc = {"uri": repo.uri, "checkpoints": rows, "totals": totals,
               "missing_blobs": list(use.missing_blobs), "errors": errors}

        def render(console: Any) -> None:
            if rows:
                table(console, ["NAME", "LOGICAL", "STORED", "FREED IF DELETED"],
                      [[r["name"], human_bytes(r["logical_bytes"]),
                        human_bytes(r["referenced_bytes"]), human_bytes(r["unique_bytes"])]
                       for r in rows], right=("LOGICAL", "STORED", "FREED IF DELETED"))
            ratio = totals["dedup_ratio"]
            line(console, f"logical {human_bytes(use.logical_bytes)} in {checkpoints} "
                          f"checkpoint(s); stored {human_bytes(use.referenced_bytes)} in "
                          f"{use.referenced_blobs} referenced blob(s); dedup ratio "
                          + (f"{ratio:.2f}x" if ratio is not None else "-"))
            dead = use.referenced_bytes - live
            line(console, f"live {human_bytes(live)}: the chunks the checkpoints reference; "
                          f"their blobs hold {human_bytes(use.referenced_bytes)}"
                          + (f" ({human_bytes(dead)} only in partly dead packs)" if dead else ""))
            line(console, f"blobs/ holds {human_bytes(use.blob_bytes)} in {use.blobs} blob(s); "
                          f"unreferenced {human_bytes(use.unreferenced_bytes)} in "
                          f"{use.unreferenced_blobs} (gc frees them after the grace period); "
                          f"manifests {human_bytes(manifest_bytes)}")

        out.emit(doc, render)
        _report_manifest_errors(out, errors)
        if use.missing_blobs:
            out.note(f"warning: {len(use.missing_blobs)} referenced blob(s) are missing; run "
                     "'ckpt verify' to see which checkpoints they break")
        return EXIT_FOUND if errors or use.missing_blobs else EXIT_OK


# --------------------------------------------------------------------------- verify
def cmd_verify(args: argparse.Namespace, out: Output) -> int:
    with open_repo(args.uri, args) as repo:
        manifest_errors: list[dict[str, str]] = []
        if args.names:
            manifests = []
            for name in dict.fromkeys(args.names):
                try:
                    manifests.append(repo.manifest(name))
                except FormatError as exc:
                    manifest_errors.append({"name": name, "error": " ".join(str(exc).split())})
        else:
            manifests, manifest_errors = load_manifests(repo)
        blobs = len(maintenance.chunk_blobs(manifests))  # chunk tables: no entries kept
        expected = blobs if args.sample >= 1 else max(1, round(blobs * args.sample)) if blobs else 0
        with out.progress("verifying blobs", total=expected, unit="blobs") as bar:
            report = maintenance.verify(repo.store, manifests, repo.hash, sample=args.sample,
                                        workers=args.workers, progress=bar.advance)
        problems: list[dict[str, Any]] = [{"blob": p.blob, "problem": p.problem,
                                           "detail": p.detail,
                     "checkpoints": list(p.checkpoints), "keys": list(p.keys)}
                    for p in report.problems]
        if args.sample >= 1 and report.ok:  # (verify counts what it read: index blobs per
            # use; with an index blob bad, the extents cannot all be known)
            report.bytes_checked = sum(inspection.blob_extents(manifests).values())
        ok = report.ok and not manifest_errors
        doc = {"uri": repo.uri, "checkpoints": report.checkpoints, "sample": args.sample,
               "blobs_checked": report.blobs_checked, "bytes_checked": report.bytes_checked,
               "seconds": round(report.seconds, 3), "ok": ok, "problems": problems,
               "manifest_problems": manifest_errors}

        def render(console: Any) -> None:
            if problems:
                table(console, ["BLOB", "PROBLEM", "CHECKPOINTS", "KEYS", "DETAIL"],
                      [[p["blob"], p["problem"], ", ".join(p["checkpoints"]),
                        _list(p["keys"]), p["detail"]] for p in problems])
            for e in manifest_errors:
                line(console, f"checkpoint {e['name']}: unreadable manifest: {e['error']}")
            sampled = "" if args.sample >= 1 else f" (sample {args.sample:g})"
            verdict = "OK" if ok else (f"{len(problems)} bad blob(s), {len(manifest_errors)} "
                                       "unreadable manifest(s)")
            line(console, f"verified {len(report.checkpoints)} checkpoint(s): "
                          f"{report.blobs_checked} blob(s), {human_bytes(report.bytes_checked)}"
                          f"{sampled} in {human_duration(report.seconds)}: {verdict}")

        out.emit(doc, render)
        if not ok and out.json_mode:
            out.note(f"verify found problems: {len(problems)} bad blob(s), "
                     f"{len(manifest_errors)} unreadable manifest(s)")
        return EXIT_OK if ok else EXIT_FOUND


def _list(items: Sequence[str], limit: int = 4) -> str:
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


# --------------------------------------------------------------------------- gc
def cmd_gc(args: argparse.Namespace, out: Output) -> int:
    with open_repo(args.uri, args) as repo:
        busy = [lease for lease in leases.list_leases(repo.store) if lease.kind == "save"]
        if args.dry_run:
            report = repo.gc(args.grace, dry_run=True)
        else:
            with out.progress("collecting garbage", unit="blobs"):
                report = repo.gc(args.grace, wait=args.wait)
            busy = []
        doc = {"uri": repo.uri, "dry_run": report.dry_run, "grace_seconds": args.grace,
               "referenced_blobs": report.referenced_blobs,
               "deleted_blobs": report.deleted_blobs, "freed_bytes": report.freed_bytes,
               "kept_young_blobs": report.kept_young_blobs,
               "min_age_seconds": report.min_age_seconds,
               "deleted_temp_files": report.deleted_temp_files,
               "removed_stale_leases": report.removed_stale_leases,
               "saves_in_progress": len(busy),
               "seconds": round(report.seconds, 3), "deleted": report.deleted}

        def render(console: Any) -> None:
            verb = "would delete" if report.dry_run else "deleted"
            line(console, f"{verb} {report.deleted_blobs} blob(s) and "
                          f"{report.deleted_temp_files} temp file(s), "
                          f"{human_bytes(report.freed_bytes)}; kept {report.referenced_blobs} "
                          f"referenced and {report.kept_young_blobs} unreferenced blob(s) "
                          f"younger than {report.min_age_seconds:g}s")

        out.emit(doc, render)
        if busy:
            out.note(f"note: {len(busy)} save(s) in progress ({leases.describe(busy)}); a real "
                     "gc would wait for them")
        return EXIT_OK


# --------------------------------------------------------------------------- rm
def cmd_rm(args: argparse.Namespace, out: Output) -> int:
    with open_repo(args.uri, args) as repo:
        targets: list[str] = []
        for name in dict.fromkeys(args.names):
            if name == "latest":
                manifests, _errors = load_manifests(repo)
                if not manifests:
                    raise CheckpointNotFoundError(f"no checkpoints in {repo.uri}")
                name = manifests[-1].name
            elif not repo.exists(name):  # validates the name; a corrupt manifest is removable
                raise CheckpointNotFoundError(f"no checkpoint {name!r} in {repo.uri}; nothing "
                                              "deleted")
            if name not in targets:
                targets.append(name)
        if not args.dry_run:
            for name in targets:
                repo.delete(name)
        doc = {"uri": repo.uri, "dry_run": args.dry_run, "deleted": targets}

        def render(console: Any) -> None:
            if args.dry_run:
                line(console, f"would delete {len(targets)} checkpoint(s): "
                              f"{', '.join(targets)}; nothing deleted (--dry-run)")
                return
            line(console, f"deleted {len(targets)} checkpoint(s): {', '.join(targets)}; run "
                          "'ckpt gc' to free their blobs")

        out.emit(doc, render)
        return EXIT_OK


# --------------------------------------------------------------------------- cp
def cmd_cp(args: argparse.Namespace, out: Output) -> int:
    from ..tools.copying import copy_checkpoints

    with open_repo(args.src, args, endpoint_url=args.src_endpoint_url,
                   workers=args.workers) as src, \
            open_repo(args.dst, args, create=True, workers=args.workers) as dst:
        with out.progress(f"copying to {dst.uri}") as bar:
            report = copy_checkpoints(src, dst, args.names, workers=args.workers,
                                      progress=bar.advance, on_total=bar.set_total)
        verified: bool | None = None
        problems: list[dict[str, Any]] = []
        if args.verify and report.copied + report.skipped:
            manifests = [dst.manifest(n) for n in report.copied + report.skipped]
            vr = maintenance.verify(dst.store, manifests, dst.hash, workers=args.workers)
            verified = vr.ok
            problems = [{"blob": p.blob, "problem": p.problem, "checkpoints": list(p.checkpoints),
                         "keys": list(p.keys)} for p in vr.problems]
        doc = {"src": src.uri, "dst": dst.uri, "copied": report.copied,
               "skipped": report.skipped, "blobs_needed": report.blobs_needed,
               "blobs_present": report.blobs_present, "blobs_sent": report.blobs_sent,
               "bytes_sent": report.bytes_sent, "seconds": round(report.seconds, 3),
               "verified": verified, "problems": problems}

        def render(console: Any) -> None:
            done = []
            if report.copied:
                done.append(f"copied {', '.join(report.copied)}")
            if report.skipped:
                done.append(f"already there (identical): {', '.join(report.skipped)}")
            line(console, f"{dst.uri}: {'; '.join(done)}; sent {report.blobs_sent} of "
                          f"{report.blobs_needed} blob(s), {human_bytes(report.bytes_sent)} in "
                          f"{human_duration(report.seconds)} ({report.blobs_present} already "
                          "there)")
            if verified is not None:
                line(console, "destination verified: OK" if verified else
                     f"destination verify found {len(problems)} bad blob(s)")

        out.emit(doc, render)
        return EXIT_FOUND if verified is False else EXIT_OK


# --------------------------------------------------------------------------- export / import
def cmd_export(args: argparse.Namespace, out: Output) -> int:
    import warnings

    from ..tools import exports, interop

    fmt = interop.export_format(args.out, args.format)  # fail before opening or loading
    if args.keep_prefix and args.strip_prefix is not None:
        raise UsageError("--keep-prefix and --strip-prefix contradict each other")
    exports.check_target(args.out, args.force)
    with open_repo(args.uri, args) as repo:
        keys = None
        strip = args.strip_prefix
        if args.keys:
            m = repo.manifest(args.name)
            match = inspection.key_matcher(args.keys)
            keys = [leaf.key for leaf in inspection.leaves(m) if match(leaf.key)]
            if not keys:
                raise CheckpointNotFoundError(
                    f"checkpoint {m.name!r} has no keys matching {', '.join(args.keys)}")
            if strip is None and not args.keep_prefix:
                strip = exports.subtree_prefix(args.keys, keys)
        with out.progress(f"exporting to {redact_uri(args.out)}", unit="steps"), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", ExportWarning)  # printed below, once
            report = interop.export_checkpoint(repo, args.name, args.out, fmt=fmt, keys=keys,
                                               overwrite=args.force,
                                               max_shard_bytes=args.max_shard_size,
                                               strip_prefix=strip, hf_config=args.hf_config,
                                               hf_model=args.hf_model,
                                               keep_tied=args.keep_tied)
        doc = {"uri": repo.uri, "name": report.name, "out": redact_uri(report.out),
               "format": report.format, "tensors": report.tensors, "bytes": report.bytes,
               "files": report.files, "skipped": report.skipped,
               "converted": report.converted, "strip_prefix": report.strip_prefix,
               "tied": report.tied, "warnings": report.warnings,
               "seconds": round(report.seconds, 3)}

        def render(console: Any) -> None:
            files = f" in {report.files} shard file(s) + index" if report.files > 1 else ""
            line(console, f"exported {report.name}: {report.tensors} tensor(s), "
                          f"{human_bytes(report.bytes)} to {doc['out']} ({report.format}{files}) "
                          f"in {human_duration(report.seconds)}")

        out.emit(doc, render)
        if report.strip_prefix is not None:
            out.note(f"note: keys are relative to {report.strip_prefix!r} "
                     f"({report.strip_prefix}.x -> x)")
        if report.tied:
            out.note(f"note: {len(report.tied)} tied tensor(s) written once, as save_pretrained "
                     "does: " + _list([f"{k} = {v}" for k, v in report.tied.items()]))
        if report.skipped:
            out.note(f"note: {len(report.skipped)} non-tensor value(s) not representable in "
                     f"{report.format} were left out: {_list(report.skipped)}")
        for text in report.notes:
            out.note(f"note: {text}")
        for text in report.warnings:
            out.note(f"WARNING: {text}")
        return EXIT_OK


def cmd_import(args: argparse.Namespace, out: Output) -> int:
    from ..tools import interop

    metadata = None
    if args.metadata is not None:
        try:
            metadata = json.loads(args.metadata)
        except ValueError as exc:
            raise UsageError(f"--metadata is not valid JSON: {exc}") from None
        if not isinstance(metadata, dict):
            raise UsageError("--metadata must be a JSON object, e.g. '{\"step\": 100}'")
    fmt = args.format or interop.detect_format(args.source)
    if fmt == "dcp" and args.trust_pickle:
        out.note(f"note: {redact_uri(args.source)} is a torch.distributed.checkpoint "
                 "directory; its .metadata is a pickle, read by torch trusting its source "
                 "(--trust-pickle)")
    elif fmt == "dcp":
        interop.read_dcp(args.source, trust_pickle=False)  # raises the explanation
    with open_repo(args.uri, args, create=True) as repo:
        compression: Compression = (REPO_DEFAULT if args.compression is None
                                    else args.compression)
        with out.progress(f"importing {redact_uri(args.source)}", unit="steps"):
            report = interop.import_checkpoint(repo, args.name, args.source, fmt=fmt,
                                               metadata=metadata, trust_pickle=args.trust_pickle,
                                               compression=compression, prefix=args.prefix,
                                               hf_config=args.hf_config,
                                               hf_model=args.hf_model)
        doc = {"uri": repo.uri, "name": report.name, "source": redact_uri(report.source),
               "format": report.format, "tensors": report.tensors, "files": report.files,
               "logical_bytes": report.logical_bytes, "written_bytes": report.written_bytes,
               "reused_bytes": report.reused_bytes, "tied": report.tied,
               "restored_int_keys": report.restored_int_keys,
               "seconds": round(report.seconds, 3)}

        def render(console: Any) -> None:
            line(console, f"imported {doc['source']} ({report.format}) as {report.name}: "
                          f"{report.tensors} tensor(s), {human_bytes(report.logical_bytes)}; "
                          f"wrote {human_bytes(report.written_bytes)}, reused "
                          f"{human_bytes(report.reused_bytes)} in {human_duration(report.seconds)}")

        out.emit(doc, render)
        if report.tied:
            out.note(f"note: {len(report.tied)} tied key(s) the files leave out were tied "
                     "again: " + _list([f"{k} = {v}" for k, v in report.tied.items()]))
        for text in report.notes:
            out.note(f"note: {text}")
        return EXIT_OK


def cmd_replicate(args: argparse.Namespace, out: Output) -> int:
    from .tiers import cmd_replicate as replicate

    return replicate(args, out)


COMMANDS = {
    "ls": cmd_ls, "show": cmd_show, "diff": cmd_diff, "du": cmd_du, "verify": cmd_verify,
    "gc": cmd_gc, "rm": cmd_rm, "cp": cmd_cp, "export": cmd_export, "import": cmd_import,
    "replicate": cmd_replicate,
}
