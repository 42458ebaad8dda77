"""Parts "incremental" and "ls", on one repository: checkpoints of the MoE-with-Adam state,
each saved by a fresh process (a restarted job). c0 is a full save; each later c<s> changes
another random 10% of the tensors (states.change, seeded by s) and saves incrementally
against the latest.

* "incremental": the incremental saves against the full ones (c0, and a second full
  save into an empty repository), all from fresh processes; SaveInfo of each. Then a
  long-lived process (a training job that saves every so often): one process saves a full
  checkpoint and as many incremental ones as the history has, in a repository of its own,
  each save's time and the process's RSS after it (what the store keeps between saves).
* "ls": whole-repository commands over the checkpoints: `ckpt ls`, `ckpt du`,
  `ckpt gc --dry-run` (the CLI as a user runs it: `python -m ckptstore.cli ... --json`),
  wall time and peak RSS of the process (wait4), and `ckpt ls` of an empty repository (the
  interpreter and imports alone); and the Python API's `list()`, `latest()`,
  `history()` in a fresh process, with the memory a long-lived store keeps after `list()`.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import sys
from pathlib import Path
from typing import Any

from .common import (
    Ctx,
    imported_from,
    profiled,
    rss_bytes,
    run_child,
    run_script,
    run_worker,
    timed,
    top_sites,
    traced,
)
from .states import build, change

CLI_COMMANDS = {"ls": ["ls"], "du": ["du"], "gc --dry-run": ["gc", "--dry-run"]}


def save_step(folder: str, n: int, step: int, profile: bool = False) -> dict[str, Any]:
    """Worker: build the state as of `step` and save it as c<step> (parent: latest)."""
    import ckptstore

    state = build("moe", n)
    changed = sum(len(change(state, s)) for s in range(1, step + 1))
    repo = ckptstore.CheckpointStore(folder)
    name = f"c{step}" if not profile else "profiled"
    if profile:
        return {"profile": profiled(lambda: repo.save(name, state))}
    seconds, info = timed(lambda: repo.save(name, state))
    return {"step": step, "save_s": seconds, "changed_tensors_total": changed,
            "info": dataclasses.asdict(info)}


def save_series(folder: str, n: int, saves: int) -> dict[str, Any]:
    """Worker: one process saves c0 (full), then c1.. (10% more changed each, parent:
    latest) through one CheckpointStore; each save's seconds and the RSS after it."""
    import ckptstore

    state = build("moe", n)
    repo = ckptstore.CheckpointStore(folder)
    out: list[dict[str, Any]] = []
    for step in range(saves):
        if step:
            change(state, step)
        seconds, info = timed(lambda name=f"c{step}": repo.save(name, state))
        gc.collect()
        out.append({"step": step, "save_s": seconds, "rss_after": rss_bytes(),
                    "written_bytes": info.written_bytes})
    return {"saves": out}


def api_calls(folder: str) -> dict[str, Any]:
    """Worker: list(), latest(), history() of a fresh store, and what a store object keeps
    (RSS) after list()."""
    import ckptstore

    repo = ckptstore.CheckpointStore(folder, create=False)
    gc.collect()
    before = rss_bytes()
    list_s, infos = timed(repo.list)
    gc.collect()
    kept = rss_bytes() - before
    latest_s, _ = timed(ckptstore.CheckpointStore(folder, create=False).latest)
    history_s, _ = timed(ckptstore.CheckpointStore(folder, create=False).history)
    return {"list_s": list_s, "checkpoints": len(infos), "rss_kept_after_list": kept,
            "latest_s": latest_s, "history_s": history_s}


def cli_profile(folder: str) -> dict[str, Any]:
    """Worker: `ckpt ls` in this process under cProfile, then under tracemalloc: the peak,
    and the top allocation sites of what is held when every manifest has been read (a
    snapshot taken as the command calls `inspection.usage`, near its peak)."""
    import contextlib
    import io
    import tracemalloc

    from ckptstore.cli import main
    from ckptstore.tools import inspection

    def ls() -> Any:
        with contextlib.redirect_stdout(io.StringIO()):
            return main(["ls", folder, "--json"])

    out: dict[str, Any] = {"cprofile": profiled(ls)}
    snaps: list[Any] = []
    real = inspection.usage

    def usage(*args: Any, **kwargs: Any) -> Any:
        snaps.append(tracemalloc.take_snapshot())
        return real(*args, **kwargs)

    inspection.usage = usage
    try:
        out["tracemalloc"] = traced(ls)
    finally:
        inspection.usage = real
    out["tracemalloc"]["sites_at_usage"] = top_sites(snaps[0]) if snaps else []
    return out


