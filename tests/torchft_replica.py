"""One replica group (one rank) of a torchft job, run as its own process so that a test can
kill it with SIGKILL and start a replacement: `python -m tests.torchft_replica SPEC`, SPEC a
JSON object:

    {"replica": 0, "lighthouse": "http://...", "steps": 8, "seed": 42, "out": "path.json",
     "corrupt_once": false, "start_when": null}

With `start_when` (a path), the process imports and builds its model, then waits for that file
to exist before it joins the job (a replacement started ahead of the failure it replaces).

A real torchft Manager (gloo, its own TCPStore on 127.0.0.1) trains a small MLP with Adam
through torchft's OptimizerWrapper, gradients averaged with `manager.allreduce` (torchft
0.2's DistributedDataParallel comm hook asserts when an allreduce fails because a peer was
SIGKILLed, which would kill the healthy replica too); its checkpoint transport is
`ckptstore.torchft.Transport`, receiving into the replica's own model and optimizer
(`destinations`). With `corrupt_once`, the first chunk body it serves for a step after 0 has
one byte flipped on the way (the state itself is untouched). It prints `STEP n` after every
step and writes OUT: the xxh3 digest of every tensor and value of its final state, the
digests of its initial model, and what each of its receives (heals) did.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import xxhash
from torch import nn
from torchft.manager import Manager
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

from ckptstore.torchft import Transport


def digests(obj: Any, prefix: str = "") -> dict[str, str]:
    """Dotted key -> xxh3 of the tensor's bytes (dtype and shape included), or repr."""
    out: dict[str, str] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(digests(v, f"{prefix}{k}."))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(digests(v, f"{prefix}{i}."))
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous()
        raw = t.view(torch.uint8) if t.dtype.itemsize == 1 else t
        data = np.ascontiguousarray(raw.numpy()).tobytes() if t.numel() else b""
        out[prefix[:-1]] = f"{t.dtype}{list(t.shape)}:{xxhash.xxh3_128_hexdigest(data)}"
    else:
        out[prefix[:-1]] = repr(obj)
    return out


def main(spec: dict[str, Any]) -> None:
    start_when = spec.get("start_when")
    while start_when is not None and not os.path.exists(start_when):
        time.sleep(0.02)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True,  # type: ignore[attr-defined]
                          wait_for_workers=False)
    torch.manual_seed(spec["seed"])
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    initial = digests(model.state_dict())
    transport: Transport | None = None
    flipped = threading.Event()

    def corrupt(digest: str, offset: int, data: memoryview) -> bytes | None:
        sent = transport.last_send if transport is not None else None
        if not spec.get("corrupt_once") or sent is None or sent.step == 0 or flipped.is_set():
            return None
        flipped.set()
        bad = bytearray(data)
        bad[len(bad) // 2] ^= 0x40
        print(f"CORRUPTED {digest} at {offset + len(bad) // 2}", flush=True)
        return bytes(bad)

    transport = Transport(timedelta(seconds=30),
                          destinations=lambda: {"user": {"default": state_dict()}},
                          serve_hook=corrupt)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), min_replica_size=2,
        load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"replica_{spec['replica']}", store_addr="127.0.0.1",
        store_port=store.port, rank=0, world_size=1, lighthouse_addr=spec["lighthouse"],
        hostname="127.0.0.1", timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=90), connect_timeout=timedelta(seconds=30),
        checkpoint_transport=transport)
    optimizer = OptimizerWrapper(manager, opt)
    heals: list[dict[str, Any]] = []
    seen = None
    while manager.current_step() < spec["steps"]:
        step = manager.current_step()
        g = torch.Generator().manual_seed(1000 * spec["replica"] + step)
        x = torch.rand(8, 16, generator=g)
        y = torch.randint(0, 4, (8,), generator=g)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        works = [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]
        for work in works:
            work.wait()
        optimizer.step()
        if transport.last_receive is not seen:
            seen = transport.last_receive
            assert seen is not None
            heals.append(asdict(seen))
        print(f"STEP {manager.current_step()}", flush=True)
    result = {
        "step": manager.current_step(), "state": digests(state_dict()), "initial": initial,
        "heals": heals, "served": transport.bytes_served, "flipped": flipped.is_set(),
    }
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    manager.shutdown(wait=False)
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's slow teardown of torchft's threads


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
