"""Part "peers": ckptstore beside its peers on the same states, in one run: DCP
(`torch.distributed.checkpoint`, world size 1, no process group) and torch_checkpointing
(Meta's DCP successor, pip `torch-checkpointing`, measured at 0.1.1). The states are the
manifest part's MoE-with-Adam state at `--peers-sizes` tensors and the small part's 1 KiB
tensors (`--small-tensors`). Every contestant and state runs in its own worker process:

* **save**: a full save into an empty folder, timed until the call returns. ckptstore:
  `CheckpointStore(folder).save(name, state)`, durable on return (data, index, root and
  folders fsync'd). DCP: `dcp.save(state, storage_writer=FileSystemWriter(path,
  sync_files=True))`: fsyncs its data file and `.metadata` (not the folder after the rename).
  torch_checkpointing: `CheckpointManager` with the synchronous saver
  (`CheckpointManager.Config(save=SyncCheckpointSaverConfig())`), `manager.save(path,
  payload)`: one `torch.save` file per top-level item (`model_0.pt`, `optim_0.pt`), written to
  `tmp_<name>` and renamed onto the path. It never fsyncs; its durability is O_DIRECT writes
  (`LocalFileSystemStorageConfig(use_direct_io=True)`, the default). On ext4 that default
  cannot save at all: the file opens with O_DIRECT, but `torch.save`'s unaligned buffered
  writes are refused (EINVAL at the first flush) and nothing falls back. The worker tries the
  default first on a tiny state and records the error; where it fails it measures with
  `use_direct_io=False` (page-cache writes, no fsync), and the bench then fsyncs every file
  of the checkpoint and its folders itself: "save + fsync" is the figure comparable to the
  other two, and the ratios use it.
* **load**: a full load into a state of the same structure (new tensors of the same shapes,
  zeroed; every tensor checked equal afterwards). ckptstore: `load(name, into=target)`; DCP:
  `dcp.load(target, storage_reader=FileSystemReader(path))`; torch_checkpointing:
  `manager.load(path, into=target)` (a mmap-backed `torch.load` of each item file, copied in
  place). Reads come from the page cache (just written; caches are not dropped), for all.
* **partial load**: one tensor (the manifest part's typical key: a 4 KiB Adam moment of the
  MoE state, a 1 KiB tensor of the small one) in a fresh process: wall time from process
  start, imports apart, and the process's peak RSS. ckptstore: `load(name, keys=[key])`;
  DCP: `dcp.load` of a state dict holding only that key; torch_checkpointing:
  `manager.load(path, into=<only that key>)`, which loads its item's whole file (mmap-backed)
  and keeps the key. The loaded tensor's checksum is checked against the saved one.
* **metadata bytes**: ckptstore: the root manifest plus its index blobs (as the manifest
  part counts them); DCP: its `.metadata` file (pickled, its format); torch_checkpointing
  writes no metadata file without a resharder: its index is inside each `.pt` zip, the
  pickled `data.pkl` plus the zip's central directory, counted here. "on disk" is every file.

torch_checkpointing gets the small state as `{"model": state}` (a payload's top-level keys
are its items, one file each: the flat state would make one file per tensor); ckptstore and
DCP get the flat state as the small part does. Ratios are ckptstore / peer (below 1: ckptstore
takes less). Every figure is the best of `--reps`, except that a measurement whose first run
takes over REPEAT_UNDER_S seconds runs once (DCP at 200k tensors takes minutes)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .common import Ctx, fsync_path, run_child, run_worker, timed
from .manifest import typical_key
from .states import build, tensors

NAME = "m"
CONTESTANTS = ("ckptstore", "dcp", "torch_checkpointing")
TC_VERSION = "0.1.1"
TC_INSTALL = f"pip install torch-checkpointing=={TC_VERSION}"
#: a measurement whose first run takes longer is not repeated
REPEAT_UNDER_S = 20.0

#: partial load in a fresh process: argv contestant, folder, spec (JSON); prints its timings
PARTIAL_CHILD = r"""
import time
t0 = time.perf_counter()
import json, os, sys, warnings
warnings.filterwarnings("ignore")
which, folder, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
import torch
if which == "ckptstore":
    import ckptstore
