"""ckptstore.torchtitan: torchtitan's checkpointer contract over ckptstore, with torchtitan's
own components (tests/torchtitan_worker.py says which, and why not its Trainer): SIGKILL and
resume bit for bit on one process and on 2 FSDP2 ranks (gloo), and the policies and errors."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore.torchtitan import CkptStoreCheckpointManager
from ckptstore.training import rank_rows
from tests import torchtitan_worker as W

pytestmark = pytest.mark.slow  # minutes of subprocesses: left out of the quick loop

ROOT = Path(__file__).resolve().parents[3]
Config = CkptStoreCheckpointManager.Config


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tt-assets")
    W.write_assets(root)
    return root


@pytest.fixture(autouse=True)
def _local_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' setting: the same float sums, bit for bit
    yield
    torch.set_num_threads(threads)


def config(**kw: Any) -> Any:
    kw.setdefault("enable", True)
    kw.setdefault("interval", 2)
    kw.setdefault("initial_load_model_only", False)
    return Config(**kw)


def run_in_process(assets: Path, dump: Path, steps: int, cfg: Any) -> tuple[dict[str, Any],
                                                                             list[str]]:
    """Build and train in this process; returns the parts and the printed lines."""
    import contextlib
    import io

    parts = W.build(assets, dump, steps, cfg)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        W.train(parts, steps, 0)
    return parts, out.getvalue().split("\n")


# ---------------------------------------------------------------------------- subprocesses
def launch(assets: Path, run: Path, steps: int, interval: int, hold: int | None, *,
           rank: int = 0, world: int = 1, init: Path | None = None,
           mode: str = "async") -> subprocess.Popen[str]:
    args = [sys.executable, str(ROOT / "tests" / "torchtitan_worker.py"), "--dir", str(run),
            "--assets", str(assets), "--steps", str(steps), "--interval", str(interval),
            "--keep", "3", "--async-mode", mode]
    if hold is not None:
        args += ["--hold", str(hold)]
    if world > 1:
        args += ["--rank", str(rank), "--world", str(world), "--init", str(init), "--fsdp"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HOME=str(run.parent / "hf"),
               PYTHONPATH=str(ROOT))
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def run_ranks(assets: Path, run: Path, steps: int, interval: int, hold: int | None,
              world: int = 1, init: Path | None = None, mode: str = "async") -> list[list[str]]:
    """Run `world` worker processes; with `hold`, SIGKILL every one of them once all have
    reached it (they sleep there), else wait for them to finish. Lines per rank."""
    procs = [launch(assets, run, steps, interval, hold, rank=r, world=world, init=init,
                    mode=mode) for r in range(world)]
    lines: list[list[str]] = [[] for _ in procs]
    for r, proc in enumerate(procs):
        assert proc.stdout is not None
        for line in proc.stdout:
            lines[r].append(line.strip())
            if hold is not None and line.startswith(f"hold {hold} "):
                break
    for proc in procs:
        if hold is not None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=120)
    for r, proc in enumerate(procs):
        err = proc.stderr.read()[-3000:] if proc.stderr else ""
        for pipe in (proc.stdout, proc.stderr):  # (their ends in this process)
            if pipe is not None:
                pipe.close()
        if hold is not None:
            assert proc.returncode == -signal.SIGKILL, (r, proc.returncode, err)
            assert lines[r][-1].startswith(f"hold {hold} "), (r, lines[r][-3:], err)
        else:
            assert proc.returncode == 0 and lines[r][-1] == "done", (r, proc.returncode, err)
    return lines


def parse(lines: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"loss": {}, "saved": {}, "start": None, "load": None, "final": None}
    for line in lines:
        p = line.split()
        if not p:
            continue
        if p[0] == "loss":
            out["loss"][int(p[1])] = p[3]
        elif p[0] == "saved":
            out["saved"][int(p[1])] = p[3]
        elif p[0] == "start":
            out["start"] = int(p[1])
        elif p[0] in ("load", "final"):
            out[p[0]] = p[2]
    return out


def test_sigkill_and_resume_single_process_is_bit_exact(assets: Path, tmp_path: Path) -> None:
    """Killed (SIGKILL) between synchronous saves, then right after an async save was handed
    off (its write may still be in flight); each restart restores exactly what was saved,
    and the losses and the final state are bit for bit those of an uninterrupted run."""
    steps = 8
    _parts, ref_lines = run_in_process(assets, tmp_path / "ref", steps,
                                       config(interval=2, keep_latest_k=3, async_mode="async",
                                              save_rng=True))
    ref = parse(ref_lines)
    assert sorted(ref["loss"]) == list(range(1, steps + 1))
    run = tmp_path / "run"
    first = parse(run_ranks(assets, run, steps, 2, hold=5, mode="disabled")[0])
    assert first["start"] == 0 and sorted(first["saved"]) == [2, 4]
    second = parse(run_ranks(assets, run, steps, 2, hold=6)[0])
    assert second["start"] == 4 and second["load"] == first["saved"][4]
    third = parse(run_ranks(assets, run, steps, 2, hold=None)[0])
    assert third["start"] in (4, 6)  # the async save of 6 may or may not have committed
    assert third["load"] == {**first["saved"], **second["saved"]}[third["start"]]
    for got in (first, second, third):
        for step, loss in got["loss"].items():
            assert loss == ref["loss"][step], (step, loss, ref["loss"][step])
        for step, d in got["saved"].items():
            assert d == ref["saved"][step], step
    assert third["final"] == ref["final"]
    assert ckptstore.CheckpointManager(run / "checkpoint").steps() == [4, 6, 8]  # keep 3


def test_fsdp2_two_ranks_sigkill_and_resume_is_bit_exact(assets: Path, tmp_path: Path) -> None:
    """2 ranks, FSDP2 (fully_shard on a gloo CPU mesh), per-rank data: killed after the
    (synchronous) save of step 4, resumed on 2 new ranks saving asynchronously: each rank's
    parameters and moments (its local shards), scheduler, dataloader position, train state
    and RNG come back bit for bit, and step 5 is redone with the very losses of the killed
    run."""
    run = tmp_path / "run"
    killed = [parse(x) for x in run_ranks(assets, run, 6, 2, hold=5, world=2,
                                          init=tmp_path / "pg1", mode="disabled")]
    resumed = [parse(x) for x in run_ranks(assets, run, 6, 2, hold=None, world=2,
                                           init=tmp_path / "pg2")]
    assert killed[0]["saved"][4] != killed[1]["saved"][4]  # the ranks' states differ
    for k, r in zip(killed, resumed):
        assert r["start"] == 4 and r["load"] == k["saved"][4]
        assert r["loss"][5] == k["loss"][5]
    assert killed[0]["loss"][5] != killed[1]["loss"][5]  # each rank its own batch
    # the checkpoint holds global tensors: one process reads the whole model
    whole = ckptstore.CheckpointStore(run / "checkpoint").load("step-6")
    assert whole["model"]["1.weight"].shape == (24, 16)
    assert whole["optimizer"]["state.1.weight.exp_avg"].shape == (24, 16)
    rows = whole["dataloader"]["rows"]
    assert rows.shape[0] == 2
    docs = [rank_rows.from_bytes(bytes(rows[i].numpy().tobytes())) for i in range(2)]
    assert [d["dp_rank"] for d in docs] == [0, 1]
    assert docs[0]["state"] != docs[1]["state"]


# ---------------------------------------------------------------------------- in process
def no_bytes(value: Any, path: str = "") -> None:
    """No bytes anywhere in a loaded checkpoint tree (a pickle would be bytes)."""
    assert not isinstance(value, (bytes, bytearray)), path
    if isinstance(value, dict):
        for k, v in value.items():
            no_bytes(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            no_bytes(v, f"{path}.{i}")


def test_checkpoint_contents_retention_and_no_pickle(assets: Path, tmp_path: Path) -> None:
    parts, _lines = run_in_process(assets, tmp_path / "dump", 6,
                                   config(interval=2, keep_latest_k=2))
    folder = tmp_path / "dump" / "checkpoint"
    assert ckptstore.CheckpointManager(folder).steps() == [4, 6]
    for f in folder.rglob("*"):
        if f.is_file():
            rel = f.relative_to(folder).as_posix()
            assert rel == "ckptstore.json" or rel.split("/")[0] in (
                "blobs", "checkpoints", "locks"), rel
    saved = ckptstore.CheckpointStore(folder).load("step-6")
    no_bytes(saved)
    assert set(saved) == {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}
    assert saved["lr_scheduler"] == {"last_epoch": 6}
    dl = rank_rows.from_bytes(bytes(saved["dataloader"]["rows"][0].numpy().tobytes()))
    assert dl["dp_world_size"] == 1 and dl["state"]["dataset_state"]["sample_idx"] > 0
    ts = rank_rows.from_bytes(bytes(saved["train_state"]["rows"][0].numpy().tobytes()))
    assert ts == {"step": 6, "ntokens_seen": 6 * W.SEQ * W.BATCH}
    assert torch.equal(saved["model"]["3.bias"], parts["model"][3].bias.detach())


def test_load_step_exclude_and_missing_states(assets: Path, tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    run_in_process(assets, dump, 4, config(interval=2))
    fresh = W.build(assets, dump, 4, config())
    with pytest.raises(ckptstore.CheckpointNotFoundError, match="step-3"):
        fresh["checkpointer"].load(step=3)
    assert fresh["checkpointer"].load(step=2)
    assert fresh["train_state"].step == 2
    fresh["checkpointer"].close()

    # the dataloader excluded: the loader starts afresh, the rest is restored
    part = W.build(assets, dump, 4, config(exclude_from_loading=["dataloader"]))
    assert part["checkpointer"].load()
    assert part["train_state"].step == 4
    assert part["loader"].state_dict() == W.build(assets, tmp_path / "other", 4, config())[
        "loader"].state_dict()
    part["checkpointer"].close()

    # a state the checkpoint lacks is named
    extra = W.build(assets, dump, 4, config())
    extra["checkpointer"].states["ema"] = W.TrainState()
    with pytest.raises(ckptstore.KeyMismatchError, match="'ema'"):
        extra["checkpointer"].load()
    with pytest.raises(ValueError, match="exclude_from_loading: 'nope'"):
        W.build(assets, dump, 4, config(exclude_from_loading=["nope"]))


def test_model_of_another_shape_is_refused(assets: Path, tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    run_in_process(assets, dump, 2, config(interval=2))
    parts = W.build(assets, dump, 2, config())
    parts["checkpointer"].states["model"].model[0].add_module("extra", torch.nn.Linear(2, 2))
    parts["checkpointer"].states["model"].cached_state_dict = parts[
        "checkpointer"].states["model"]._get_state_dict()
    with pytest.raises(ckptstore.KeyMismatchError, match="lacks 2 tensors of the model"):
        parts["checkpointer"].load()


def test_last_model_only_export_is_skipped_on_resume(assets: Path, tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    run_in_process(assets, dump, 4, config(interval=2, last_save_model_only=True,
                                           export_dtype="bfloat16"))
    repo = ckptstore.CheckpointStore(dump / "checkpoint")
    last = repo.load("step-4")
    assert set(last) == {"model"} and last["model"]["1.weight"].dtype == torch.bfloat16
    assert repo.manifest("step-4").metadata["torchtitan"]["model_only"] is True
    parts = W.build(assets, dump, 4, config())
    assert parts["checkpointer"].load()
    assert parts["train_state"].step == 2  # the newest full checkpoint


def test_seed_checkpoint_loads_model_only(assets: Path, tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    seed = W.build(assets, dump, 4, config())
    with torch.no_grad():
        seed["model"][1].weight.add_(1.0)
    assert seed["checkpointer"].save(0, last_step=True)
    seed["checkpointer"].close()
    parts = W.build(assets, dump, 4, config())
    assert not torch.equal(parts["model"][1].weight, seed["model"][1].weight)
    assert parts["checkpointer"].load()
    assert torch.equal(parts["model"][1].weight, seed["model"][1].weight)
    assert parts["train_state"].step == 0


def test_tiers_initial_load_and_load_only(assets: Path, tmp_path: Path) -> None:
    near, far = tmp_path / "near", tmp_path / "far"
    parts, _ = run_in_process(assets, tmp_path / "dump", 6, config(
        tiers=[str(near), str(far)], tier_every=[1, 2], tier_keep_latest_k=[2, 0]))
    assert ckptstore.CheckpointManager(near).steps() == [4, 6]
    on_far = ckptstore.CheckpointManager(far).steps()
    assert on_far and set(on_far) < {2, 4, 6}
    # a new run restores from the far tier alone (the node lost its disk)
    again = W.build(assets, tmp_path / "dump2", 6, config(tiers=[str(far)]))
    assert again["checkpointer"].load()
    assert again["train_state"].step == on_far[-1]
    again["checkpointer"].close()
    # an empty folder starts from initial_load_path's latest, model only
    fresh = W.build(assets, tmp_path / "dump3", 6, config(
        initial_load_path=str(near), initial_load_model_only=True, load_only=True))
    assert fresh["checkpointer"].load()
    assert fresh["train_state"].step == 0
    assert torch.equal(fresh["model"][3].weight, parts["model"][3].weight)
    assert not fresh["checkpointer"].save(2)  # load_only never saves
    assert not (tmp_path / "dump3" / "checkpoint" / "checkpoints").exists() or not list(
        (tmp_path / "dump3" / "checkpoint" / "checkpoints").iterdir())
    with pytest.raises(ckptstore.RepositoryNotFoundError):
        W.build(assets, tmp_path / "dump4", 6, config(
            initial_load_path=str(tmp_path / "nothing")))["checkpointer"].load()


def test_pickled_or_foreign_dataloader_state_is_refused(assets: Path, tmp_path: Path) -> None:
    from torchtitan.components.dataloader import BaseDataLoader

    class PickleLoader(BaseDataLoader):  # type: ignore[misc]
        def __init__(self, value: Any) -> None:
            self.value = value

        def __iter__(self) -> Any:
            return iter([])

        def state_dict(self) -> dict[str, Any]:
            return {"rank_0": self.value}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.value = state["rank_0"]

    parts = W.build(assets, tmp_path / "dump", 4, config())
    ckpt = parts["checkpointer"]
    ckpt.states["dataloader"] = PickleLoader(pickle.dumps({"pos": 3}))
    with pytest.raises(ckptstore.UnsupportedTypeError, match="dataloader.state.rank_0.*pickle"):
        ckpt.save(2)
    ckpt.states["dataloader"] = PickleLoader(object())
    with pytest.raises(ckptstore.UnsupportedTypeError, match="dataloader.state.rank_0: cannot"):
        ckpt.save(2)
    ckpt.states["dataloader"] = PickleLoader({"pos": (3, np.int64(4))})
    assert ckpt.save(2)
    ckpt.states["dataloader"].value = None
    assert ckpt.load()
    assert ckpt.states["dataloader"].value == {"pos": (3, np.int64(4))}
    assert ckptstore.CheckpointManager(tmp_path / "dump" / "checkpoint").steps() == [2]


def test_config_refuses_what_is_not_supported() -> None:
    with pytest.raises(ValueError, match="async_mode"):
        config(async_mode="async_with_pinned_mem")
    with pytest.raises(ValueError, match="safetensors"):
        config(last_save_in_hf=True, last_save_model_only=True)
    with pytest.raises(ValueError, match="one value per tier"):
        config(tiers=["/a", "/b"], tier_every=[1])
    with pytest.raises(ValueError, match="tier_keep_latest_k must hold non-negative"):
        config(tiers=["/a"], tier_keep_latest_k=[-1])
    with pytest.raises(ValueError, match="keep_every"):
        config(keep_every=-2)
    with pytest.raises(ValueError, match="export_dtype"):
        config(export_dtype="int8")
    with pytest.raises(ValueError, match="tiers must be non-empty"):
        config(tiers=[""])
    assert config().last_save_model_only is False  # a full last checkpoint by default
    disabled = Config(enable=False).build(dataloader=None, model_parts=[], optimizers=None,
                                          lr_schedulers=None, states={}, sd_adapter=None)
    assert not disabled.load() and not disabled.save(10)
    disabled.close()


def test_rank_rows_round_trip_and_errors() -> None:
    value = {"a": [1, 2.5, float("inf"), None, True, "x"], 3: (1, 2), "b": b"raw",
             "t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
             "n": np.arange(4, dtype=np.int16), "s": np.float32(1.5), rank_rows.TAG: 7}
    back = rank_rows.from_bytes(rank_rows.to_bytes(value, "v") + b"    ")
    assert back.keys() == value.keys() and back[3] == (1, 2) and back["b"] == b"raw"
    assert torch.equal(back["t"], value["t"]) and back["t"].dtype == torch.bfloat16
    assert np.array_equal(back["n"], value["n"]) and back["n"].dtype == np.int16
    assert back["s"] == np.float32(1.5) and back["a"][2] == float("inf")
    with pytest.raises(ckptstore.UnsupportedTypeError, match="v.k: holds pickled"):
        rank_rows.to_bytes({"k": pickle.dumps([1])}, "v")
    with pytest.raises(ckptstore.FormatError):
        rank_rows.from_bytes(b"{not json")
    rows = [rank_rows.to_bytes({"step": 3}, "s"), rank_rows.to_bytes({"step": 4}, "s")]
    with pytest.raises(ckptstore.UnsupportedTypeError, match="differs between the 2 ranks"):
        rank_rows.same_everywhere(rows, "state 'train_state'")
    assert rank_rows.same_everywhere([rows[0], rows[0] + b"  "], "x") == {"step": 3}


RNG_SCRIPT = """
import sys, torch, torch.distributed as dist, ckptstore
rank, init, repo = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
torch.manual_seed(rank)
mgr = ckptstore.CheckpointManager(repo)
mgr.save(1, {"rng": ckptstore.RNGState()})
expected = torch.rand(3)
mgr.restore({"rng": ckptstore.RNGState()})  # the plain RNGState, not the workaround
assert torch.equal(torch.rand(3), expected)
mgr.close()
dist.barrier()
dist.destroy_process_group()
print("ok")
"""


def test_rngstate_restores_on_every_rank(tmp_path: Path) -> None:
    """ckptstore.RNGState restored through CheckpointManager on 2 ranks. A regression test:
    rank 1 used to die with SIGSEGV in torch.set_rng_state, handed `torch_cpu[1]`, a row view
    at storage offset 5056 (torch reads the state from the storage start); rng.py now hands
    it a clone of the row (`.contiguous()` is not enough: the row already is contiguous)."""
    procs = [subprocess.Popen([sys.executable, "-c", RNG_SCRIPT, str(r), str(tmp_path / "pg"),
                               str(tmp_path / "repo")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
             for r in range(2)]
    codes, errors = [], []
    for proc in procs:
        try:
            _out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()  # rank 0 waits at the barrier for a rank that died
            _out, err = proc.communicate()
        codes.append(proc.returncode)
        errors.append(err[-500:])
    assert codes == [0, 0], (codes, errors)
