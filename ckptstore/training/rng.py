"""Capture and restore random number generator states (python, numpy's global generator, torch
CPU, CUDA when present) as plain arrays: no pickle. Use it as a Stateful value:

    mgr.save(step, {"model": model, "optim": opt, "rng": ckptstore.RNGState()})

Under torch.distributed every rank has its own generators: each state is stored as that
rank's row of a (world_size, ...) array, so restoring needs the same world size (on another
world size the saved states are left alone and the generators keep their current state).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from ..format.shard import Shard


def _rank_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist
    except ImportError:
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RNGState:
    """A Stateful object (state_dict / load_state_dict) for this process's RNG states."""

    def state_dict(self) -> dict[str, Any]:
        import torch

        version, ints, gauss = random.getstate()
        name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state: dict[str, Any] = {
            "python_state": np.array(ints, dtype=np.uint64),
            "python_meta": np.array([version, gauss is not None, gauss or 0.0], np.float64),
            "numpy_key": np.asarray(key, dtype=np.uint32).copy(),
            "numpy_meta": np.array([pos, has_gauss, cached], dtype=np.float64),
            "torch_cpu": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["torch_cuda"] = torch.stack(torch.cuda.get_rng_state_all())
        rank, world = _rank_world()
        if world == 1:
            return state
        return {k: Shard(v[None], rank, (world, *v.shape)) for k, v in state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch

        rank, world = _rank_world()
        local = {}
        for k, v in state.items():
            if isinstance(v, Shard):
                v = v.data[0]
            elif world > 1:
                if v.shape[0] != world:
                    return  # saved on another world size: leave the generators alone
                v = v[rank]
            local[k] = v
        if np.ndim(local["python_state"]) != 1:
            return  # saved by several ranks, restored in one process: left alone too
        meta = local["python_meta"]
        random.setstate((int(meta[0]), tuple(int(x) for x in local["python_state"]),
                         float(meta[2]) if meta[1] else None))
        nm = local["numpy_meta"]
        np.random.set_state(("MT19937", np.asarray(local["numpy_key"], dtype=np.uint32),
                             int(nm[0]), int(nm[1]), float(nm[2])))
        # a fresh tensor: a row of the saved [world, n] tensor is a view at a storage offset,
        # and torch.set_rng_state reads from the storage's start (rank >= 1 crashed)
        torch.set_rng_state(torch.as_tensor(local["torch_cpu"]).clone())
        if "torch_cuda" in local and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([row.clone() for row in
                                          torch.as_tensor(local["torch_cuda"])])
