"""A two-minute tour: save a small model with its AdamW state to a local folder store, restore
it into fresh objects, check every tensor, then save again incrementally and asynchronously.

    python examples/demo.py [--root runs/demo]
    AWS_ENDPOINT_URL=http://127.0.0.1:9000 python examples/demo.py --root s3://bucket/demo

A local folder is cleared first. An S3 prefix is never cleared: a second run saves under new
names (step-2-run2, ...) and shows that every chunk is already stored.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

import ckptstore


def build_model() -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Embedding(8192, 256)]
    for _ in range(4):
        layers += [torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256),
                   torch.nn.LayerNorm(256)]
    return torch.nn.Sequential(*layers)


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> float:
    loss = torch.zeros(())
    for _ in range(steps):
        x = torch.randint(0, 8192, (16,))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def run_suffix(repo: ckptstore.CheckpointStore) -> str:
    """'' for the first demo run in `repo`, else '-runN' for the first N whose names are free."""
    names = set(repo.names())
    if "step-2" not in names and "step-3" not in names:
        return ""
    n = 2
    while f"step-2-run{n}" in names or f"step-3-run{n}" in names:
        n += 1
    return f"-run{n}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="runs/demo", help="store URI (folder or s3://...)")
    args = parser.parse_args()
    # a table must not wrap when the output is a file or a pipe (rich assumes 80 columns)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    if "://" not in args.root:
        shutil.rmtree(args.root, ignore_errors=True)

    torch.manual_seed(0)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, opt, 2)
    repo = ckptstore.CheckpointStore(args.root)

    run = run_suffix(repo)
    if run:
        console.print(f"{repo.uri} holds an earlier demo run: this one saves as step-2{run} "
                      "and step-3" + run)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    full = repo.save(f"step-2{run}", state, metadata={"step": 2})

    fresh = build_model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    restored = repo.load(f"step-2{run}")
    load_s = time.perf_counter() - t0
    fresh.load_state_dict(restored["model"])
    fresh_opt.load_state_dict(restored["optim"])
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  fresh.state_dict().values()))

    # freeze the embedding (as in fine-tuning), train on, save again: only changed chunks go out
    model[0].weight.requires_grad_(False)
    train_steps(model, opt, 1)
    handle = repo.save_async(f"step-3{run}",
                             {"model": model.state_dict(), "optim": opt.state_dict()},
                             metadata={"step": 3})
    inc = handle.wait()

    table = Table(title=f"ckptstore demo: {repo.uri}")
    for col in ("save", "tensors", "logical", "written", "reused", "blocked", "total",
                "speed"):
        table.add_column(col, justify="right" if col != "save" else "left")
    for label, info in ((f"step-2{run} full", full), (f"step-3{run} async+incr", inc)):
        table.add_row(label, str(info.tensors), mib(info.logical_bytes), mib(info.written_bytes),
                      mib(info.reused_bytes), f"{info.blocked_seconds * 1000:.0f} ms",
                      f"{info.seconds * 1000:.0f} ms", f"{info.throughput / 2**30:.2f} GiB/s")
    console.print(table)
    console.print(f"restore of step-2{run}: {mib(full.logical_bytes)} in {load_s * 1000:.0f} ms, "
                  f"every chunk verified; model identical after restore: {same}")
    report = repo.verify(f"step-3{run}")
    console.print(f"verify step-3{run}: {report.blobs_checked} blobs, "
                  f"{'OK' if report.ok else 'PROBLEMS'}")
    console.print("checkpoints: " + ", ".join(f"{c.name} (step {c.metadata.get('step')})"
                                               for c in repo.list()))
    repo.close()
    if not same or not report.ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
