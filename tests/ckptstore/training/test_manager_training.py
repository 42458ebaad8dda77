"""A real model and AdamW: save mid-training, restore into fresh objects, train on, and get the
same losses bit for bit as a run that never stopped."""

from __future__ import annotations

import torch

from ckptstore import CheckpointStore


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 16), torch.nn.Flatten(), torch.nn.Linear(16 * 4, 32),
        torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 50))
    model[5].weight = torch.nn.Parameter(torch.randn(50, 32) * 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 50, (8, 4), generator=g)
    y = torch.randint(0, 50, (8,), generator=g)
    return x, y


def train(model, opt, sched, steps):
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def test_resume_is_bit_exact(tmp_path):
    model, opt, sched = make()
    reference = train(model, opt, sched, range(10))

    model, opt, sched = make()
    first = train(model, opt, sched, range(5))
    repo = CheckpointStore(tmp_path / "run")
    repo.save("step-5", {"model": model.state_dict(), "optim": opt.state_dict(),
                         "sched": sched.state_dict(), "rng": torch.get_rng_state()},
              metadata={"step": 5})

    model2, opt2, sched2 = make(seed=123)  # different init: everything must come from disk
    state = repo.load("step-5")
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optim"])
    sched2.load_state_dict(state["sched"])
    torch.set_rng_state(state["rng"])
    assert isinstance(next(iter(state["optim"]["state"])), int)  # int keys survive
    rest = train(model2, opt2, sched2, range(5, 10))
    assert first + rest == reference


def test_load_into_state_dict_then_train(tmp_path):
    model, opt, sched = make()
    train(model, opt, sched, range(3))
    repo = CheckpointStore(tmp_path / "run")
    repo.save("s", {"model": model.state_dict()})
    model2, opt2, sched2 = make(seed=7)
    repo.load("s", into={"model": model2.state_dict()})
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k
