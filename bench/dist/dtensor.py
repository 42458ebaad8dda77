"""DTensor resharding benchmark (bench/dist_bench.py --dtensor): ckptstore against DCP.

A tensor-parallel + FSDP-like state on a 2x2 mesh ("dp", "tp") of 4 ranks: per layer an
up-projection weight placed [Shard(0), Shard(0)] (FSDP dim 0 over column-wise TP), a
down-projection weight [Shard(0), Shard(1)] (FSDP dim 0 and row-wise TP on dim 1), each
with two Adam moments of the same placement, and a replicated norm weight. ckptstore saves it
with a collective CheckpointManager.save, DCP with dcp.save (FileSystemWriter, 4 threads,
sync_files=True), into the same scratch folder. Then phases of 2 and 4 ranks on 1-D meshes
with other placements restore both checkpoints into zeroed DTensors, in alternating order,
twice, checking every local tensor against the original values. Per rank it records the
time (max over ranks is reported), bytes read (ckptstore: its reader's count; both: the
process's `rchar` from /proc/self/io, every byte read through a system call) and the bytes
its local shards hold ("needed").
"""

from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

# the restore phases: tag -> (world size, placements per kind on a 1-D mesh)
RESTORES: dict[str, tuple[int, dict[str, list[str]]]] = {
    "tp2": (2, {"up": ["S0"], "down": ["S1"], "norm": ["R"]}),  # tensor parallel only
    "fsdp4": (4, {"up": ["S0"], "down": ["S0"], "norm": ["S1"]}),  # FSDP only, 4 ranks
    "flip2": (2, {"up": ["S1"], "down": ["S0"], "norm": ["R"]}),  # shards a dim never sharded
}
SAVE = {"up": ["S0", "S0"], "down": ["S0", "S1"], "norm": ["R", "R"]}


def spec(cfg: dict[str, Any]) -> dict[str, tuple[tuple[int, int], str]]:
    """key -> (global shape, kind)."""
    d, h = cfg["width"], cfg["hidden"]
    out: dict[str, tuple[tuple[int, int], str]] = {}
    for layer in range(cfg["layers"]):
        for part in ("param", "exp_avg", "exp_avg_sq"):
            out[f"{part}.l{layer}.up"] = ((h, d), "up")
            out[f"{part}.l{layer}.down"] = ((d, h), "down")
        out[f"param.l{layer}.norm"] = ((1, d), "norm")
    return out


def _full(key: str, shape: tuple[int, int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, key)) * 7919)
    return torch.rand(shape, generator=g)


def _placements(codes: list[str]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if c == "R" else Shard(int(c[1:])) for c in codes]


def _state(cfg: dict[str, Any], mesh: Any, layout: dict[str, list[str]], zero: bool
           ) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    state = {}
    for key, (shape, kind) in spec(cfg).items():
        full = torch.zeros(shape) if zero else _full(key, shape)
        state[key] = distribute_tensor(full, mesh, _placements(layout[kind]), src_data_rank=None)
    return state


def _check(cfg: dict[str, Any], state: dict[str, Any], mesh: Any,
           layout: dict[str, list[str]]) -> None:
    want = _state(cfg, mesh, layout, zero=False)
    for key, t in state.items():
        if not torch.equal(t.to_local(), want[key].to_local()):
            raise AssertionError(f"{key}: restored values differ")


