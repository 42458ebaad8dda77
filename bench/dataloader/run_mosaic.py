"""Runner for mosaicml-streaming (run it with the separate venv's python)."""

from __future__ import annotations

import gc
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import synth  # noqa: E402


def stub_torchvision() -> None:
    """streaming imports torchvision (for its vision datasets, unused here) at import time;
    where the installed torchvision does not load beside this torch, stand in an empty one."""
    import importlib.machinery
    import types

    try:
        import torchvision  # noqa: F401

        return
    except Exception:
        for k in [k for k in sys.modules if k.split(".")[0] == "torchvision"]:
            del sys.modules[k]
    tv = types.ModuleType("torchvision")
    tv.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)
    ds = types.ModuleType("torchvision.datasets")
    tr = types.ModuleType("torchvision.transforms")
    fn = types.ModuleType("torchvision.transforms.functional")
    ds.VisionDataset = ds.CIFAR10 = object  # type: ignore[attr-defined]
    fn.to_tensor = None  # type: ignore[attr-defined]
    tr.functional = fn  # type: ignore[attr-defined]
    tv.datasets, tv.transforms = ds, tr  # type: ignore[attr-defined]
    sys.modules.update({"torchvision": tv, "torchvision.datasets": ds,
                        "torchvision.transforms": tr, "torchvision.transforms.functional": fn})


stub_torchvision()


def order_phase(work: str) -> dict:
    """The small id dataset through MDSWriter and a shuffled StreamingDataset."""
    from streaming import MDSWriter, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    out = os.path.join(work, "order")
    with MDSWriter(out=out, columns={"id": "int", "data": "bytes"}, size_limit="1mb") as w:
        for i, p in synth.order_samples():
            w.write({"id": i, "data": p})
    ds = StreamingDataset(local=out, shuffle=True, shuffle_seed=0, batch_size=1)
    return {"default (py1e)": [int(s["id"]) for s in ds]}


def upload(local: str, uri: str, endpoint: str) -> None:
    import boto3

    bucket, _, prefix = uri[len("s3://") :].partition("/")
    s3 = boto3.client("s3", endpoint_url=endpoint)
    for root, _, files in os.walk(local):
        for name in sorted(files):
            path = os.path.join(root, name)
            s3.upload_file(path, bucket, f"{prefix}/{os.path.relpath(path, local)}")


def main() -> None:
    phase, cfg = common.config()
    kind, scale, uri, work = cfg["kind"], cfg["scale"], cfg["uri"], cfg["work"]
    if cfg.get("endpoint"):
        os.environ["S3_ENDPOINT_URL"] = cfg["endpoint"]
    field = "tokens" if kind == "tokens" else "data"
    if phase == "order":
        common.emit(order_phase(work))
        return
    if phase == "write":
        from streaming import MDSWriter

        t0 = time.perf_counter()
        out = uri if not uri.startswith("s3://") else os.path.join(work, "staging")
        cols = {field: f"ndarray:int32:{synth.SEQ}" if kind == "tokens" else "bytes"}
        with MDSWriter(out=out, columns=cols, size_limit="64mb") as w:
            for x in synth.samples(kind, scale):
                w.write({field: x})
        if uri.startswith("s3://"):
            upload(out, uri, cfg["endpoint"])
            shutil.rmtree(out)
        common.emit({"write_s": time.perf_counter() - t0})
        return

    from streaming import StreamingDataLoader, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    counter = {"n": 0}

    def make(state):
        counter["n"] += 1
        gc.collect()
        clean_stale_shared_memory()
        bs = cfg["batch_size"]
        if uri.startswith("s3://"):
            ds = StreamingDataset(
                remote=uri,
                local=os.path.join(work, f"cache{counter['n']}"),
                shuffle=True,
                shuffle_seed=0,
                batch_size=bs,
            )
        else:
            ds = StreamingDataset(local=uri, shuffle=True, shuffle_seed=0, batch_size=bs)
        loader = StreamingDataLoader(
            ds,
            batch_size=bs,
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
