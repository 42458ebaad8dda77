"""The synthetic states, deterministic (built the same in every process from a name and a
tensor count), with distinct bytes in every tensor (no dedup on a first save):

* ``small``: n fp32 tensors of 256 elements (1 KiB), flat dotted keys as nn.Module's
  state_dict has them (`blocks.<i // 100>.p<i % 100>`).
* ``moe``: a mixture-of-experts model with Adam, as `{"model": model.state_dict(), "optim":
  optimizer.state_dict()}` would give it: 8 layers, each a router (E, 32), two norms (32,)
  and E experts of w1, w2, w3 (32, 32) fp32 (4 KiB); Adam's state per parameter index:
  `step` (0-d), `exp_avg`, `exp_avg_sq`; one param group. E is chosen so that the state has
  about n tensors (4 per parameter).

And the Llama-shaped parameter layouts of the collective part (`llama`): Llama-2-7B, a
Llama-2-70B shape (GQA) for the with-Adam estimate, and a small one for the real gloo run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

LAYERS = 8
EXPERT_SHAPE = (32, 32)
SMALL_ELEMS = 256
SHAPES = ("small", "moe")


def build(shape: str, n: int) -> dict[str, Any]:
    if shape == "small":
        return build_small(n)
    if shape == "moe":
        return build_moe(n)
    raise ValueError(f"unknown state shape {shape!r}; choose from {SHAPES}")


def _random(count: int, inner: tuple[int, ...], seed: int) -> list[Any]:
    """`count` distinct tensors of shape `inner` (each its own storage)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    block = torch.randn((count, *inner), generator=g)
    return [t.clone() for t in block]


def build_small(n: int) -> dict[str, Any]:
    tensors = _random(n, (SMALL_ELEMS,), seed=n)
    return {f"blocks.{i // 100}.p{i % 100}": t for i, t in enumerate(tensors)}


def experts_per_layer(n: int) -> int:
    return max(1, round((n / 4 / LAYERS - 3) / 3))


def build_moe(n: int) -> dict[str, Any]:
    import torch

    experts = experts_per_layer(n)
    model: dict[str, Any] = {}
    for layer in range(LAYERS):
        p = f"layers.{layer}."
        model[p + "router.weight"] = _random(1, (experts, 32), seed=1000 + layer)[0]
        model[p + "norm1.weight"] = _random(1, (32,), seed=2000 + layer)[0]
        model[p + "norm2.weight"] = _random(1, (32,), seed=3000 + layer)[0]
        weights = iter(_random(3 * experts, EXPERT_SHAPE, seed=4000 + layer))
        for e in range(experts):
            for w in ("w1", "w2", "w3"):
                model[f"{p}experts.{e}.{w}"] = next(weights)
    count = len(model)
    avg, sq = _moments(model, 5000), _moments(model, 6000)
    state = {i: {"step": torch.tensor(100.0), "exp_avg": a, "exp_avg_sq": s.abs()}
             for i, (a, s) in enumerate(zip(avg, sq))}
    groups = [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
               "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
               "differentiable": False, "fused": None, "params": list(range(count))}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def _moments(model: dict[str, Any], seed: int) -> list[Any]:
    """One random tensor shaped like each parameter (an Adam moment)."""
    import torch

    shapes = [tuple(t.shape) for t in model.values()]
    pool = iter(_random(sum(s == EXPERT_SHAPE for s in shapes), EXPERT_SHAPE, seed))
    g = torch.Generator().manual_seed(seed + 1)
    return [next(pool) if s == EXPERT_SHAPE else torch.randn(s, generator=g) for s in shapes]


def tensors(state: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: tensor} of every tensor of a state, in state order."""
    import torch

    out: dict[str, Any] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(tensors(v, f"{prefix}{k}."))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(tensors(v, f"{prefix}{i}."))
    elif isinstance(state, torch.Tensor):
        out[prefix[:-1]] = state
    return out


def change(state: Any, step: int, fraction: float = 0.1) -> list[str]:
    """Change a random `fraction` of the tensors in place (seeded by `step`: the same in
    every process); returns their keys."""
    flat = tensors(state)
    keys = list(flat)
    rng = np.random.default_rng(step)
    picked = sorted(rng.choice(len(keys), size=max(1, round(fraction * len(keys))),
                               replace=False))
    for i in picked:
        flat[keys[i]].add_(float(step))
    return [keys[i] for i in picked]


def sample_keys(keys: list[str], k: int, seed: int = 7) -> list[str]:
    rng = np.random.default_rng(seed)
    picked = rng.choice(len(keys), size=min(k, len(keys)), replace=False)
    return [keys[i] for i in sorted(picked)]


# ----------------------------------------------------------------------------- Llama shapes
LLAMA = {
    # name: (hidden, ffn, vocab, layers, kv_rows); kv_rows: rows of k_proj/v_proj (GQA)
    "7b": (4096, 11008, 32000, 32, 4096),
    "70b": (8192, 28672, 32000, 80, 1024),
    "tiny": (512, 1376, 4000, 4, 512),
}


def llama(name: str, layers: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """(key, global shape) of every parameter of a Llama-2-style model, in state order."""
    d, f, vocab, n_layers, kv = LLAMA[name]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, d))]
    for i in range(n_layers if layers is None else layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (d, d)), (p + "self_attn.k_proj.weight", (kv, d)),
                (p + "self_attn.v_proj.weight", (kv, d)), (p + "self_attn.o_proj.weight", (d, d)),
                (p + "mlp.gate_proj.weight", (f, d)), (p + "mlp.up_proj.weight", (f, d)),
                (p + "mlp.down_proj.weight", (d, f)), (p + "input_layernorm.weight", (d,)),
                (p + "post_attention_layernorm.weight", (d,))]
    out += [("model.norm.weight", (d,)), ("lm_head.weight", (vocab, d))]
    return out


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(offset, count) of this rank's rows: FSDP2's Shard(0) split (torch.chunk: ceil(rows /
    world) rows per rank, the last ranks short or empty)."""
    per = -(-rows // world)
    start = min(rows, rank * per)
    return start, min(rows, start + per) - start
