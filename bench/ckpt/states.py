"""The synthetic states every contestant saves: deterministic, built identically in every
subprocess from a name, with distinct bytes in every chunk (so no contestant gains from dedup
on the first save; the benchmark checks ckptstore reports zero reused chunks there).

* ``1g``/``4g``: fp32 decoder-only transformer (token and position embeddings, per layer
  layernorm weights and biases, fused qkv, attention out, 4x MLP with biases, untied head).
* ``small20k``: 20,000 small fp32 tensors (16..16384 elements, 1-D and 2-D).
* ``bf16``: the ``1g`` shape family in bfloat16 (same bytes, so twice the parameters).

Values are N(0, 0.02) drawn once into a pool of a prime number of elements; each tensor is a
window of the pool at its own random offset, so chunks differ and building 4 GiB costs about
one memory copy instead of 4 GiB of random-number generation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .common import GiB, MiB

POOL_ELEMS = 8_388_617  # prime: no chunk boundary of any tensor lines up with a wrap of the pool


@dataclass(frozen=True)
class StateSpec:
    name: str
    kind: str  # "transformer" | "small"
    dtype: str  # "float32" | "bfloat16"
    target_bytes: int
    count: int = 0  # small tensors: how many
    description: str = ""


def specs(quick: bool) -> dict[str, StateSpec]:
    scale = 8 if quick else 1
    return {
        "1g": StateSpec(
            "1g", "transformer", "float32", GiB // scale, description="~1 GiB fp32 transformer"
        ),
        "4g": StateSpec(
            "4g", "transformer", "float32", 4 * GiB // scale, description="~4 GiB fp32 transformer"
        ),
        "small20k": StateSpec(
            "small20k", "small", "float32", 0, count=20_000, description="20,000 small fp32 tensors"
        ),
        "bf16": StateSpec(
            "bf16", "transformer", "bfloat16", GiB // scale, description="~1 GiB bf16 transformer"
        ),
    }


def layout(spec: StateSpec, quick: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """(key, shape) of every tensor, in state-dict order."""
    if spec.kind == "small":
        rng = np.random.default_rng(20_000)
        hi = 2048 if quick else 16384
        sizes = np.exp(rng.uniform(np.log(16), np.log(hi), spec.count)).astype(int)
        out = []
        for i, n in enumerate(sizes):
            n = int(n)
            shape = (n // 16, 16) if n >= 256 else (n,)
            out.append((f"blocks.{i // 100}.p{i % 100}", shape))
        return out
    itemsize = 2 if spec.dtype == "bfloat16" else 4
    params = spec.target_bytes // itemsize
    d = 512 if params < 100e6 else (1024 if params < 400e6 else 2048)
    vocab = 16384 if d == 512 else 50304
    ctx = 2048
    per_layer = 12 * d * d + 13 * d
    fixed = 2 * vocab * d + ctx * d + 2 * d
    n_layers = max(2, round((params - fixed) / per_layer))
    out = [("embed.tok.weight", (vocab, d)), ("embed.pos.weight", (ctx, d))]
    for i in range(n_layers):
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
            (p + "mlp.fc1.weight", (4 * d, d)),
            (p + "mlp.fc1.bias", (4 * d,)),
            (p + "mlp.fc2.weight", (d, 4 * d)),
            (p + "mlp.fc2.bias", (d,)),
        ]
    out += [("ln_f.weight", (d,)), ("ln_f.bias", (d,)), ("lm_head.weight", (vocab, d))]
    return out


def _pool(dtype: str):  # -> torch.Tensor
    import torch

    g = torch.Generator().manual_seed(12345)
    pool = torch.randn(POOL_ELEMS, generator=g) * 0.02
    return pool.to(torch.bfloat16) if dtype == "bfloat16" else pool


def build(spec: StateSpec, quick: bool = False, empty: bool = False) -> dict:
    """The state as a flat dict of CPU tensors. `empty=True`: same shapes, zero-filled (and
    so resident), for restore destinations."""
    import torch

    dt = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float32
    shapes = layout(spec, quick)
    if empty:
        return {k: torch.zeros(shape, dtype=dt) for k, shape in shapes}
    pool = _pool(spec.dtype)
    rng = np.random.default_rng(777)
    state = {}
    for key, shape in shapes:
        t = torch.empty(shape, dtype=dt)
        flat = t.view(-1)
        n = flat.numel()
        pos = 0
        src = int(rng.integers(0, POOL_ELEMS))
        while pos < n:
            take = min(n - pos, POOL_ELEMS - src)
            flat[pos : pos + take].copy_(pool[src : src + take])
            pos += take
            src = 0
        state[key] = t
    return state


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def changed_subset(state: dict, fraction: float = 0.10, seed: int = 1) -> list[str]:
    """Keys of tensors holding about `fraction` of the state's bytes (never more), chosen in a
    seeded random order: a mix of big matrices and small vectors."""
    total = nbytes(state)
    keys = list(state)
    order = np.random.default_rng(seed).permutation(len(keys))
    chosen, acc = [], 0
    for i in order:
        k = keys[int(i)]
        b = state[k].numel() * state[k].element_size()
        if acc + b <= fraction * total:
            chosen.append(k)
            acc += b
        if acc >= 0.97 * fraction * total:
            break
    return chosen


def touch(state: dict, keys: list[str] | None = None) -> None:
    """Change every element of the given tensors (all if None), like a training step."""
    import torch

    with torch.no_grad():
        for k in keys if keys is not None else list(state):
            state[k].add_(1.0)


def describe(spec: StateSpec, state: dict) -> dict:
    sizes = [t.numel() * t.element_size() for t in state.values()]
    return {
        "name": spec.name,
        "description": spec.description,
        "dtype": spec.dtype,
        "tensors": len(sizes),
        "bytes": sum(sizes),
        "GiB": round(sum(sizes) / GiB, 3),
        "largest_MiB": round(max(sizes) / MiB, 2),
        "tensors_under_256KiB": sum(1 for s in sizes if s <= 256 * 1024),
    }