def _zero(state: dict[str, Any]) -> None:
    for t in state.values():
        t.to_local().zero_()


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def _timed(fn: Any) -> tuple[float, int]:
    dist.barrier()
    r0, t0 = _rchar(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, _rchar() - r0


def main(rank: int, world: int, init_file: str, cfg_json: str, out_dir: str) -> None:
    cfg = json.loads(cfg_json)
    status = os.path.join(out_dir, f"status-{rank}")
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        result = _save(cfg, rank) if cfg["phase"] == "save" else _restore(cfg, rank, world)
        with open(os.path.join(out_dir, f"result-{rank}.json"), "w") as f:
            json.dump(result, f)
        with open(status, "w") as f:
            f.write("ok")
    except BaseException:
        with open(status, "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _save(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import ckptstore

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    state = _state(cfg, mesh, SAVE, zero=False)
    local = sum(t.to_local().nbytes for t in state.values())
    mgr = ckptstore.CheckpointManager(cfg["root"] + "/ckptstore")
    info: list[Any] = []
    cs, _ = _timed(lambda: info.append(mgr.save(1, state)))
    written = getattr(info[0], "written_bytes", None)
    mgr.close()
    writer = dcp.FileSystemWriter(cfg["root"] + "/dcp", thread_count=4, sync_files=True)
    dc, _ = _timed(lambda: dcp.save(state, storage_writer=writer))
    return {"rank": rank, "local_bytes": local, "ckptstore_s": cs, "dcp_s": dc,
            "ckptstore_written": written}


def _restore(cfg: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import ckptstore
    from ckptstore.pipeline.loading import load_state
    from ckptstore.pipeline.reader import CheckpointReader

    layout = RESTORES[cfg["tag"]][1]
    mesh = init_device_mesh("cpu", (world,))
    state = _state(cfg, mesh, layout, zero=True)
    needed = sum(t.to_local().nbytes for t in state.values())
    repo = ckptstore.CheckpointStore(cfg["root"] + "/ckptstore", create=False)
    manifest = repo.manifest(repo.latest())
    out: dict[str, Any] = {"rank": rank, "needed": needed, "ckptstore_s": [], "dcp_s": [],
                           "ckptstore_rchar": [], "dcp_rchar": [], "ckptstore_read": []}

    def ours() -> None:
        reader = CheckpointReader(repo.store, repo.load_options)
        load_state(reader, manifest, into=state)
        out["ckptstore_read"].append(reader.bytes_read)

    def theirs() -> None:
        dcp.load(state, storage_reader=dcp.FileSystemReader(cfg["root"] + "/dcp"))

    for round_ in range(cfg["rounds"]):
        order = [("ckptstore", ours), ("dcp", theirs)]
        for name, fn in order if round_ % 2 == 0 else order[::-1]:
            _zero(state)
            secs, rchar = _timed(fn)
            out[f"{name}_s"].append(secs)
            out[f"{name}_rchar"].append(rchar)
            _check(cfg, state, mesh, layout)
    repo.close()
    return out


# ---------------------------------------------------------------- the runner (parent process)
def run(args: Any, scratch: Any) -> dict[str, Any]:
    """Spawn the save phase (4 ranks) and the restore phases; return every rank's figures."""
    import torch.multiprocessing as mp

    cfg = {"width": args.dt_width, "hidden": args.dt_hidden, "layers": args.dt_layers,
           "rounds": args.dt_rounds, "root": str(scratch / "repos")}
    phases: dict[str, Any] = {}
    todo = [("save4", 4, "save")] + [(tag, w, "restore") for tag, (w, _l) in RESTORES.items()]
    for tag, world, phase in todo:
        out = scratch / f"out-{tag}"
        out.mkdir(parents=True)
        t0 = time.perf_counter()
        try:
            mp.start_processes(main, args=(world, str(scratch / f"pg-{tag}"),
                                           json.dumps({**cfg, "phase": phase, "tag": tag}), str(out)),
                               nprocs=world, join=True, start_method="spawn")
        finally:
            for r in range(world):
                f = out / f"status-{r}"
                if f.exists() and f.read_text() != "ok":
                    print(f"--- rank {r} of {tag} failed:\n{f.read_text()}")
        phases[tag] = {"ranks": [json.loads((out / f"result-{r}.json").read_text())
                                 for r in range(world)],
                       "seconds": time.perf_counter() - t0}
    return {"config": cfg, "restores": RESTORES,
            "save_layout": SAVE, "phases": phases}


def summary(res: dict[str, Any]) -> list[str]:
    """Markdown lines: save times, write shares, restore times and bytes read per rank."""
    lines = []
    save = res["phases"]["save4"]["ranks"]
    cs = max(r["ckptstore_s"] for r in save)
    dc = max(r["dcp_s"] for r in save)
    lines.append("| step | ckptstore s | DCP s | DCP s / ckptstore s |")
    lines.append("|---|---|---|---|")
    lines.append(f"| save on 4 (2x2 mesh) | {cs:.2f} | {dc:.2f} | {dc / cs:.2f} |")
    for tag in RESTORES:
        ranks = res["phases"][tag]["ranks"]
        ours = [max(r["ckptstore_s"][i] for r in ranks) for i in range(len(ranks[0]["dcp_s"]))]
        dcps = [max(r["dcp_s"][i] for r in ranks) for i in range(len(ranks[0]["dcp_s"]))]
        lines.append(f"| restore {tag} on {len(ranks)}: best (median) | {min(ours):.2f} "
                     f"({statistics.median(ours):.2f}) | {min(dcps):.2f} "
                     f"({statistics.median(dcps):.2f}) | {min(dcps) / min(ours):.2f} "
                     f"({statistics.median(dcps) / statistics.median(ours):.2f}) |")
    lines.append("")
    lines.append("Every round, max over ranks, s: " + "; ".join(
        f"{tag} ckptstore {[round(max(r['ckptstore_s'][i] for r in res['phases'][tag]['ranks']), 2) for i in range(res['config']['rounds'])]}"
        f" DCP {[round(max(r['dcp_s'][i] for r in res['phases'][tag]['ranks']), 2) for i in range(res['config']['rounds'])]}"
        for tag in RESTORES))
    lines.append("")
    written = [r["ckptstore_written"] for r in save]
    if all(isinstance(w, int) for w in written):
        mean = sum(written) / len(written)
        lines.append("ckptstore bytes written per rank on save: "
                     + ", ".join(f"{w / 2**20:.1f} MiB" for w in written)
                     + f" (max / mean {max(written) / mean:.3f})")
        lines.append("")
    lines.append("| restore | rank | needed MiB | ckptstore read MiB (x needed) | ckptstore rchar "
                 "(x needed) | DCP rchar (x needed) |")
    lines.append("|---|---|---|---|---|---|")
    for tag in RESTORES:
        for r in res["phases"][tag]["ranks"]:
            n = r["needed"]
            rd, rc, dr = r["ckptstore_read"][0], min(r["ckptstore_rchar"]), min(r["dcp_rchar"])
            lines.append(f"| {tag} | {r['rank']} | {n / 2**20:.1f} | "
                         f"{rd / 2**20:.1f} ({rd / n:.3f}) | {rc / 2**20:.1f} ({rc / n:.3f}) | "
                         f"{dr / 2**20:.1f} ({dr / n:.3f}) |")
    return lines