elif which == "dcp":
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
else:
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
t1 = time.perf_counter()

def nest(path, leaf):
    for key in reversed(path):
        leaf = {key: leaf}
    return leaf

def leaves(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from leaves(v)
    elif isinstance(x, torch.Tensor):
        yield x

if which == "ckptstore":
    got = ckptstore.CheckpointStore(folder, create=False).load(spec["name"], keys=[spec["key"]])
else:
    got = nest(spec["path"], torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"])))
    if which == "dcp":
        dcp.load(got, storage_reader=FileSystemReader(folder))
    else:
        manager = CheckpointManager(CheckpointManager.Config(
            save=SyncCheckpointSaverConfig(),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=spec["direct_io"])))
        manager.load(folder, into=got)
t2 = time.perf_counter()
found = list(leaves(got))
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "tensors_returned": len(found),
                  "checksum": sum(float(t.double().sum()) for t in found)}), flush=True)
os._exit(0)
"""


# ----------------------------------------------------------------------------- helpers
def leaf_paths(state: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[list[Any], Any]]:
    """(path of raw keys, tensor) of every tensor of a state; int keys stay ints (Adam's
    state), so the path rebuilds a nested state dict of the same structure."""
    import torch

    if isinstance(state, dict):
        for k, v in state.items():
            yield from leaf_paths(v, (*path, k))
    elif isinstance(state, torch.Tensor):
        yield list(path), state


def best_capped(reps: int, fn: Callable[[], Any]) -> dict[str, Any]:
    """Every time of up to `reps` calls and the minimum; a first call over REPEAT_UNDER_S
    seconds is not repeated."""
    times: list[float] = []
    for _ in range(max(1, reps)):
        seconds, value = timed(fn)
        del value
        times.append(seconds)
        if seconds > REPEAT_UNDER_S:
            break
    return {"best_s": min(times), "times_s": times}


def fsync_tree(folder: Path) -> None:
    """fsync every file under `folder`, every folder in it, the folder and its parent (what a
    durable save of a renamed folder needs)."""
    for root, _dirs, files in os.walk(folder):
        for f in files:
            fsync_path(Path(root) / f)
        fsync_path(Path(root))
    fsync_path(folder.parent)


def disk_bytes(folder: Path) -> int:
    return sum((Path(root) / f).stat().st_size for root, _d, files in os.walk(folder)
               for f in files)


def _zip_index_bytes(path: Path) -> int:
    """A torch.save zip's own index: the pickled data.pkl plus the central directory."""
    with zipfile.ZipFile(path) as z:
        pkl = sum(i.file_size for i in z.infolist() if i.filename.endswith("/data.pkl"))
        return pkl + path.stat().st_size - z.start_dir


def _ckptstore_index_bytes(folder: Path) -> tuple[int, int]:
    """(root bytes, index blob bytes) of checkpoint NAME, counted as the manifest part does."""
    from ckptstore.format.hashing import XXH3_128
    from ckptstore.format.manifest_parse import parse_manifest

    from .common import index_blobs

    raw = (folder / "checkpoints" / f"{NAME}.json").read_bytes()
    blobs = index_blobs(parse_manifest(raw, NAME, XXH3_128))
    return len(raw), sum(b.size for b in blobs)


def _tc_manager(direct_io: bool) -> Any:
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    return CheckpointManager(CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=direct_io)))


def tc_probe(root: Path) -> str | None:
    """Save a tiny state with torch_checkpointing's default storage (O_DIRECT); None if it
    works here, else why not."""
    import torch

    manager = _tc_manager(True)
    target = Path(tempfile.mkdtemp(dir=root)) / "probe"
    try:
        manager.save(str(target), {"model": {"w": torch.arange(1000.0)}})
    except (OSError, RuntimeError) as e:
        return (f"its default storage (LocalFileSystemStorageConfig(use_direct_io=True)) "
                f"fails to save here: {type(e).__name__}: {e} (O_DIRECT open accepted, "
                "unaligned torch.save writes refused)")
    finally:
        manager.close()
        shutil.rmtree(target.parent, ignore_errors=True)
    return None


