"""Derived numbers, the issue's targets, and the rich tables."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .common import MiB

STATES = ("1g", "4g", "small20k", "bf16")


def _get(d: Any, *path: str | int) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def derive(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Flat headline numbers per state (seconds, GB/s, fractions) from the raw results."""
    out: dict[str, dict[str, Any]] = {}
    for st, by in results.items():
        r = {c: (v.get("result") if v.get("ok") else None) for c, v in by.items()}
        lim, ts, sf = r.get("limits"), r.get("torch_save"), r.get("safetensors")
        dc, da, ck = r.get("dcp"), r.get("dcp_async"), r.get("ckptstore")
        d: dict[str, Any] = {}
        d["bytes"] = _get(by, "limits", "state", "bytes") or next(
            (v["state"]["bytes"] for v in by.values() if v.get("state")), None
        )
        d["memcpy_s"] = _get(lim, "memcpy_prealloc", "best_s")
        d["memcpy_gbps"] = _get(lim, "memcpy_prealloc", "gbps")
        d["clone_gbps"] = _get(lim, "clone_fresh_alloc", "gbps")
        d["raw_write_gbps"] = _get(lim, "raw_write_fsync_best", "gbps")
        d["raw_write_threads"] = _get(lim, "raw_write_fsync_best", "threads")
        for m in ("cold", "warm"):
            d[f"raw_read_{m}_gbps"] = _get(lim, f"raw_read_{m}_best", "gbps")
            d[f"raw_read_new_{m}_gbps"] = _get(lim, f"raw_read_new_{m}", "gbps")
            d[f"torch_load_{m}_gbps"] = _get(ts, f"load_{m}", "gbps")
            d[f"safetensors_load_{m}_gbps"] = _get(sf, f"load_{m}", "gbps")
            d[f"dcp_load_{m}_gbps"] = _get(dc, f"load_{m}", "gbps")
            d[f"ckpt_load_new_{m}_gbps"] = _get(ck, f"load_new_{m}", "gbps")
            d[f"ckpt_load_into_{m}_gbps"] = _get(ck, f"load_into_{m}", "gbps")
        d["torch_save_gbps"] = _get(ts, "save_fsync", "gbps")
        d["torch_save_nofsync_gbps"] = _get(ts, "save_no_fsync", "gbps")
        d["safetensors_save_gbps"] = _get(sf, "save_fsync", "gbps")
        d["dcp_save_gbps"] = _get(dc, "save_best", "gbps")
        d["dcp_save_threads"] = _get(dc, "save_best", "threads")
        for n in ("1", "2", "4"):
            d[f"dcp_save_t{n}_gbps"] = _get(dc, "save", n, "gbps")
        d["dcp_async_blocked_s"] = _get(da, "best", "steady_blocked_s")
        d["dcp_async_total_s"] = _get(da, "best", "steady_total_s")
        d["dcp_async_config"] = _get(da, "best", "config")
        d["dcp_async_default_blocked_s"] = _get(da, "default", "steady_blocked_s")
        d["ckpt_save_gbps"] = _get(ck, "save", "gbps")
        d["ckpt_save_s"] = _get(ck, "save", "best_s")
        d["ckpt_stage_seconds"] = _get(ck, "save", "info", "stage_seconds")
        d["ckpt_async_blocked_s"] = _get(ck, "async", "steady_blocked_s")
        d["ckpt_async_first_blocked_s"] = _get(ck, "async", "first_blocked_s")
        d["ckpt_async_total_s"] = _get(ck, "async", "steady_total_s")
        inc = _get(ck, "incremental") or {}
        if inc:
            d["inc_written_fraction"] = max(v["written_fraction"] for v in inc.values())
            d["inc_time_fraction"] = max(v["time_vs_full_save"] for v in inc.values())
            d["inc_changed_bytes_fraction"] = max(v["changed_bytes_fraction"] for v in inc.values())
        d["first_save_reused_chunks"] = _get(ck, "first_save_reused_chunks")
        ms = r.get("ckptstore_mem_save")
        d["mem_save_extra"] = _get(ms, "peak_extra_bytes")
        d["mem_save_budget_peak"] = _get(ms, "info", "peak_extra_bytes")
        d["max_inflight_bytes"] = _get(ms, "max_inflight_bytes")
        d["mem_async_extra"] = _get(r.get("ckptstore_mem_async"), "peak_extra_bytes")
        d["mem_load_new_overhead"] = _get(r.get("ckptstore_mem_load_new"), "overhead_bytes")
        d["mem_load_into_extra"] = _get(r.get("ckptstore_mem_load_into"), "peak_extra_bytes")
        # CPU seconds per GB (user+system of the whole process, best run): what 2 shared
        # cores really limit
        d["cpu_raw_write"] = _get(lim, "raw_write_fsync_best", "cpu_s_per_GB")
        d["cpu_dcp_save"] = _get(dc, "save_best", "cpu_s_per_GB")
        d["cpu_ckpt_save"] = _get(ck, "save", "cpu_s_per_GB")
        d["cpu_raw_read_warm"] = _get(lim, "raw_read_warm_best", "cpu_s_per_GB")
        d["cpu_dcp_load_warm"] = _get(dc, "load_warm", "cpu_s_per_GB")
        d["cpu_ckpt_load_into_warm"] = _get(ck, "load_into_warm", "cpu_s_per_GB")
        d["cpu_ckpt_load_new_warm"] = _get(ck, "load_new_warm", "cpu_s_per_GB")
        s3r, s3c = r.get("s3_raw"), r.get("ckptstore_s3")
        d["s3_raw_put_gbps"] = _get(s3r, "put_best", "gbps")
        d["s3_raw_get_gbps"] = _get(s3r, "get_best", "gbps")
        d["s3_ckpt_save_gbps"] = _get(s3c, "save", "gbps")
        d["s3_ckpt_load_new_gbps"] = _get(s3c, "load_new", "gbps")
        d["s3_ckpt_load_into_gbps"] = _get(s3c, "load_into", "gbps")
        s3inc = _get(s3c, "incremental") or {}
        if s3inc:
            d["s3_inc_written_fraction"] = max(v["written_fraction"] for v in s3inc.values())
            d["s3_inc_time_fraction"] = max(v["time_vs_full_save"] for v in s3inc.values())
        swr, swc = r.get("s3_raw_seaweedfs"), r.get("ckptstore_s3_seaweedfs")
        d["sw_raw_put_gbps"] = _get(swr, "put_best", "gbps")
        d["sw_raw_get_gbps"] = _get(swr, "get_best", "gbps")
        d["sw_ckpt_save_gbps"] = _get(swc, "save", "gbps")
        d["sw_ckpt_load_new_gbps"] = _get(swc, "load_new", "gbps")
        d["sw_ckpt_load_into_gbps"] = _get(swc, "load_into", "gbps")
        out[st] = d
    return out


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if a is not None and b else None


