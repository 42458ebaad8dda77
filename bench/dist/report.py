"""Rows, ratios, the rich table and the markdown table of bench/dist_bench.py."""

from __future__ import annotations

from typing import Any

GB = 1e9


def _gbps(nbytes: int, s: float | None) -> float | None:
    return nbytes / s / GB if s else None


def rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (world, case, operation): seconds and logical GB/s of both contestants,
    speed ratio ckptstore/DCP (= DCP seconds / ckptstore seconds; > 1: ckptstore faster) and
    the raw limit for that direction."""
    out = []
    full = results.get("full", {})
    reshard = results.get("reshard", {})
    for w, by_case in full.items():
        for case, r in by_case.items():
            if not isinstance(r, dict) or "logical_bytes" not in r:
                continue
            n = r["logical_bytes"]
            ck, dc, raw = r["ckptstore"], r["dcp"], r["raw"]
            items = [
                (
                    "save (sync)",
                    ck["save"]["best_s"],
                    dc["save"]["best_s"],
                    raw["write"]["s"],
                    f"DCP best of thread_count "
                    f"{'/'.join(dc['save']['by_threads'])}: {dc['save']['best_threads']}",
                ),
                (
                    "async save: blocked",
                    ck["async"]["steady_blocked_s"],
                    dc["async"]["steady_blocked_s"],
                    None,
                    f"steady state (2nd call); DCP config {dc['async'].get('config')}",
                ),
                (
                    "async save: total",
                    ck["async"]["steady_total_s"],
                    dc["async"]["steady_total_s"],
                    raw["write"]["s"],
                    "steady state (2nd call)",
                ),
                (
                    "restore in place",
                    ck["restore"]["s"],
                    dc["load"]["s"],
                    raw["read"]["s"],
                    "warm page cache",
                ),
            ]
            for src, by in reshard.get(w, {}).items():
                if case in by:
                    items.append(
                        (
                            f"restore, saved on {src} ranks",
                            by[case]["ckptstore"]["s"],
                            by[case]["dcp"]["s"],
                            raw["read"]["s"],
                            "resharded",
                        )
                    )
            for op, cs, ds, rs, note in items:
                out.append(
                    {
                        "world": int(w),
                        "case": case,
                        "op": op,
                        "logical_bytes": n,
                        "ckpt_s": cs,
                        "dcp_s": ds,
                        "ckpt_gbps": _gbps(n, cs),
                        "dcp_gbps": _gbps(n, ds),
                        "ratio": ds / cs if cs and ds else None,
                        "raw_s": rs,
                        "raw_gbps": _gbps(n, rs),
                        "note": note,
                    }
                )
    return out


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


COLUMNS = [
    "ranks",
    "state",
    "operation",
    "ckptstore s",
    "ckptstore GB/s",
    "DCP s",
    "DCP GB/s",
    "ckptstore/DCP",
    "raw GB/s",
]


def _cells(r: dict[str, Any]) -> list[str]:
    state = f"{r['case']} ({r['logical_bytes'] / (1 << 20):.0f} MiB)"
    return [
        str(r["world"]),
        state,
        r["op"],
        _f(r["ckpt_s"], ".2f"),
        _f(r["ckpt_gbps"], ".2f"),
        _f(r["dcp_s"], ".2f"),
        _f(r["dcp_gbps"], ".2f"),
        _f(r["ratio"], ".2f") + "x",
        _f(r["raw_gbps"], ".2f"),
    ]


def print_table(results: dict[str, Any], notes: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title="Multi-rank save/restore on gloo process groups (CPU): ckptstore vs DCP",
        caption="GB/s = logical checkpoint bytes / wall time (max over ranks), 1e9 B. "
        "ckptstore/DCP = DCP seconds / ckptstore seconds (>1: ckptstore "
        "faster). raw = write+fsync of each rank's 1/world share (saves) or "
        "each rank reading what it restores (restores), 1 or 4 threads per "
        "rank, best.",
    )
    for c in COLUMNS:
        table.add_column(c, justify="left" if c in ("state", "operation") else "right")
    prev = None
    for r in rows(results):
        if prev is not None and (r["world"], r["case"]) != prev:
            table.add_section()
        prev = (r["world"], r["case"])
        table.add_row(*_cells(r))
    console = Console(width=150)
    console.print(table)
    for n in notes:
        console.print(f"[yellow]note:[/yellow] {n}")


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---:" if c not in ("state", "operation") else "---" for c in COLUMNS) + "|",
    ]
    for r in rows(results):
        lines.append("| " + " | ".join(_cells(r)) + " |")
    return "\n".join(lines) + "\n"


def save_breakdown(results: dict[str, Any]) -> str:
    """Per world and case: rank 0's wall-time breakdown of the best sync save and of the
    restore (from the trace), and rank 0's SaveInfo.stage_seconds (summed over threads)."""
    out = []
    for w, by_case in results.get("full", {}).items():
        for case, r in by_case.items():
            if not isinstance(r, dict) or "ckptstore" not in r:
                continue
            best = r["ckptstore"]["save"]["best"]
            info0 = best["info"][0]
            out.append(f"### {w} ranks, {case}: ckptstore save {best['s']:.2f} s")
            out.append(
                "rank | "
                + " | ".join(
                    [
                        "prepare",
                        "gather descs",
                        "plan",
                        "write_blobs",
                        "store.sync",
                        "gather status",
                        "rank0 commit",
                        "broadcast",
                        "reparse",
                        "total",
                    ]
                )
            )
            for rank, tr in enumerate(best["trace"]):
                out.append(f"{rank} | " + " | ".join(f"{x:.3f}" for x in _save_phases(tr)))
            stages = ", ".join(f"{k} {v:.2f}" for k, v in sorted(info0["stage_seconds"].items()))
            out.append(f"rank 0 SaveInfo.stage_seconds (thread-summed): {stages}")
            fs = []
            for rank, tr in enumerate(best["trace"]):
                ev = tr["events"]
                blob = [
                    e["seconds"]
                    for e in ev
                    if e["label"] == "fsync" and e["thread"].startswith("ckpt-save")
                ]
                put = sum(e["seconds"] for e in ev if e["label"] == "store.put")
                folder = [
                    e["seconds"]
                    for e in ev
                    if e["label"] == "fsync" and not e["thread"].startswith("ckpt-save")
                ]
                fs.append(
                    f"rank {rank}: put {put:.2f} s of which blob fsync {sum(blob):.2f} s "
                    f"({len(blob)} files), folder fsync {sum(folder):.2f} s "
                    f"({len(folder)} folders)"
                )
            out.append("thread-summed: " + "; ".join(fs))
            per = ", ".join(
                f"{i['written_bytes'] / (1 << 20):.0f} MiB/{i['chunks_written']}"
                for i in best["info"]
            )
            dcp_by = r["dcp"]["save"].get("bytes_by_rank", {})
            dper = ", ".join(f"{dcp_by[k] / (1 << 20):.0f} MiB" for k in sorted(dcp_by, key=int))
            out.append(f"written per rank: ckptstore {per} (MiB/chunks); DCP {dper}")
            rest = r["ckptstore"]["restore"]
            out.append(
                f"restore {rest['s']:.2f} s; rank 0: "
                + ", ".join(
                    f"{k} {v['seconds']:.3f}" for k, v in rest["trace"][0]["totals"].items()
                )
            )
            out.append("")
    return "\n".join(out)


def _save_phases(tr: dict[str, Any]) -> list[float]:
    ev = tr["events"]

    def nth(label: str, k: int) -> float:
        hits = [e["seconds"] for e in ev if e["label"] == label]
        return hits[k] if len(hits) > k else 0.0

    def total(label: str) -> float:
        return sum(e["seconds"] for e in ev if e["label"] == label)

    # store.sync: the first call follows write_blobs on every rank; rank 0 calls it again
    # inside its commit (and the LocalStore.create of the manifest calls it once more)
    return [
        total("prepare"),
        nth("all_gather_json", 0),
        total("plan"),
        total("write_blobs"),
        nth("store.sync", 0),
        nth("all_gather_json", 1),
        total("rank0.commit"),
        total("broadcast_json"),
        total("manifest.parse"),
        total("prepare") + total("write+collective"),
    ]
