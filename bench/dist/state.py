"""The synthetic state of the distributed benchmark, rebuilt identically at any world size.

* replicated ("model", DDP-like): a decoder-style stack of fp32 layers (fused qkv, attention
  out, 4x MLP up/down, their biases, two layernorms), the same bytes on every rank, about
  `size_mib` in total; biases and layernorms are small (packed by ckptstore);
* sharded ("optim", ZeRO/FSDP-like): 4 fp32 tensors of `shard_mib / 4` each, shape
  (rows, 1024), row-sharded over the ranks (contiguous equal slices, the DTensor Shard(0)
  split). Rows are generated in fixed blocks, each from its own seed, so a rank of any world
  size builds exactly its rows of the same global tensors.

Values are uniform floats from numpy's PCG64 (fast, every chunk distinct: nothing dedups).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

MiB = 1 << 20
SHARD_COLS = 1024
SHARD_TENSORS = 4
GEN_BLOCK_ROWS = 256
TOUCH_STRIDE = 1024  # elements: one touched element per 4 KiB page, so every chunk changes


@dataclass(frozen=True)
class Spec:
    size_mib: int
    shard_mib: int
    layers: int
    worlds: tuple[int, ...]
    seed: int = 1234

    @property
    def d(self) -> int:
        """Model width: 12 d^2 fp32 weights per layer add up to about size_mib."""
        d = int(math.sqrt(self.size_mib * MiB / (48 * self.layers))) // 64 * 64
        return max(64, d)

    @property
    def shard_rows(self) -> int:
        """Global rows of each sharded tensor: a multiple of every world size x the
        generation block (so every rank's slice starts on a block)."""
        unit = math.lcm(*self.worlds) * GEN_BLOCK_ROWS
        rows = self.shard_mib * MiB // SHARD_TENSORS // (SHARD_COLS * 4)
        return max(unit, rows // unit * unit)

    def replicated_layout(self) -> list[tuple[str, tuple[int, ...]]]:
        d = self.d
        out: list[tuple[str, tuple[int, ...]]] = []
        for i in range(self.layers):
            p = f"layers.{i}."
            out += [
                (p + "ln1.weight", (d,)),
                (p + "ln1.bias", (d,)),
                (p + "attn.qkv.weight", (3 * d, d)),
                (p + "attn.qkv.bias", (3 * d,)),
                (p + "attn.out.weight", (d, d)),
                (p + "attn.out.bias", (d,)),
                (p + "ln2.weight", (d,)),
                (p + "ln2.bias", (d,)),
                (p + "mlp.up.weight", (4 * d, d)),
                (p + "mlp.up.bias", (4 * d,)),
                (p + "mlp.down.weight", (d, 4 * d)),
                (p + "mlp.down.bias", (d,)),
            ]
        return out

    def replicated_bytes(self) -> int:
        return sum(math.prod(s) * 4 for _k, s in self.replicated_layout())

    def shard_global_bytes(self) -> int:
        return SHARD_TENSORS * self.shard_rows * SHARD_COLS * 4 if self.shard_mib else 0


def split(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Contiguous equal split (rows are a multiple of world): DTensor Shard(0)'s split."""
    per = rows // world
    return rank * per, (rank + 1) * per


def _fill(t: torch.Tensor, seed: list[int]) -> None:
    rng = np.random.default_rng(seed)
    rng.random(out=t.numpy(), dtype=np.float32)


def build(
    spec: Spec, rank: int, world: int
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, int]]]:
    """(replicated tensors by key, sharded {key: (local rows, global row offset)})."""
    rep: dict[str, torch.Tensor] = {}
    for i, (key, shape) in enumerate(spec.replicated_layout()):
        t = torch.empty(shape, dtype=torch.float32)
        _fill(t, [spec.seed, i])
        rep[key] = t
    shards: dict[str, tuple[torch.Tensor, int]] = {}
    if spec.shard_mib:
        rows = spec.shard_rows
        a, b = split(rows, world, rank)
        for j in range(SHARD_TENSORS):
            local = torch.empty((b - a, SHARD_COLS), dtype=torch.float32)
            for blk in range(a // GEN_BLOCK_ROWS, b // GEN_BLOCK_ROWS):
                lo = blk * GEN_BLOCK_ROWS - a
                _fill(local[lo : lo + GEN_BLOCK_ROWS], [spec.seed, 1000 + j, blk])
            shards[f"exp_avg.{j}"] = (local, a)
    return rep, shards


def byte_view(t: torch.Tensor) -> np.ndarray:
    return t.numpy().reshape(-1).view(np.uint8)


def fingerprint(tensors: list[torch.Tensor]) -> list[str]:
    from ckptstore.format.hashing import digest

    return [
        digest(memoryview(byte_view(t)))  # type: ignore[arg-type]
        for t in tensors
    ]


def zero(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.zero_()


def touch(tensors: list[torch.Tensor]) -> None:
    """Negate one element per 4 KiB of every tensor: every chunk changes; applying it twice
    restores the exact original bytes."""
    for t in tensors:
        t.view(-1)[::TOUCH_STRIDE].neg_()


# ------------------------------------------------------------------------------ raw I/O
def pieces(views: list[np.ndarray], lo: int, hi: int) -> list[memoryview]:
    """memoryviews of bytes [lo, hi) of the concatenation of `views`."""
    out: list[memoryview] = []
    pos = 0
    for v in views:
        n = v.nbytes
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            out.append(memoryview(v[a - pos : b - pos]))  # type: ignore[arg-type]
        pos += n
        if pos >= hi:
            break
    return out


MAX_IO = 1 << 30


def write_all(fd: int, bufs: list[memoryview]) -> None:
    for buf in bufs:
        done = 0
        while done < len(buf):
            done += os.write(fd, buf[done : done + MAX_IO])


def read_all(fd: int, bufs: list[memoryview], offset: int) -> int:
    pos = offset
    for buf in bufs:
        done = 0
        while done < len(buf):
            n = os.preadv(fd, [buf[done : done + MAX_IO]], pos)
            if n == 0:
                raise OSError("unexpected end of file")
            done += n
            pos += n
    return pos
