"""2-rank worker of tests/ckptstore/dcp/test_pytorch_scenarios.py: the multi-rank round trips
of PyTorch's own DCP tests (test/distributed/checkpoint/test_file_system_checkpoint_cpu.py,
test_save_load_api.py), each run on the same 2 gloo ranks through ckptstore's StorageWriter /
StorageReader instead of FileSystemWriter / FileSystemReader. Written from what those tests
check, not from their code.

Each scenario raises on a mismatch; every rank writes `results-<rank>.json`, {scenario: "ok"
or its traceback}, and its report `rank-<rank>` ("ok" once all scenarios ran)."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .dist_worker import reporting

ROWS, COLS = 10, 20
VECTOR = 32


def _specs_2d() -> list[Any]:
    """The sharding plans of the resharding scenario, for a (10, 20) tensor on 2 ranks."""
    from torch.distributed._shard.sharding_spec import (
        ChunkShardingSpec,
        EnumerableShardingSpec,
        ShardMetadata,
    )

    def shard(off: int, size: int, rank: int) -> ShardMetadata:
        return ShardMetadata(shard_offsets=[off, 0], shard_sizes=[size, COLS],
                             placement=f"rank:{rank}")

    return [
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"]),
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"]),
        EnumerableShardingSpec(shards=[shard(0, 2, 0), shard(2, 1, 1), shard(3, 3, 0),
                                       shard(6, 3, 1), shard(9, 1, 0)]),
        EnumerableShardingSpec(shards=[shard(0, 8, 1), shard(8, 2, 0)]),
    ]


def _specs_1d() -> list[Any]:
    """The plans of the sharded <-> plain scenario, for a vector of VECTOR elements."""
    from torch.distributed._shard.sharding_spec import (
        ChunkShardingSpec,
        EnumerableShardingSpec,
        ShardMetadata,
    )

    def shard(off: int, size: int, rank: int) -> ShardMetadata:
        return ShardMetadata(shard_offsets=[off], shard_sizes=[size], placement=f"rank:{rank}")

    return [
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"]),
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"]),
        EnumerableShardingSpec(shards=[shard(0, 8, 1), shard(8, VECTOR - 8, 0)]),
        EnumerableShardingSpec(shards=[shard(0, 10, 0), shard(10, VECTOR - 10, 1)]),
    ]


class ShardedModule(torch.nn.Module):
    """A module holding a ShardedTensor beside ordinary parameters (its state_dict carries
    the ShardedTensor through torch's state_dict_hook)."""

    def __init__(self, spec: Any, seed: int) -> None:
        from torch.distributed._shard import sharded_tensor
        from torch.distributed._shard.sharded_tensor import state_dict_hook

        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(4, 3)
        self.sharded = sharded_tensor.rand(spec, ROWS, COLS, init_rrefs=False)
        self._register_state_dict_hook(state_dict_hook)


def _gathered(st: Any, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The whole ShardedTensor on rank 0 (None elsewhere); collective."""
    out = torch.zeros(shape) if dist.get_rank() == 0 else None
    st.gather(dst=0, out=out)
    return out


def _local(st: Any) -> list[torch.Tensor]:
    return [s.tensor.clone() for s in st.local_shards()]


# ------------------------------------------------------------------------- the scenarios
def sharded_tensor_round_trip(root: str) -> None:
    """test_read_write_shard_tensor: a module's ShardedTensor (row-chunked over 2 ranks) and
    plain parameters, saved and loaded into a new module of the same plan."""
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.checkpoint import load, save

    import ckptstore.dcp as cdcp

    spec = ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"])
    src = ShardedModule(spec, seed=1).state_dict()
    save(src, storage_writer=cdcp.StorageWriter(root, "st-round-trip"))
    dest = ShardedModule(spec, seed=2).state_dict()
    assert not all(torch.equal(a, b) for a, b in zip(_local(src["sharded"]),
                                                      _local(dest["sharded"])))
    load(dest, storage_reader=cdcp.StorageReader(root, "st-round-trip"))
    for a, b in zip(_local(src["sharded"]), _local(dest["sharded"]), strict=True):
        assert torch.equal(a, b)
    for k in ("linear.weight", "linear.bias"):
        assert torch.equal(src[k], dest[k]), k


def load_with_different_shard_plan(root: str) -> None:
    """test_load_with_different_shard_plan: every ordered pair of 4 plans (2 and 4 chunks,
    uneven enumerated shards) saved with one and loaded with the other; gathered values
    equal bit for bit (a new checkpoint name per pair: names are create-only)."""
    from torch.distributed.checkpoint import load, save

    import ckptstore.dcp as cdcp

    specs = _specs_2d()
    pairs = 0
    for i, s0 in enumerate(specs):
        for j, s1 in enumerate(specs):
            if i == j:
                continue
            src = ShardedModule(s0, seed=10 + i).state_dict()
            save(src, storage_writer=cdcp.StorageWriter(root, f"plan-{i}-{j}"))
            dest = ShardedModule(s1, seed=20 + j).state_dict()
            load(dest, storage_reader=cdcp.StorageReader(root, f"plan-{i}-{j}"))
            want = _gathered(src["sharded"], (ROWS, COLS))
            got = _gathered(dest["sharded"], (ROWS, COLS))
            if want is not None:
                assert got is not None and torch.equal(want, got), (i, j)
            pairs += 1
    assert pairs == 12


def load_rowwise_to_colwise(root: str) -> None:
    """test_load_rowwise_to_colwise (on the CPU here): rows-sharded saved, loaded into a
    column-sharded plan."""
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.checkpoint import load, save

    import ckptstore.dcp as cdcp

    rows = ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"])
    cols = ChunkShardingSpec(dim=1, placements=["rank:0", "rank:1"])
    src = ShardedModule(rows, seed=3).state_dict()
    save(src, storage_writer=cdcp.StorageWriter(root, "rows"))
    dest = ShardedModule(cols, seed=4).state_dict()
    load(dest, storage_reader=cdcp.StorageReader(root, "rows"))
    shard = dest["sharded"].local_shards()[0]
    assert list(shard.metadata.shard_sizes) == [ROWS, COLS // 2]
    want = _gathered(src["sharded"], (ROWS, COLS))
    got = _gathered(dest["sharded"], (ROWS, COLS))
    if want is not None:
        assert got is not None and torch.equal(want, got)


def save_load_bytes(root: str) -> None:
    """test_save_load_bytes: non-tensor values only (a list, a string)."""
    from torch.distributed.checkpoint import load, save

    import ckptstore.dcp as cdcp

    save({"bytes0": [1], "bytes1": "string"}, storage_writer=cdcp.StorageWriter(root, "bytes"))
    dest: dict[str, Any] = {"bytes0": [2], "bytes1": "other"}
    load(dest, storage_reader=cdcp.StorageReader(root, "bytes"))
    assert dest == {"bytes0": [1], "bytes1": "string"}, dest


def switch_sharded_and_plain(root: str) -> None:
    """test_switch_between_sharded_tensor_to_tensor: for every pair of 4 plans, a
    ShardedTensor saved and loaded into a plain tensor, and a plain (replicated) tensor
    saved and loaded into a ShardedTensor."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed.checkpoint import load, save

    import ckptstore.dcp as cdcp

    specs = _specs_1d()
    for i, save_spec in enumerate(specs):
        for j, load_spec in enumerate(specs):
            torch.manual_seed(100 + 4 * i + j + dist.get_rank())
            src = {"sharded": sharded_tensor.rand(save_spec, VECTOR, init_rrefs=False),
                   "replicated": torch.rand(VECTOR)}
            dist.broadcast(src["replicated"], src=0)
            save(src, storage_writer=cdcp.StorageWriter(root, f"switch-{i}-{j}"))
            dest = {"sharded": torch.zeros(VECTOR),
                    "replicated": sharded_tensor.zeros(load_spec, VECTOR, init_rrefs=False)}
            load(dest, storage_reader=cdcp.StorageReader(root, f"switch-{i}-{j}"))
            saved_sharded = _gathered(src["sharded"], (VECTOR,))
            loaded_replicated = _gathered(dest["replicated"], (VECTOR,))
            if dist.get_rank() == 0:
                assert saved_sharded is not None and loaded_replicated is not None
                assert torch.equal(saved_sharded, dest["sharded"]), (i, j)
                assert torch.equal(src["replicated"], loaded_replicated), (i, j)
            else:  # every rank loaded the whole plain tensor
                assert not torch.equal(dest["sharded"], torch.zeros(VECTOR)), (i, j)


def checkpoint_id_names_the_checkpoint(root: str) -> None:
    """test_save_load_api.test_auto_detect, with the storage given: an FSDP2 model's
    state_dict saved and loaded with `checkpoint_id=` naming checkpoints "first" and
    "second" of one repository (one writer and one reader reused); a checkpoint_id our
    storage cannot take ("abc://abc.abc") is refused on every rank before anything runs."""
    from torch.distributed.checkpoint import load, save
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckptstore.dcp as cdcp
    from ckptstore import CheckpointStore, InvalidNameError

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    writer, reader = cdcp.StorageWriter(root), cdcp.StorageReader(root)
    want = {k: v.full_tensor() for k, v in model.state_dict().items()}
    for name in ("first", "second"):
        save(model.state_dict(), checkpoint_id=name, storage_writer=writer)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        sd = model.state_dict()
        load(sd, checkpoint_id=name, storage_reader=reader)
        model.load_state_dict(sd)
        for k, v in model.state_dict().items():
            assert torch.equal(v.full_tensor(), want[k]), (name, k)
    assert reader.loaded == "second"
    for call in (lambda: save(model.state_dict(), checkpoint_id="abc://abc.abc",
                              storage_writer=writer),
                 lambda: load(model.state_dict(), checkpoint_id="abc://abc.abc",
                              storage_reader=reader)):
        try:
            call()
        except InvalidNameError:
            pass
        else:
            raise AssertionError("abc://abc.abc was accepted as a checkpoint name")
    writer.close()
    reader.close()
    dist.barrier()
    with CheckpointStore(root, create=False) as repo:
        assert {"first", "second"} <= set(repo.names()) and not repo.exists("abc")


SCENARIOS: dict[str, Callable[[str], None]] = {
    f.__name__: f for f in (sharded_tensor_round_trip, load_with_different_shard_plan,
                            load_rowwise_to_colwise, save_load_bytes, switch_sharded_and_plain,
                            checkpoint_id_names_the_checkpoint)}


def scenarios_worker(rank: int, world: int, init_file: str, root: str, out_dir: str) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    results: dict[str, str] = {}
    with reporting(os.path.join(out_dir, f"rank-{rank}")):
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=90))
        for name, fn in SCENARIOS.items():
            try:
                fn(os.path.join(root, name))
                dist.barrier()
                results[name] = "ok"
            except (Exception, CheckpointException):  # DCP's is a BaseException
                results[name] = traceback.format_exc()
        with open(os.path.join(out_dir, f"results-{rank}.json"), "w") as f:
            json.dump(results, f)