# ----------------------------------------------------------------------------- worker
def measure(contestant: str, folder: str, shape: str, n: int, reps: int) -> dict[str, Any]:
    """Worker: save, load and count the metadata of one contestant on one state."""
    import torch

    warnings.filterwarnings("ignore")  # DCP: "assuming the intent is to save in a single..."
    root = Path(folder)
    state = build(shape, n)
    wrap = contestant == "torch_checkpointing" and shape == "small"
    payload: dict[str, Any] = {"model": state} if wrap else state
    flat = tensors(payload)
    one = typical_key({k: t.numel() for k, t in flat.items()})
    path = next(p for p, t in leaf_paths(payload) if ".".join(map(str, p)) == one)
    out: dict[str, Any] = {
        "contestant": contestant, "shape": shape, "tensors": len(flat),
        "bytes": sum(t.numel() * t.element_size() for t in flat.values()),
        "one_key": one, "one_path": path, "one_shape": list(flat[one].shape),
        "one_dtype": str(flat[one].dtype).removeprefix("torch."),
        "one_checksum": float(flat[one].double().sum()), "wrapped_in_model": wrap}
    folders: list[Path] = []
    save_fn, load_fn, extra = _contestant(contestant, root, out)

    def save() -> Any:
        if folders:
            shutil.rmtree(folders.pop(), ignore_errors=True)
        folders.append(Path(tempfile.mkdtemp(dir=root)) / "ckpt")
        return save_fn(folders[-1], payload)

    out["save"] = best_capped(reps, save)
    last = folders[-1]
    if contestant == "torch_checkpointing":  # it does not fsync: the bench does, after
        t0 = time.perf_counter()
        fsync_tree(last)
        out["fsync_after_s"] = time.perf_counter() - t0
    out["checkpoint"] = str(last)
    del flat
    target = build(shape, n)
    target_payload: dict[str, Any] = {"model": target} if wrap else target
    for t in tensors(target_payload).values():
        t.zero_()
    out["load"] = best_capped(reps, lambda: load_fn(last, target_payload))
    got, want = tensors(target_payload), tensors(payload)
    out["load_verified"] = len(got) == len(want) and all(
        torch.equal(got[k], want[k]) for k in want)
    out["disk_bytes"] = disk_bytes(last)
    out.update(extra(last))
    return out


def _contestant(name: str, root: Path, out: dict[str, Any]) -> tuple[
        Callable[[Path, Any], Any], Callable[[Path, Any], Any],
        Callable[[Path], dict[str, Any]]]:
    """(save(path, state), load(path, target), metadata figures(path)) of a contestant."""
    if name == "ckptstore":
        import ckptstore

        def meta_cs(path: Path) -> dict[str, Any]:
            root_b, index_b = _ckptstore_index_bytes(path)
            return {"metadata_bytes": root_b + index_b, "root_bytes": root_b,
                    "index_bytes": index_b}

        return (lambda p, s: ckptstore.CheckpointStore(p).save(NAME, s, parent=None),
                lambda p, t: ckptstore.CheckpointStore(p, create=False).load(NAME, into=t),
                meta_cs)
    if name == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

        return (lambda p, s: dcp.save(s, storage_writer=FileSystemWriter(p, sync_files=True)),
                lambda p, t: dcp.load(t, storage_reader=FileSystemReader(p)),
                lambda p: {"metadata_bytes": (p / ".metadata").stat().st_size})
    if name == "torch_checkpointing":
        import torch_checkpointing

        why = tc_probe(root)
        out["version"] = torch_checkpointing.__version__
        out["direct_io"] = why is None
        out["default_storage_failure"] = why
        manager = _tc_manager(why is None)

        def meta_tc(path: Path) -> dict[str, Any]:
            meta = path / ".metadata"
            files = sorted(path.glob("*.pt"))
            return {"metadata_bytes": sum(_zip_index_bytes(f) for f in files),
                    "metadata_file_bytes": meta.stat().st_size if meta.exists() else 0,
                    "files": [f.name for f in files]}

        return (lambda p, s: manager.save(str(p), s),
                lambda p, t: manager.load(str(p), into=t), meta_tc)
    raise ValueError(f"unknown contestant {name!r}; choose from {CONTESTANTS}")