# ----------------------------------------------------------------------------- parent
@dataclasses.dataclass
class History:
    """The shared repository and what building it measured."""

    folder: Path
    n: int
    saves: list[dict[str, Any]]


def build_history(ctx: Ctx, n: int, count: int) -> History:
    folder = ctx.folder(f"history-{n}")
    saves = []
    for step in range(count):
        ctx.note(f"history: saving c{step} of {count} ({n:,} tensors) from a fresh process")
        saves.append(run_worker(ctx, "history.save_step", folder=str(folder), n=n, step=step))
    return History(folder, n, saves)


def run_incremental(ctx: Ctx, hist: History) -> dict[str, Any]:
    """"incremental" from the history, plus a second full save into an empty repository."""
    fulls = [hist.saves[0]]
    for _ in range(max(0, ctx.reps - 1)):
        ctx.note("incremental: another full save into an empty repository")
        other = ctx.folder("full")
        fulls.append(run_worker(ctx, "history.save_step", folder=str(other), n=hist.n, step=0))
        shutil.rmtree(other, ignore_errors=True)
    incs = hist.saves[1:]
    full_s = min(s["save_s"] for s in fulls)
    inc_s = min(s["save_s"] for s in incs)
    out: dict[str, Any] = {"tensors": hist.n, "full_saves": fulls, "incremental_saves": incs,
                           "full_s": full_s, "incremental_s": inc_s, "ratio": inc_s / full_s}
    ctx.note(f"incremental: {len(hist.saves)} saves by one long-lived process")
    series = ctx.folder("series")
    out["same_process"] = run_worker(ctx, "history.save_series", folder=str(series),
                                     n=hist.n, saves=len(hist.saves))
    shutil.rmtree(series, ignore_errors=True)
    if ctx.profile:
        ctx.note("incremental: profiling one more incremental save")
        out["profile"] = run_worker(ctx, "history.save_step", folder=str(hist.folder),
                                    n=hist.n, step=len(hist.saves), profile=True)["profile"]
    return out


def _cli(ctx: Ctx, folder: Path, args: list[str], reps: int) -> dict[str, Any]:
    runs = []
    for _ in range(reps):
        child = run_child([sys.executable, "-m", "ckptstore.cli", *args, str(folder),
                           "--json"], ctx)
        if child.rc not in (0, 1):
            child.check(f"ckpt {' '.join(args)}")
        runs.append({"wall_s": child.wall_s, "maxrss": child.maxrss, "rc": child.rc})
    return {"best_wall_s": min(r["wall_s"] for r in runs),
            "max_rss": max(r["maxrss"] for r in runs), "runs": runs}


def run_ls(ctx: Ctx, hist: History, reps: int = 1,
           others: dict[str, Ctx] | None = None) -> dict[str, Any]:
    """"ls" over the history's checkpoints, each command `reps` times. `others`: the same
    commands with other checkouts (a Ctx each, its PYTHONPATH set), alternated with this
    one's command by command over the same repository (under "by_source")."""
    sources = {"": ctx, **(others or {})}
    for source, c in (others or {}).items():
        ctx.note(f"ls: {source} imports ckptstore from {imported_from(c)}")
    found: dict[str, dict[str, Any]] = {label: {"cli": {}} for label in sources}
    for label, args in CLI_COMMANDS.items():
        for source, c in sources.items():
            ctx.note(f"ls: ckpt {label} over {len(hist.saves)} checkpoints"
                     + (f" ({source})" if source else ""))
            found[source]["cli"][label] = _cli(c, hist.folder, args, reps)
    for source, c in sources.items():
        ctx.note("ls: list(), latest(), history() in a fresh process"
                 + (f" ({source})" if source else ""))
        found[source]["api"] = run_worker(c, "history.api_calls", folder=str(hist.folder))
    out: dict[str, Any] = {"tensors": hist.n, "checkpoints": len(hist.saves), "reps": reps,
                           **found.pop("")}
    if found:
        out["by_source"] = found
    empty = ctx.folder("empty")
    run_script(ctx, "import sys, ckptstore; ckptstore.CheckpointStore(sys.argv[1])", str(empty))
    out["baseline"] = _cli(ctx, empty, ["ls"], reps)
    shutil.rmtree(empty, ignore_errors=True)
    if ctx.profile:
        ctx.note("ls: profiling ckpt ls in-process (cProfile, tracemalloc)")
        out["profile"] = run_worker(ctx, "history.cli_profile", folder=str(hist.folder))
    return out
