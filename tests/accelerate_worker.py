"""A training loop with a real `accelerate.Accelerator(cpu=True)`: a tiny model with dropout
(so the RNG state matters), AdamW, StepLR, a shuffled stateful dataloader with accelerate's
seedable sampler, a registered custom object; checkpoints through ckptstore.accelerate.

Run: python tests/accelerate_worker.py --repo URI --project DIR --steps N --every K
     [--hold STEP] [--async]
Prints `start S`, `load DIGEST`, `loss STEP HEX`, `saved STEP DIGEST`, `hold STEP` (then
sleeps: the test kills it there), `final DIGEST`, `done`.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


class Seen:
    """A registered custom object (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples = state["samples"]


def build(project: str) -> dict[str, Any]:
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import ProjectConfiguration, set_seed

    set_seed(0)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=project),
                      dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
                                                                use_seedable_sampler=True))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g),
                                          torch.randn(24, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    # its own generator: creating the resumed loop's iterator must not draw from the global
    # RNG (the uninterrupted run drew at the epoch's start, before the dropout masks)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(2))
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    seen = Seen()
    acc.register_for_checkpointing(seen)
    return {"acc": acc, "model": model, "opt": opt, "loader": loader, "sched": sched,
            "seen": seen}


def digest(p: dict[str, Any]) -> str:
    from ckptstore.training import rank_rows

    h = hashlib.sha256()
    for t in [*p["model"].state_dict().values(), torch.get_rng_state()]:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for st in p["opt"].optimizer.state.values():
        for v in st.values():
            h.update(v.reshape(-1).view(torch.uint8).numpy().tobytes())
    loader = p["loader"].state_dict()
    # at an epoch's last batch the loader's `iteration` advances only when the loop asks for
    # more; a restore sets the next epoch's at once: the epoch count is compared mid-epoch
    epoch = None if loader.get("_iterator_finished") else p["loader"].iteration
    for doc in (p["sched"].scheduler.state_dict(), loader, p["seen"].state_dict(),
                {"iteration": epoch, "step": p["acc"].step}):
        h.update(rank_rows.to_bytes(doc, "d"))
    h.update(repr(random.getstate()).encode())
    h.update(np.random.get_state()[1].tobytes())
    return h.hexdigest()[:32]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--project", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, required=True)
    ap.add_argument("--hold", type=int)
    ap.add_argument("--async", dest="async_save", action="store_true")
    a = ap.parse_args()
    import ckptstore
    from ckptstore.accelerate import load_state, save_state

    torch.set_num_threads(1)
    p = build(a.project)
    acc = p["acc"]
    mgr = ckptstore.CheckpointManager(a.repo, keep_last=3, async_save=a.async_save)
    step = load_state(acc, mgr) or 0
    print(f"start {step}", flush=True)
    print(f"load {digest(p)}", flush=True)
    while step < a.steps:
        for x, y in p["loader"]:
            loss = torch.nn.functional.mse_loss(p["model"](x), y)
            acc.backward(loss)
            p["opt"].step()
            p["sched"].step()
            p["opt"].zero_grad()
            p["seen"].samples += len(x)
            step += 1
            print(f"loss {step} {float(loss.item()).hex()}", flush=True)
            if step % a.every == 0:
                save_state(acc, mgr, step)
                print(f"saved {step} {digest(p)}", flush=True)
            if step == a.hold:
                print(f"hold {step}", flush=True)
                time.sleep(3600)
            if step >= a.steps:
                break
    mgr.close()
    print(f"final {digest(p)}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
