#!/usr/bin/env python
"""What each part of a background save's per-byte work costs a training step beside it.

    python bench/interference_probe.py                       # the docs/performance.md run
    python bench/interference_probe.py --rounds 2 --mib 96   # a quick look

A one-thread, memory-bound training step (a fixed-seed MLP with AdamW, as in
bench/async_step_bench.py but smaller: `--layers` layers of `--width`) runs in this process.
A worker process (started once, fed one variant at a time) "saves" `--mib` MiB of a source
array of its own, block by block (`--block-mib`, the default chunk size), each block as one
file (temp file, fsync, rename: the store's protocol), in one of these ways:

* buffered   today's path: copy the block into a page-aligned shared-memory slot (memfd),
             hash the slot (xxh3-128), write it with write(2) (the kernel copies it into the
             page cache), fsync
* fused      copy the block in `--piece-kib` pieces, each hashed by an incremental xxh3-128
             right after its copy, while it is still in cache; then as `buffered`
* direct     copy, hash, then write the slot with O_DIRECT (no page-cache copy: the device
             reads the slot), fsync
* fused+direct  both
* copy       the copies alone (no hash, no file): the floor every staged save pays

Rounds alternate the variants (rotated order each round). Before each variant the loop runs
`--idle-steps` steps with nothing beside it: the baseline of that variant in that round.
Per variant, medians over rounds: the mean step-time inflation while the save runs (busy
steps over the round's idle steps, minus one), the total extra step time per save (the sum
of (busy step - idle mean)), the save's wall time and CPU time. The fused digests are
checked against the one-shot digests of the same blocks.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20
PAGE = 4096
VARIANTS = ("buffered", "fused", "direct", "fused+direct", "copy")


# ------------------------------------------------------------------ the worker (saver)
def _slot(nbytes: int) -> np.ndarray:
    fd = os.memfd_create("probe-slot", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    mapped = mmap.mmap(fd, nbytes)
    os.close(fd)
    return np.frombuffer(mapped, np.uint8)


def _write_all(fd: int, view: memoryview) -> None:
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]


def _write_file(folder: str, name: str, data: memoryview, direct: bool) -> None:
    tmp = os.path.join(folder, ".tmp-" + name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    fd = os.open(tmp, flags | (os.O_DIRECT if direct else 0), 0o644)
    try:
        body = data.nbytes - data.nbytes % PAGE if direct else data.nbytes
        _write_all(fd, data[:body])
        if body < data.nbytes:  # the tail below one block: buffered
            import fcntl
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            _write_all(fd, data[body:])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, os.path.join(folder, name))


def _save(source: np.ndarray, slot: np.ndarray, block: int, piece: int, variant: str,
          folder: str) -> list[str]:
    import xxhash

    if variant == "copy":
        for start in range(0, source.nbytes, block):
            src = source[start : start + block]
            np.copyto(slot[: src.nbytes], src)
        return []
    fused = variant.startswith("fused")
    direct = variant.endswith("direct")
    digests = []
    for index, start in enumerate(range(0, source.nbytes, block)):
        src = source[start : start + block]
        dst = slot[: src.nbytes]
        if fused:
            hasher = xxhash.xxh3_128()
            for a in range(0, src.nbytes, piece):
                np.copyto(dst[a : a + piece], src[a : a + piece])
                hasher.update(dst[a : a + piece])
            d = hasher.hexdigest()
        else:
            np.copyto(dst, src)
            d = xxhash.xxh3_128_hexdigest(dst)
        _write_file(folder, f"{index:04d}", memoryview(dst), direct)
        digests.append(d)
    return digests


def worker(args: argparse.Namespace) -> None:
    """Commands on stdin (one variant name a line), one JSON reply a line on stdout."""
    nbytes = args.mib * MiB
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, nbytes, dtype=np.uint8)
    slot = _slot(args.block_mib * MiB)
    block, piece = args.block_mib * MiB, args.piece_kib * 1024
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        variant = line.strip()
        folder = tempfile.mkdtemp(dir=args.dir, prefix="probe-")
        c0, t0 = time.process_time(), time.perf_counter()
        digests = _save(source, slot, block, piece, variant, folder)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(json.dumps({"wall": wall, "cpu": cpu}), flush=True)
        # then (not timed) check: digests equal the one-shot digests, files equal the source
        import xxhash
        ok = variant == "copy" or all(
            d == xxhash.xxh3_128_hexdigest(source[i * block : (i + 1) * block])
            and Path(folder, f"{i:04d}").read_bytes() == source[i * block : (i + 1) * block]
            .tobytes() for i, d in enumerate(digests))
        shutil.rmtree(folder)
        print(json.dumps({"ok": ok}), flush=True)


# ------------------------------------------------------------------ the trainer
def _trainer(args: argparse.Namespace) -> Any:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randn(32, args.width, generator=torch.Generator().manual_seed(1))

    def step() -> None:
        loss = model(data).square().mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()

    for _ in range(5):
        step()
    return step


def _timed_steps(step: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variants", default=",".join(VARIANTS[:4]))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mib", type=int, default=480)
    p.add_argument("--block-mib", type=int, default=16)
    p.add_argument("--piece-kib", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--idle-steps", type=int, default=8)
    p.add_argument("--dir", default=None, help="where the files go (default: a temp folder)")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; known: {VARIANTS}")
    step = _trainer(args)
    cmd = [sys.executable, __file__, "--worker", "--mib", str(args.mib), "--block-mib",
           str(args.block_mib), "--piece-kib", str(args.piece_kib)]
    if args.dir:
        cmd += ["--dir", args.dir]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    assert json.loads(proc.stdout.readline())["ready"]
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for v in order:
            idle = statistics.fmean(_timed_steps(step, args.idle_steps))
            proc.stdin.write(v + "\n")
            proc.stdin.flush()
            busy: list[float] = []
            os.set_blocking(proc.stdout.fileno(), False)
            reply = None
            while reply is None:
                busy += _timed_steps(step, 1)
                reply = proc.stdout.readline() or None
            os.set_blocking(proc.stdout.fileno(), True)
            done = json.loads(reply)
            checked = json.loads(proc.stdout.readline())  # the worker's check, not timed
            assert checked["ok"], f"{v}: a digest or a file did not match the source"
            row = {"idle_ms": idle * 1e3,
                   "inflation": statistics.fmean(busy) / idle - 1,
                   "extra_ms": sum(b - idle for b in busy) * 1e3,
                   "steps": len(busy), "wall": done["wall"], "cpu": done["cpu"]}
            results[v].append(row)
            print(f"round {r} {v:>13}: idle {row['idle_ms']:.0f} ms, inflation "
                  f"{row['inflation']:+.1%} over {len(busy)} steps, extra "
                  f"{row['extra_ms']:.0f} ms, save {done['wall']:.2f} s wall "
                  f"{done['cpu']:.2f} s cpu", flush=True)
    proc.stdin.close()
    proc.wait()
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print("\n| variant | step (idle) | inflation | extra step time per save | save wall | "
          "save CPU |\n|---|---|---|---|---|---|")
    for v in variants:
        rows = results[v]

        def med(k: str, rows: list[dict[str, float]] = rows) -> str:
            vals = [x[k] for x in rows]
            m, lo, hi = statistics.median(vals), min(vals), max(vals)
            if k == "inflation":
                return f"{m:+.1%} ({lo:+.0%}..{hi:+.0%})"
            if k.endswith("ms"):
                return f"{m:.0f} ({lo:.0f}..{hi:.0f}) ms"
            return f"{m:.2f} ({lo:.2f}..{hi:.2f}) s"
        print(f"| {v} | {med('idle_ms')} | {med('inflation')} | {med('extra_ms')} | "
              f"{med('wall')} | {med('cpu')} |")


if __name__ == "__main__":
    main()
