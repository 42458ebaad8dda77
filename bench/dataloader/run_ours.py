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
    if phase == "write":
        t0 = time.perf_counter()
        dataloader.write_dataset(
            uri,
            ({field: x} for x in synth.samples(kind, scale)),
            schema={"tokens": "fixed"} if kind == "tokens" else None,
            store_options=opts,
            **({"shard_bytes": cfg["shard_bytes"]} if "shard_bytes" in cfg else {}),
        )
        common.emit({"write_s": time.perf_counter() - t0})
        return

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


if __name__ == "__main__":
    main()