# ----------------------------------------------------------------------------- parent
def fresh_partial(ctx: Ctx, row: dict[str, Any]) -> dict[str, Any]:
    """The partial load of row's key in a fresh process, `ctx.reps` times: the best run by
    wall time, every wall time, and whether the tensor came back right."""
    spec = {"name": NAME, "key": row["one_key"], "path": row["one_path"],
            "shape": row["one_shape"], "dtype": row["one_dtype"],
            "direct_io": row.get("direct_io", True)}
    runs = []
    for _ in range(ctx.reps):
        child = run_child([sys.executable, "-c", PARTIAL_CHILD, row["contestant"],
                           row["checkpoint"], json.dumps(spec)], ctx).check("partial load")
        runs.append({**child.last_json(), "wall_s": child.wall_s, "maxrss": child.maxrss})
    top = min(runs, key=lambda r: r["wall_s"])
    return {**top, "walls_s": [r["wall_s"] for r in runs],
            "verified": all(r["tensors_returned"] == 1 and r["checksum"] == row["one_checksum"]
                            for r in runs)}


def available(ctx: Ctx, contestants: list[str]) -> dict[str, str]:
    """{contestant: why it cannot run here} for the contestants that cannot."""
    missing: dict[str, str] = {}
    if "dcp" in contestants:
        import torch.distributed as dist

        if not dist.is_available():
            missing["dcp"] = "torch.distributed is not available in this torch build"
    if "torch_checkpointing" in contestants:
        if importlib.util.find_spec("torch_checkpointing") is None:
            missing["torch_checkpointing"] = (f"torch_checkpointing is not installed "
                                              f"(`{TC_INSTALL}`)")
    return missing


def _ratios(rows: list[dict[str, Any]]) -> None:
    """ckptstore / peer of every figure, set on each peer row of the same state."""
    def figures(r: dict[str, Any]) -> dict[str, float]:
        save = r["save"]["best_s"] + r.get("fsync_after_s", 0.0)
        p = r["partial"]
        return {"save": save, "load": r["load"]["best_s"], "partial_load": p["load_s"],
                "partial_wall": p["wall_s"], "partial_rss": p["maxrss"],
                "metadata": r["metadata_bytes"]}

    ok = [r for r in rows if "error" not in r]
    for r in ok:
        if r["contestant"] == "ckptstore":
            continue
        base = next((c for c in ok if c["contestant"] == "ckptstore"
                     and (c["shape"], c["n"]) == (r["shape"], r["n"])), None)
        if base is None:
            continue
        mine, theirs = figures(base), figures(r)
        r["ratios"] = {k: mine[k] / theirs[k] if theirs[k] else None for k in mine}


def run(ctx: Ctx, sizes: list[int], small_n: int, contestants: list[str]) -> dict[str, Any]:
    missing = available(ctx, contestants)
    for name, why in missing.items():
        ctx.note(f"peers: {name} not run: {why}")
    states = [("moe", n) for n in sizes] + ([("small", small_n)] if small_n else [])
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for shape, n in states:
        for name in contestants:
            if name in missing:
                continue
            ctx.note(f"peers: {shape} {n:,} tensors, {name}")
            folder = ctx.folder(f"peers-{shape}-{n}-{name}")
            try:
                row = run_worker(ctx, "peers.measure", contestant=name, folder=str(folder),
                                 shape=shape, n=n, reps=ctx.reps)
                row["partial"] = fresh_partial(ctx, row)
            except RuntimeError as e:
                row = {"contestant": name, "shape": shape, "tensors": n,
                       "error": str(e).strip().splitlines()[-1][:300]}
                ctx.note(f"peers: {name} failed on {shape} {n:,}: {row['error']}")
            row["n"] = n
            rows.append(row)
            why = row.get("default_storage_failure")
            if why and not any(x.startswith("torch_checkpointing:") for x in notes):
                notes.append(f"torch_checkpointing: {why}; measured with use_direct_io=False "
                             "(no O_DIRECT, no fsync) plus an fsync of its files by the bench")
                ctx.note(f"peers: {notes[-1]}")
            shutil.rmtree(folder, ignore_errors=True)
    _ratios(rows)
    return {"contestants": contestants, "not_run": missing, "rows": rows, "notes": notes,
            "repeat_under_s": REPEAT_UNDER_S}