# (label, value(d, state) -> float|None, threshold(state) -> float|None, ">=" or "<=", states)
Target = tuple[str, Callable[[dict, str], Any], Callable[[str], float | None], str]


def _dcp_thr(st: str) -> float:
    return 2.0 if st == "small20k" else 1.2


TARGETS: list[Target] = [
    (
        "save / best DCP save (small20k: ≥2×)",
        lambda d, s: _ratio(d["ckpt_save_gbps"], d["dcp_save_gbps"]),
        _dcp_thr,
        ">=",
    ),
    (
        "save / raw parallel write+fsync",
        lambda d, s: _ratio(d["ckpt_save_gbps"], d["raw_write_gbps"]),
        lambda s: 0.85,
        ">=",
    ),
    (
        "async blocked / DCP async_save blocked",
        lambda d, s: _ratio(d["ckpt_async_blocked_s"], d["dcp_async_blocked_s"]),
        lambda s: 1.0,
        "<=",
    ),
    (
        "async blocked / memory copy",
        lambda d, s: _ratio(d["ckpt_async_blocked_s"], d["memcpy_s"]),
        lambda s: 1.5,
        "<=",
    ),
    (
        "incremental: bytes written / logical",
        lambda d, s: d.get("inc_written_fraction"),
        lambda s: 0.12,
        "<=",
    ),
    (
        "incremental: time / full save",
        lambda d, s: d.get("inc_time_fraction"),
        lambda s: 0.25,
        "<=",
    ),
    (
        "restore new, cold / DCP load cold",
        lambda d, s: _ratio(d["ckpt_load_new_cold_gbps"], d["dcp_load_cold_gbps"]),
        _dcp_thr,
        ">=",
    ),
    (
        "restore into=, cold / DCP load cold",
        lambda d, s: _ratio(d["ckpt_load_into_cold_gbps"], d["dcp_load_cold_gbps"]),
        _dcp_thr,
        ">=",
    ),
    (
        "restore new, cold / raw read cold",
        lambda d, s: _ratio(d["ckpt_load_new_cold_gbps"], d["raw_read_cold_gbps"]),
        lambda s: 0.8,
        ">=",
    ),
    (
        "restore into=, cold / raw read cold",
        lambda d, s: _ratio(d["ckpt_load_into_cold_gbps"], d["raw_read_cold_gbps"]),
        lambda s: 0.8,
        ">=",
    ),
    (
        "restore new, warm / DCP load warm",
        lambda d, s: _ratio(d["ckpt_load_new_warm_gbps"], d["dcp_load_warm_gbps"]),
        _dcp_thr,
        ">=",
    ),
    (
        "restore into=, warm / DCP load warm",
        lambda d, s: _ratio(d["ckpt_load_into_warm_gbps"], d["dcp_load_warm_gbps"]),
        _dcp_thr,
        ">=",
    ),
    (
        "restore new, warm / raw read warm",
        lambda d, s: _ratio(d["ckpt_load_new_warm_gbps"], d["raw_read_warm_gbps"]),
        lambda s: 0.8,
        ">=",
    ),
    (
        "restore into=, warm / raw read warm",
        lambda d, s: _ratio(d["ckpt_load_into_warm_gbps"], d["raw_read_warm_gbps"]),
        lambda s: 0.8,
        ">=",
    ),
    (
        "S3 save / raw boto3 put",
        lambda d, s: _ratio(d["s3_ckpt_save_gbps"], d["s3_raw_put_gbps"]),
        lambda s: 0.8,
        ">=",
    ),
    (
        "S3 restore new / raw boto3 get",
        lambda d, s: _ratio(d["s3_ckpt_load_new_gbps"], d["s3_raw_get_gbps"]),
        lambda s: 0.8,
        ">=",
    ),
    (
        "S3 restore into= / raw boto3 get",
        lambda d, s: _ratio(d["s3_ckpt_load_into_gbps"], d["s3_raw_get_gbps"]),
        lambda s: 0.8,
        ">=",
    ),
    (
        "SeaweedFS save / raw boto3 put",
        lambda d, s: _ratio(d["sw_ckpt_save_gbps"], d["sw_raw_put_gbps"]),
        lambda s: 0.8,
        ">=",
    ),
    (
        "SeaweedFS restore new / raw boto3 get",
        lambda d, s: _ratio(d["sw_ckpt_load_new_gbps"], d["sw_raw_get_gbps"]),
        lambda s: 0.8,
        ">=",
    ),
    (
        "sync save peak extra RSS / (max_inflight + 10% state)",
        lambda d, s: (
            _ratio(d["mem_save_extra"], (d["max_inflight_bytes"] or 0) + 0.1 * (d["bytes"] or 0))
            if d["max_inflight_bytes"]
            else None
        ),
        lambda s: 1.0,
        "<=",
    ),
]


