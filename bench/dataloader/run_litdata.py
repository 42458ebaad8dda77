"""Runner for litdata (see common.py for the protocol)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import synth  # noqa: E402


def upload(local: str, uri: str, endpoint: str) -> None:
    import boto3

    bucket, _, prefix = uri[len("s3://") :].partition("/")
    s3 = boto3.client("s3", endpoint_url=endpoint)
    for name in sorted(os.listdir(local)):
        s3.upload_file(os.path.join(local, name), bucket, f"{prefix}/{name}")


def _piece(kind: str, scale: float, field: str, piece: tuple[int, int]):  # type: ignore[no-untyped-def]
    for x in synth.sample_range(kind, scale, *piece):
        yield {field: x}


def order_phase(work: str) -> dict:
    """The small id dataset through litdata's writer and a shuffled StreamingDataset."""
    from litdata import StreamingDataset
    from litdata.streaming.writer import BinaryWriter

    out = os.path.join(work, "order")
    os.makedirs(out, exist_ok=True)
    w = BinaryWriter(out, chunk_bytes="1MB")
    for i, p in synth.order_samples():
        w.add_item(i, {"id": i, "data": p})
    w.done()
    w.merge()
    ds = StreamingDataset(out, shuffle=True, seed=0)
    return {"default": [int(s["id"]) for s in ds]}


def main() -> None:
    phase, cfg = common.config()
    kind, scale, uri, work = cfg["kind"], cfg["scale"], cfg["uri"], cfg["work"]
    field = "tokens" if kind == "tokens" else "data"
    if phase == "write":
        from litdata import optimize

        t0 = time.perf_counter()
        out = uri if not uri.startswith("s3://") else os.path.join(work, "staging")
        n = synth.count(kind, scale)
        pieces = [(a, min(a + 4096, n)) for a in range(0, n, 4096)]
        optimize(
            fn=partial(_piece, kind, scale, field),
            inputs=pieces,
            output_dir=out,
            chunk_bytes="64MB",
            num_workers=cfg.get("peer_write_workers", 2),
            verbose=False,
        )
        if uri.startswith("s3://"):
            upload(out, uri, cfg["endpoint"])
            shutil.rmtree(out)
        common.emit({"write_s": time.perf_counter() - t0})
        return
    if phase == "order":
        common.emit(order_phase(work))
        return

    import litdata.streaming.downloader as downloader
    from litdata import StreamingDataLoader, StreamingDataset

    # obstore refuses plain http unless told; the moto endpoint is http://127.0.0.1
    opts = downloader._OBSTORE_CLIENT_OPTIONS
    downloader._OBSTORE_CLIENT_OPTIONS = {**opts, "allow_http": "true"}

    def make(state):
        # litdata's state names its cache folder: resume with the same (emptied, so cold) one
        cache = os.path.join(work, "cache")
        shutil.rmtree(cache, ignore_errors=True)
        kw = {}
        if uri.startswith("s3://"):
            kw = {"cache_dir": cache, "storage_options": {"endpoint_url": cfg["endpoint"]}}
        ds = StreamingDataset(uri, shuffle=True, seed=0, **kw)
        loader = StreamingDataLoader(
            ds,
            batch_size=cfg["batch_size"],
            num_workers=cfg.get("workers", 2),
            collate_fn=None if kind == "tokens" else common.list_collate,
        )
        if state is not None:
            loader.load_state_dict(state)
        return loader, iter(loader)

    state_of = lambda loader: loader.state_dict()  # noqa: E731
    common.emit(common.read_phase(make, state_of, synth.count(kind, scale)))


if __name__ == "__main__":
    main()
