"""A small training job that streams its data with `dataloader` and checkpoints with
`ckptstore.CheckpointManager` (async saves, retention). Kill it at any point and run it
again: it resumes from the latest whole checkpoint and its losses continue bit for bit as if
it had never stopped.

    python examples/train.py --run runs/train --steps 60 --every 5
    # tiered: node-local disk first, every 2nd checkpoint also to S3 (MinIO), restore from
    # whichever tier still holds a whole copy
    python examples/train.py --run /nvme/train --far s3://bucket/train \
        --endpoint-url http://127.0.0.1:9000 --far-every 2 --keep-far 10

Each step prints `step <n> loss <float.hex>`; after a save is handed to the background it
prints `saving <n>`. This is the plain-PyTorch loop the docs describe.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

import ckptstore
import dataloader

VOCAB, SEQ = 512, 32


def ensure_dataset(uri: str, n: int = 2048) -> None:
    """Write a deterministic synthetic token dataset once."""
    try:
        dataloader.StreamingDataset(uri)
        return
    except dataloader.DatasetNotFoundError:
        pass
    rng = np.random.default_rng(0)
    samples = ({"tokens": rng.integers(0, VOCAB, SEQ + 1, dtype=np.int64)} for _ in range(n))
    dataloader.write_dataset(uri, samples, schema={"tokens": "fixed"})


class TinyLM(torch.nn.Module):
    def __init__(self, extra_rows: int = 0) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB + extra_rows, 128)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(512, 128))
        self.norm = torch.nn.LayerNorm(128)
        self.head = torch.nn.Linear(128, VOCAB + extra_rows, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(self.norm(h + self.mlp(h)))


def say(line: str, hold_after: str | None) -> None:
    print(line, flush=True)
    if hold_after and (line == hold_after or line.startswith(hold_after + " ")):
        # a test kills us here; background saves go on meanwhile
        time.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="runs/train", help="checkpoint store URI (tier 0)")
    p.add_argument("--far", action="append", default=[],
                   help="a farther tier (repeat for more, nearest first): checkpoints are "
                        "replicated there in the background")
    p.add_argument("--far-every", type=int, default=1,
                   help="farther tiers receive every N-th checkpoint")
    p.add_argument("--keep-far", type=int, default=10, help="checkpoints kept on farther tiers")
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint of s3:// tiers")
    p.add_argument("--data", default=None, help="dataset URI (default: <run>-data)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--sync", action="store_true", help="synchronous saves")
    p.add_argument("--extra-rows", type=int, default=0,
                   help="unused embedding rows, to make the state (and each save) bigger")
    p.add_argument("--hold-after", default=None,
                   help="after printing the line that is or starts with this text and a space, "
                        "stop and wait to be killed (used by tests)")
    args = p.parse_args(argv)
    data_uri = args.data or args.run.rstrip("/") + "-data"

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    ensure_dataset(data_uri)
    model = TinyLM(args.extra_rows)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    loader = dataloader.StreamingLoader(
        dataloader.StreamingDataset(data_uri, shuffle=True, seed=1234), batch_size=args.batch,
        num_workers=2, drop_last=True, collate="torch")
    rng = ckptstore.RNGState()
    state = {"model": model, "optim": opt, "sched": sched, "data": loader, "rng": rng}
    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    if args.far:
        tiers = [args.run, *args.far]
        mgr = ckptstore.CheckpointManager(
            tiers, keep_last=[3] + [args.keep_far] * len(args.far),
            every=[1] + [args.far_every] * len(args.far), async_save=not args.sync, **options)
    else:
        mgr = ckptstore.CheckpointManager(args.run, keep_last=3, async_save=not args.sync,
                                          **options)

    step = mgr.restore(state) or 0
    print(f"start {step}", flush=True)
    if mgr.repo.last_load is not None and args.far:
        served = {uri: n for uri, n in mgr.repo.last_load.bytes_by_tier.items() if n}
        print(f"restored from {served}", flush=True)
    while step < args.steps:
        for batch in loader:
            tokens = batch["tokens"]
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            say(f"step {step} loss {loss.item().hex()}", args.hold_after)
            if step % args.every == 0:
                mgr.save(step, state)
                say(f"saving {step}", args.hold_after)
            if step >= args.steps:
                break
        else:
            loader.set_epoch(loader.epoch + 1)
    mgr.close()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
