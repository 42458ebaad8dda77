"""A torchtitan-style training loop over torchtitan's own components (OptimizersContainer,
LRSchedulersContainer, HuggingFaceTextDataLoader over a local JSON dataset and a
HuggingFaceTokenizer, ModelWrapper via the checkpointer) with ckptstore's checkpointer built
from its Config as torchtitan's Trainer builds it. torchtitan's Trainer itself cannot be
imported on this CPU machine (its model code imports triton), so the loop below mirrors
Trainer.train: load, then per step train_step (maybe_wait_for_staging before the optimizer
step), save(step, last_step), and close.

Run: python -m tests.torchtitan_worker --dir D --data DATA --steps N --interval K
     [--rank R --world W --init FILE] [--hold STEP] [--fsdp]
Prints `start S`, `load RANK DIGEST`, `loss STEP RANK HEX`, `saved STEP RANK DIGEST`,
`hold STEP RANK` (then sleeps: the test kills it there), `final RANK DIGEST`, `done`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

WORDS = [f"w{i}" for i in range(40)]
VOCAB = len(WORDS) + 3
SEQ, BATCH = 12, 2


def write_assets(root: Path) -> tuple[Path, Path]:
    """A local text dataset (JSON lines, torchtitan's c4_test loader) and a word-level
    tokenizer folder (tokenizer.json + tokenizer_config.json) under `root`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    data, tok = root / "data", root / "tokenizer"
    data.mkdir(parents=True, exist_ok=True)
    tok.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(0)
    with open(data / "train.json", "w") as f:
        for _ in range(120):
            text = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(3, 30)))
            f.write(json.dumps({"text": text}) + "\n")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(tok / "tokenizer.json"))
    (tok / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                           "eos_token": "</s>"}))
    return data, tok


class TrainState:
    """What torchtitan's Trainer registers as `train_state` (its state_dict/load_state_dict)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.ntokens_seen = state["ntokens_seen"]


def build(assets: Path, dump: Path, steps: int, checkpoint: Any, fsdp: bool = False,
          rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Everything the Trainer would build, and the checkpointer built from `checkpoint` (a
    CkptStoreCheckpointManager.Config) exactly as Trainer.__init__ builds it."""
    import torch
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, 24),
                                torch.nn.GELU(), torch.nn.Linear(24, VOCAB))
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[1], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt_config = default_adamw(lr=1e-2)
    opt_config.implementation = "for-loop"
    optimizers = opt_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8).build(
        optimizers=optimizers, training_steps=steps)
    tokenizer = HuggingFaceTokenizer.Config().build(tokenizer_path=str(assets / "tokenizer"))
    loader = HuggingFaceTextDataLoader.Config(dataset="c4_test",
                                              dataset_path=str(assets / "data")).build(
        dp_world_size=world, dp_rank=rank, tokenizer=tokenizer, seq_len=SEQ,
        local_batch_size=BATCH, snapshot_every_n_steps=checkpoint.interval)
    train_state = TrainState()
    checkpointer = checkpoint.build(dataloader=loader, model_parts=[model],
                                    optimizers=optimizers, lr_schedulers=schedulers,
                                    states={"train_state": train_state}, sd_adapter=None,
                                    base_folder=str(dump))
    return {"model": model, "optimizers": optimizers, "schedulers": schedulers,
            "loader": loader, "train_state": train_state, "checkpointer": checkpointer}


def digest(parts: dict[str, Any]) -> str:
    """A hash of this rank's whole training state: local shards of the parameters and
    optimizer moments, the scheduler, the dataloader position and the train state."""
    import torch
    from torch.distributed.tensor import DTensor
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ckptstore.training import rank_rows

    h = hashlib.sha256()

    def feed(state: dict[str, Any]) -> None:
        for k in sorted(state):
            v = state[k]
            h.update(k.encode())
            if isinstance(v, torch.Tensor):
                local = v.to_local() if isinstance(v, DTensor) else v
                h.update(str(local.dtype).encode())
                h.update(local.detach().contiguous().reshape(-1).view(torch.uint8)
                         .numpy().tobytes())
            else:
                h.update(repr(v).encode())

    feed(parts["model"].state_dict())
    feed(parts["optimizers"].state_dict())
    feed(parts["schedulers"].state_dict())
    h.update(rank_rows.to_bytes(StatefulDataLoader.state_dict(parts["loader"]), "loader"))
    feed(parts["train_state"].state_dict())
    return h.hexdigest()[:32]


def train(parts: dict[str, Any], steps: int, rank: int, hold: int | None = None) -> None:
    import torch

    ckpt, ts = parts["checkpointer"], parts["train_state"]
    ckpt.load(step=-1)
    print(f"start {ts.step}", flush=True)
    print(f"load {rank} {digest(parts)}", flush=True)
    data = iter(parts["loader"])
    while ts.step < steps:
        ts.step += 1
        parts["optimizers"].zero_grad()
        inputs, labels = next(data)
        logits = parts["model"](inputs["input"])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        loss.backward()
        ckpt.maybe_wait_for_staging()
        parts["optimizers"].step()
        parts["schedulers"].step()
        ts.ntokens_seen += labels.numel()
        print(f"loss {ts.step} {rank} {float(loss.item()).hex()}", flush=True)
        if ckpt.save(ts.step, last_step=ts.step == steps):
            print(f"saved {ts.step} {rank} {digest(parts)}", flush=True)
        if hold == ts.step:
            print(f"hold {ts.step} {rank}", flush=True)
            time.sleep(3600)
    ckpt.close()
    print(f"final {rank} {digest(parts)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--assets", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--interval", type=int, required=True)
    p.add_argument("--keep", type=int, default=0)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--init")
    p.add_argument("--hold", type=int)
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--async-mode", default="async")
    a = p.parse_args()
    import torch
    import torch.distributed as dist

    from ckptstore.torchtitan import CkptStoreCheckpointManager

    torch.set_num_threads(1)
    if a.world > 1:
        dist.init_process_group("gloo", init_method=f"file://{a.init}", rank=a.rank,
                                world_size=a.world)
    config = CkptStoreCheckpointManager.Config(enable=True, folder="checkpoint",
                                               interval=a.interval, keep_latest_k=a.keep,
                                               async_mode=a.async_mode, save_rng=True)
    parts = build(Path(a.assets), Path(a.dir), a.steps, config, fsdp=a.fsdp, rank=a.rank,
                  world=a.world)
    train(parts, a.steps, a.rank, a.hold)
    if a.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