def evaluate(derived: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for label, value, thr, op in TARGETS:
        for st, d in derived.items():
            try:
                v = value(d, st)
            except (KeyError, TypeError):
                v = None
            if v is None:
                continue
            t = thr(st)
            met = v >= t if op == ">=" else v <= t
            rows.append(
                {
                    "target": label,
                    "state": st,
                    "value": round(v, 3),
                    "threshold": f"{op} {t}",
                    "met": bool(met),
                }
            )
    return rows


# ---------------------------------------------------------------------------- tables
def _gb(v: Any) -> str:
    return "—" if v is None else f"{v:.2f}"


def _s(v: Any) -> str:
    return "—" if v is None else f"{v:.2f}s"


def _pct(v: Any) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def _mib(v: Any) -> str:
    return "—" if v is None else f"{v / MiB:.0f} MiB"


SUMMARY_ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("state size", "bytes", lambda v: "—" if v is None else f"{v / 2**30:.2f} GiB"),
    ("memory copy, preallocated (GB/s)", "memcpy_gbps", _gb),
    ("raw parallel write+fsync (GB/s)", "raw_write_gbps", _gb),
    ("raw parallel read cold / warm (GB/s)", ("raw_read_cold_gbps", "raw_read_warm_gbps"), _gb),
    (
        "raw parallel read into new tensors cold / warm (GB/s)",
        ("raw_read_new_cold_gbps", "raw_read_new_warm_gbps"),
        _gb,
    ),
    ("torch.save + fsync (GB/s)", "torch_save_gbps", _gb),
    ("torch.save, no fsync (GB/s)", "torch_save_nofsync_gbps", _gb),
    ("safetensors save_file + fsync (GB/s)", "safetensors_save_gbps", _gb),
    ("DCP save, best thread_count (GB/s)", "dcp_save_gbps", _gb),
    ("ckptstore save (GB/s)", "ckpt_save_gbps", _gb),
    ("DCP async_save blocked / total", ("dcp_async_blocked_s", "dcp_async_total_s"), _s),
    ("ckptstore save_async blocked / total", ("ckpt_async_blocked_s", "ckpt_async_total_s"), _s),
    ("memory copy of the state", "memcpy_s", _s),
    (
        "ckptstore incremental: written / time vs full",
        ("inc_written_fraction", "inc_time_fraction"),
        _pct,
    ),
    ("torch.load cold / warm (GB/s)", ("torch_load_cold_gbps", "torch_load_warm_gbps"), _gb),
    (
        "safetensors load_file cold / warm (GB/s)",
        ("safetensors_load_cold_gbps", "safetensors_load_warm_gbps"),
        _gb,
    ),
    ("DCP load (in place) cold / warm (GB/s)", ("dcp_load_cold_gbps", "dcp_load_warm_gbps"), _gb),
    (
        "ckptstore restore new cold / warm (GB/s)",
        ("ckpt_load_new_cold_gbps", "ckpt_load_new_warm_gbps"),
        _gb,
    ),
    (
        "ckptstore restore into= cold / warm (GB/s)",
        ("ckpt_load_into_cold_gbps", "ckpt_load_into_warm_gbps"),
        _gb,
    ),
    (
        "CPU s/GB save: raw / DCP / ckptstore",
        ("cpu_raw_write", "cpu_dcp_save", "cpu_ckpt_save"),
        _gb,
    ),
    (
        "CPU s/GB warm read: raw / DCP / ckpt into= / new",
        (
            "cpu_raw_read_warm",
            "cpu_dcp_load_warm",
            "cpu_ckpt_load_into_warm",
            "cpu_ckpt_load_new_warm",
        ),
        _gb,
    ),
    ("ckptstore sync save peak extra RSS", "mem_save_extra", _mib),
    ("ckptstore async save peak extra RSS", "mem_async_extra", _mib),
    ("ckptstore restore new: RSS beyond the state", "mem_load_new_overhead", _mib),
    ("ckptstore restore into=: peak extra RSS", "mem_load_into_extra", _mib),
    ("S3 raw boto3 put / get (GB/s)", ("s3_raw_put_gbps", "s3_raw_get_gbps"), _gb),
    ("S3 ckptstore save (GB/s)", "s3_ckpt_save_gbps", _gb),
    (
        "S3 ckptstore restore new / into= (GB/s)",
        ("s3_ckpt_load_new_gbps", "s3_ckpt_load_into_gbps"),
        _gb,
    ),
    (
        "S3 ckptstore incremental: written / time",
        ("s3_inc_written_fraction", "s3_inc_time_fraction"),
        _pct,
    ),
    ("SeaweedFS raw boto3 put / get (GB/s)", ("sw_raw_put_gbps", "sw_raw_get_gbps"), _gb),
    ("SeaweedFS ckptstore save (GB/s)", "sw_ckpt_save_gbps", _gb),
    (
        "SeaweedFS ckptstore restore new / into= (GB/s)",
        ("sw_ckpt_load_new_gbps", "sw_ckpt_load_into_gbps"),
        _gb,
    ),
]


