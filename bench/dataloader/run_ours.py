"""Runner for this project's dataloader (see common.py for the protocol)."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import common  # noqa: E402
import synth  # noqa: E402
import torch  # noqa: E402, F401  (imported up front, as the peers do)

import ckptstore.stores.s3  # noqa: E402, F401  (boto3 import is not part of time to first batch)
import dataloader  # noqa: E402


def main() -> None:
    phase, cfg = common.config()
    kind, scale, uri = cfg["kind"], cfg["scale"], cfg["uri"]
    opts = {"endpoint_url": cfg["endpoint"]} if cfg.get("endpoint") else {}
    field = "tokens" if kind == "tokens" else "data"
    if phase == "write":  # one write per entry of write_workers (None: single stream)
        result = {}
        for w in cfg.get("write_workers", [None]):
            target = f"{uri}-w{w}" if "write_workers" in cfg else uri
            t0 = time.perf_counter()
            # "pN": N forked processes, each generating the samples of its own partitions
            forked = isinstance(w, str) and w.startswith("p")
            dataloader.write_dataset(
                target,
                synth.LazySamples(kind, scale, field)
                if forked
                else ({field: x} for x in synth.samples(kind, scale)),
                schema={"tokens": "fixed"} if kind == "tokens" else None,
                store_options=opts,
                workers=int(w[1:]) if forked else w,
                **({"executor": "processes"} if forked else {}),
                **({"shard_bytes": cfg["shard_bytes"]} if "shard_bytes" in cfg else {}),
            )
            result[f"write_s_w{w}" if "write_workers" in cfg else "write_s"] = (
                time.perf_counter() - t0
            )
        result.setdefault("write_s", result[max(result)])
        common.emit(result)
        return
    if "write_workers" in cfg:  # read what the last write produced
        uri = f"{uri}-w{cfg['write_workers'][-1]}"
    if phase == "order":
        common.emit(order_phase(uri, opts))
        return
    if phase == "ttfb":  # a fresh process: open the dataset, time its first batch only
        t0 = time.perf_counter()
        ds = dataloader.StreamingDataset(uri, shuffle=True, seed=0, store_options=opts)
        it = iter(dataloader.StreamingLoader(ds, batch_size=cfg["batch_size"], num_workers=4,
                                             collate="torch"))
        next(it)
        common.emit({"ttfb_s": time.perf_counter() - t0})
        os._exit(0)  # do not wait for the prefetching threads

    def make(state):
        ds = dataloader.StreamingDataset(uri, shuffle=True, seed=0, store_options=opts)
        loader = dataloader.StreamingLoader(
            ds, batch_size=cfg["batch_size"], num_workers=cfg.get("workers", 4), collate="torch"
        )
        if state is not None:
            loader.load_state_dict(state)
        return loader, iter(loader)

    result = common.read_phase(
        make,
        lambda loader: loader.state_dict(),
        synth.count(kind, scale),
        first_ids=lambda b: [int(x) for x in b["_index"]],
    )
    common.emit(result)


def order_phase(uri: str, opts: dict) -> dict:
    """Write the small id dataset, read one shuffled epoch per shuffle mode: the ids in order."""
    small = uri + "-order"
    dataloader.write_dataset(
        small, ({"id": i, "data": p} for i, p in synth.order_samples()), store_options=opts,
        rows_per_chunk=256,
    )
    out = {}
    for name, mode, window in (
        ("window (default 32 MiB: the whole set)", "window", None),
        ("window of 1,024 samples", "window", 1024),
        ("full", "full", 1024),
    ):
        ds = dataloader.StreamingDataset(small, shuffle=True, seed=0, shuffle_mode=mode,
                                         shuffle_window=window, fields=["id"], store_options=opts)
        out[name] = [int(s["id"]) for s in ds]
    return out


if __name__ == "__main__":
    main()