def summary_rows(derived: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    states = [s for s in STATES if s in derived] + [s for s in derived if s not in STATES]
    rows = []
    for label, key, fmt in SUMMARY_ROWS:
        cells = []
        for st in states:
            d = derived[st]
            if isinstance(key, tuple):
                vals = [d.get(k) for k in key]
                cells.append(
                    "—" if all(v is None for v in vals) else " / ".join(fmt(v) for v in vals)
                )
            else:
                cells.append(fmt(d.get(key)))
        if any(c != "—" for c in cells):
            rows.append([label, *cells])
    return states, rows


def markdown_tables(derived: dict[str, dict[str, Any]], targets: list[dict[str, Any]]) -> str:
    states, rows = summary_rows(derived)
    if not rows and not targets:
        return ""
    lines = ["| measure | " + " | ".join(states) + " |", "|---" * (len(states) + 1) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "| target | state | value | threshold | met |", "|---|---|---|---|---|"]
    lines += [
        f"| {t['target']} | {t['state']} | {t['value']} | {t['threshold']} | "
        f"{'met' if t['met'] else '**missed**'} |"
        for t in targets
    ]
    return "\n".join(lines)


def print_tables(derived: dict[str, dict[str, Any]], targets: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    states, rows = summary_rows(derived)
    if not rows:
        return
    t = Table(title="Checkpoint save/restore (GB/s = 1e9 B/s; best of the runs)")
    t.add_column("measure")
    for st in states:
        t.add_column(st, justify="right")
    for r in rows:
        t.add_row(*r)
    console.print(t)
    tt = Table(title="Targets (issue 3)")
    for c in ("target", "state", "value", "threshold", "met"):
        tt.add_column(c)
    for row in targets:
        tt.add_row(
            row["target"],
            row["state"],
            f"{row['value']:.3f}",
            row["threshold"],
            "[green]met[/green]" if row["met"] else "[red]missed[/red]",
        )
    console.print(tt)
    st = Table(title="ckptstore save: seconds per stage, summed over workers (best full save)")
    st.add_column("state")
    stages = sorted({k for d in derived.values() for k in (d.get("ckpt_stage_seconds") or {})})
    for s in stages:
        st.add_column(s, justify="right")
    st.add_column("wall", justify="right")
    for name, d in derived.items():
        ss = d.get("ckpt_stage_seconds")
        if ss:
            st.add_row(name, *[f"{ss.get(s, 0):.2f}" for s in stages], _s(d.get("ckpt_save_s")))
    console.print(st)


def extras_rows(results: dict[str, dict[str, Any]]) -> tuple[list[list[str]], list[list[str]]]:
    """Rows of the codec table and of the sweep table (empty when not run)."""
    codecs, sweep = [], []
    for st, by in results.items():
        c = _get(by, "ckptstore_codecs", "result") or {}
        for name, v in c.items():
            name = "none (default)" if name == "None" else name
            codecs.append(
                [st, name, f"{v['ratio']:.3f}", _gb(v["save_gbps"]), _gb(v["load_warm_gbps"])]
            )
        sw = _get(by, "ckptstore_sweep", "result") or {}
        for name, v in sw.items():
            sweep.append([st, name, _gb(v["save_gbps"]), _gb(v["load_into_warm_gbps"])])
    return codecs, sweep


def print_extras(results: dict[str, dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    codecs, sweep = extras_rows(results)
    console = Console(width=160)
    if codecs:
        t = Table(title="ckptstore compression (stored/raw ratio; GB/s of raw bytes; warm restore)")
        for c in ("state", "codec", "ratio", "save GB/s", "restore GB/s"):
            t.add_column(c)
        for r in codecs:
            t.add_row(*r)
        console.print(t)
    if sweep:
        t = Table(title="ckptstore chunk_bytes / workers sweep (save; warm restore into=)")
        for c in ("state", "chunk/workers", "save GB/s", "restore into= GB/s"):
            t.add_column(c)
        for r in sweep:
            t.add_row(*r)
        console.print(t)


def markdown_extras(results: dict[str, dict[str, Any]]) -> str:
    codecs, sweep = extras_rows(results)
    lines = []
    if codecs:
        lines += [
            "| state | codec | stored/raw | save GB/s | restore GB/s (warm) |",
            "|---|---|---|---|---|",
        ]
        lines += ["| " + " | ".join(r) + " |" for r in codecs]
    if sweep:
        lines += [
            "",
            "| state | chunk_bytes/workers | save GB/s | restore into= GB/s (warm) |",
            "|---|---|---|---|",
        ]
        lines += ["| " + " | ".join(r) + " |" for r in sweep]
    return "\n".join(lines)


# --------------------------------------------------------------------------- charts
def write_charts(derived: dict[str, dict[str, Any]], folder: str, note: str = "") -> list[str]:
    """PNG charts of the headline numbers (bench/charts.py): save and restore throughput of
    every contestant beside the disk's limit, per state, and S3 on moto and SeaweedFS beside
    raw boto3 on the same server. Returns the files written (charts with no data are left
    out)."""
    from charts import bar_chart

    states = [s for s in STATES if s in derived] + [s for s in derived if s not in STATES]
    written: list[str] = []

    def col(key: str) -> list[float | None]:
        return [derived[s].get(key) for s in states]

    def any_value(series: dict[str, list[float | None]]) -> bool:
        return any(v is not None for vs in series.values() for v in vs)

    save = {"disk: raw parallel write+fsync": col("raw_write_gbps"),
            "torch.save": col("torch_save_gbps"), "safetensors": col("safetensors_save_gbps"),
            "DCP": col("dcp_save_gbps"), "ckptstore": col("ckpt_save_gbps")}
    if any_value(save):
        written.append(str(bar_chart(f"{folder}/ckpt-save.png", "Save throughput (fsynced)",
                                     states, save, unit="GB/s", note=note)))
    mode = "cold" if any(derived[s].get("raw_read_cold_gbps") for s in states) else "warm"
    load = {f"disk: raw parallel read ({mode})": col(f"raw_read_{mode}_gbps"),
            "torch.load": col(f"torch_load_{mode}_gbps"),
            "safetensors": col(f"safetensors_load_{mode}_gbps"),
            "DCP": col(f"dcp_load_{mode}_gbps"),
            "ckptstore (new tensors)": col(f"ckpt_load_new_{mode}_gbps"),
            "ckptstore (into=)": col(f"ckpt_load_into_{mode}_gbps")}
    if any_value(load):
        written.append(str(bar_chart(f"{folder}/ckpt-restore.png",
                                     f"Restore throughput ({mode} page cache)", states, load,
                                     unit="GB/s", note=note)))
    for st in states:
        d = derived[st]
        s3 = {"raw boto3 put": [d.get("s3_raw_put_gbps"), d.get("sw_raw_put_gbps")],
              "ckptstore save": [d.get("s3_ckpt_save_gbps"), d.get("sw_ckpt_save_gbps")],
              "raw boto3 get": [d.get("s3_raw_get_gbps"), d.get("sw_raw_get_gbps")],
              "ckptstore restore (new)": [d.get("s3_ckpt_load_new_gbps"),
                                          d.get("sw_ckpt_load_new_gbps")],
              "ckptstore restore (into=)": [d.get("s3_ckpt_load_into_gbps"),
                                            d.get("sw_ckpt_load_into_gbps")]}
        if any_value(s3):
            written.append(str(bar_chart(
                f"{folder}/ckpt-s3-{st}.png", f"S3, {st} state: ckptstore beside raw boto3",
                ["moto (mock)", "SeaweedFS (real store)"], s3, unit="GB/s", note=note)))
    return written
