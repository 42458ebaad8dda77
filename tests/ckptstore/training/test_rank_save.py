"""The collective save planned on each rank (training/rank_save.py, pipeline/rank_planning.py):
its plan against the general planner's, and real saves on 3 gloo ranks."""

from __future__ import annotations

import json
import math
import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.format.dtypes import by_name
from ckptstore.format.manifest import SEGMENTED_VERSION
from ckptstore.format.regions import block_runs
from ckptstore.format.segment_encoding import cut, cut_counts
from ckptstore.pipeline.options import SaveOptions
from ckptstore.pipeline.planning import plan_collective
from ckptstore.pipeline.rank_planning import (
    Grid,
    Held,
    TensorGeometry,
    builder_of,
    grid,
    interior_gcds,
    replicated_owners,
)
from tests import rank_save_worker
from tests.conftest import new_bucket_uri
from tests.helpers import spawn_ranks


def _descs(shapes, shards, world):
    """Descriptions (as training/distributed._describe makes them) of tensors `shapes`, each
    whole on every rank (shards[i] None) or in the boxes shards[i][rank] ([start, stop) per
    dimension)."""
    out = []
    for rank in range(world):
        d = []
        for i, shape in enumerate(shapes):
            box = shards[i] and shards[i][rank]
            if box is None:
                runs, partial, local = block_runs((0,) * len(shape), shape), False, shape
            else:
                local = tuple(b - a for a, b in box)
                runs, partial = block_runs(tuple(a for a, _b in box), local), True
            d.append({"key": f"t{i}", "kind": "torch", "dtype": "float32", "shape": list(local),
                      "global": list(shape), "runs": [list(map(list, r)) for r in runs],
                      "partial": partial})
        out.append(d)
    return out


def _split(rng: random.Random, n: int, parts: int, even: bool) -> list[tuple[int, int]]:
    """`parts` contiguous ranges covering [0, n): torch.chunk's split, or random cuts."""
    if even:
        per = -(-n // parts)
        return [(min(n, r * per), min(n, (r + 1) * per)) for r in range(parts)]
    bounds = [0, *sorted(rng.randint(0, n) for _ in range(parts - 1)), n]
    return [(bounds[r], bounds[r + 1]) for r in range(parts)]


def _boxes(rng: random.Random, shape: tuple[int, ...], world: int
           ) -> list[tuple[tuple[int, int], ...]]:
    """Each rank's box of a tensor sharded over a mesh of `world` ranks: dim 0 split over
    the mesh (FSDP-like), or, for a 2-D tensor on a mesh of 2 x world/2, dim 0 over one mesh
    dim and dim 1 over the other (tensor parallelism beside FSDP)."""
    if len(shape) >= 2 and world % 2 == 0 and shape[1] > 1 and rng.random() < 0.5:
        rows = _split(rng, shape[0], world // 2, rng.random() < 0.5)
        cols = _split(rng, shape[1], 2, rng.random() < 0.5)
        return [(rows[r // 2], cols[r % 2], *((0, n) for n in shape[2:]))
                for r in range(world)]
    rows = _split(rng, shape[0], world, rng.random() < 0.5)
    return [(rows[r], *((0, n) for n in shape[1:])) for r in range(world)]


@pytest.mark.parametrize("seed", range(40))
def test_rank_plans_choose_the_general_planners_grid_and_cover_every_chunk_once(seed):
    """For boxes (row shards even, uneven and empty on some ranks; rows and columns on a 2-D
    mesh) and replicated tensors of every size class, the grid each rank derives from the
    agreed gcds is the one plan_collective derives from every rank's description, and the
    chunks the ranks write cover every chunk exactly once, each inside its writer's box."""
    rng = random.Random(seed)
    world = rng.choice([2, 3, 4, 6])
    options = SaveOptions(chunk_bytes=rng.choice([4096, 65536]), pack_threshold=2048)
    shapes, shards = [], []
    for _ in range(rng.randint(1, 8)):
        shape = tuple([rng.choice([0, 1, 3, 17, 64, 300])]
                      + [rng.choice([1, 5, 32]) for _ in range(rng.randint(0, 2))])
        if rng.random() < 0.3 or not shape[0]:
            shape = shape if rng.random() < 0.8 else ()
            shards.append(None)
        else:
            shards.append(_boxes(rng, shape, world))
        shapes.append(shape)
    layouts, _load = plan_collective(_descs(shapes, shards, world), options)
    f32 = by_name("float32")
    geos = [TensorGeometry(f"t{i}", f32, s, shards[i] is not None) for i, s in enumerate(shapes)]
    grids = []
    for i, (geo, lay) in enumerate(zip(geos, layouts)):
        gcds = [0] * len(shapes[i])
        for box in shards[i] or []:
            held = Held((box,), ((0,) * len(shapes[i]),))
            gcds = [math.gcd(a, b) for a, b in zip(gcds, interior_gcds(held, shapes[i]))]
        got = grid(geo, gcds, options)
        assert (got.chunk_rows, got.chunk_shape, got.packed, got.small, got.chunks) == (
            lay.chunk_rows, lay.chunk_shape, lay.packed, lay.small, len(lay.owners)), (i, lay)
        grids.append(got)
    owners = replicated_owners(geos, grids, world)
    for i, g in enumerate(grids):
        writers: dict[int, list[int]] = {c: [] for c in range(g.chunks)}
        for rank in range(world):
            mine = ([c for (j, c), r in owners.items() if j == i and r == rank]
                    if shards[i] is None else list(g.chunks_in_box(shards[i][rank])))
            for c in mine:
                writers[c].append(rank)
                if shards[i] is not None:  # a chunk lies inside the box of its writer
                    assert all(a <= lo and hi <= b for (lo, hi), (a, b)
                               in zip(g.region(c), shards[i][rank]))
        assert all(len(w) == 1 for w in writers.values()), writers


def test_segments_built_from_the_rows_of_128_ranks_are_those_a_writer_encodes(tmp_path):
    """The collective save's builders, fed every rank's rows of a small Llama-shaped model
    row-sharded over 128 simulated ranks (bench/scale/rank_plans.py `simulate`: every tensor
    in 128 chunks or more, kept as columns): the committed checkpoint reads back, each
    segment is byte for byte what encode() makes of its entries, and a rank's restore plan
    finds its chunks."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
    from scale.rank_plans import simulate

    from ckptstore.format.hashing import hash_algorithm
    from ckptstore.format.manifest import ChunkRows
    from ckptstore.format.manifest_parse import parse_manifest
    from ckptstore.format.segment_encoding import encode
    from ckptstore.format.segments import PartedRows
    from ckptstore.layout import blob_key, manifest_key, segments_in
    from ckptstore.stores import open_store

    out = simulate(str(tmp_path), "tiny", False, 128)
    assert out["committed"] and out["read_back"], out.get("commit_error")
    assert out["restore_refs"] >= out["tensors"]  # rank 64 holds rows of every tensor
    store = open_store(str(tmp_path))
    algorithm = hash_algorithm("xxh3-128")
    m = parse_manifest(store.get(manifest_key("sim")), "sim", algorithm,
                       segments_in([store], algorithm))
    start = parted = 0
    for ref in m.segment_refs():
        entries = list(m.tensors[start:start + ref.tensors])
        start += ref.tensors
        assert all(type(e.chunks) in (ChunkRows, PartedRows) for e in entries)
        encoded = encode([replace(e, chunks=tuple(e.chunks)) for e in entries], algorithm)
        assert encoded.head == store.get(blob_key(ref.digest))
        for part, data in encoded.parts:
            assert store.get(blob_key(part.digest)) == data
        parted += bool(encoded.parts)
    assert start == len(m.tensors) == out["tensors"]
    assert parted  # every rank's rows of a tensor: parted segments


def test_replicated_chunks_are_balanced_and_the_same_on_every_rank():
    f32 = by_name("float32")
    geos = [TensorGeometry(f"t{i}", f32, (1000 + i, 16), False) for i in range(10)]
    grids = [Grid(g.shape, 100, None, False, False, -(-g.shape[0] // 100)) for g in geos]
    a = replicated_owners(geos, grids, 4)
    assert a == replicated_owners(geos, grids, 4)
    loads = [0] * 4
    for (i, c), r in a.items():
        loads[r] += grids[i].chunk_bytes(c, 4)
    assert max(loads) - min(loads) <= 100 * 16 * 4  # within one chunk


def test_segment_cut_of_counts_is_the_cut_of_entries():
    from ckptstore.format.manifest import ChunkRef, TensorEntry

    ref = ChunkRef("0" * 32, 0, 4, 4, "0" * 32)
    entries = [TensorEntry(f"k{i}", "torch", by_name("float32"), (n,), 1, None, (ref,) * n)
               for i, n in enumerate([3, 70000, 1, 5000, 65000, 2] * 40)]
    assert cut(entries) == cut_counts([t.key for t in entries], [len(t.chunks) for t in entries])


def test_builders_spare_rank_0_and_spread_segments():
    assert [builder_of(s, 4) for s in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    assert builder_of(5, 1) == 0


def _spawn(fn, world, tmp_path, tag, args):
    spawn_ranks(fn, world, tmp_path, tag, args, lambda rank: f"r{rank}")


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> Path:
    """One 3-rank job running every scenario of rank_save_worker.scenarios_worker (each
    spawn costs seconds of imports); the tests below read what it left. A scenario whose
    assertions fail inside a rank fails this fixture, and so every test using it."""
    tmp = tmp_path_factory.mktemp("rank-scenarios")
    base = tmp / "repos"
    base.mkdir()
    _spawn(rank_save_worker.scenarios_worker, 3, tmp, "scenarios",
           lambda init, out: (3, init, str(base), out))
    return tmp


@pytest.mark.slow
def test_agree_gcds_on_three_ranks(scenarios):
    """agree_gcds over real ranks returned the gcd of each column (checked in the ranks)."""
    assert all((scenarios / "out-scenarios" / f"r{r}").read_text() == "ok" for r in range(3))


@pytest.mark.slow
def test_three_ranks_save_by_their_own_plans_reuse_without_reading_back(scenarios):
    """Four saves on 3 ranks: each commits a version-3 manifest that loads whole in one
    process; the 2nd and 3rd reuse the parent's chunks from each rank's memory (no rank
    reads the parent) and the cached plan (no gcd round); the 3rd writes no chunk; the 4th,
    with other rows per rank (uneven, then even), plans again."""
    root = scenarios / "repos" / "saves"
    stats = [json.loads((scenarios / "out-scenarios" / f"stats-{r}.json").read_text())
             for r in range(3)]
    for rank, per_save in enumerate(stats):
        first, second, third, fourth = per_save
        assert first["rounds"] == 1 and second["rounds"] == 0 and third["rounds"] == 0, rank
        assert fourth["rounds"] == 1, rank  # new rows: the cached plan is not used
        assert second["reads"] == [] and third["reads"] == [], (rank, per_save)
        assert third["written"] == 0, (rank, third)
    assert sum(s[1]["reused"] for s in stats) > 0  # rep, bias, step unchanged at step 2
    assert sum(s[0]["written"] for s in stats) > 3  # every rank wrote at step 1
    repo = CheckpointStore(root, create=False)
    t = rank_save_worker.truth()
    for step, extra in ((1, 0.0), (3, 1.0), (4, 2.0)):
        manifest = repo.manifest(f"step-{step}")
        assert manifest.version == SEGMENTED_VERSION
        state = repo.load(f"step-{step}")
        assert torch.equal(state["model"]["emb"], t["emb"] + extra)
        assert torch.equal(state["model"]["rep"], t["rep"])
        assert torch.equal(state["model"]["bias"], t["bias"])
        assert state["model"]["none"].shape == (0, 4)
        assert torch.equal(state["optim"]["step"], t["step"]) and state["note"] == "plain"
        assert repo.verify(f"step-{step}").ok
    assert (repo.manifest("step-2").segment_refs() == repo.manifest("step-3").segment_refs())
    part = repo.load("step-3", keys=["model.emb"])
    assert torch.equal(part["model"]["emb"], t["emb"] + 1.0)
    repo.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gap", "differ", "planfail"])
def test_shards_that_leave_rows_unheld_or_disagree_commit_nothing(scenarios, mode):
    """Rows no rank holds, copies that differ, or a rank whose plan fails after the
    agreement: every rank raised the same error (checked in the ranks) and nothing was
    committed (with "planfail" the next save went through on the same group)."""
    names = [c.name for c in CheckpointStore(scenarios / "repos" / mode, create=False).list()]
    assert names == (["step-2"] if mode == "planfail" else [])


@pytest.mark.slow
def test_a_save_by_rank_plans_replicates_whole_to_a_far_tier(scenarios):
    """Segments built by several ranks are blobs like any other: the far tier received every
    one of them, and the far copy alone loads and verifies (the third save wrote nothing:
    checked in the ranks)."""
    repo = CheckpointStore(scenarios / "repos" / "far", create=False)
    assert [c.name for c in repo.list()] == ["step-1", "step-2", "step-3"]
    t = rank_save_worker.truth()
    for step, extra in ((1, 0.0), (3, 1.0)):
        state = repo.load(f"step-{step}")
        assert torch.equal(state["model"]["emb"], t["emb"] + extra)
        assert torch.equal(state["model"]["rep"], t["rep"])
        assert repo.verify(f"step-{step}").ok
        assert repo.manifest(f"step-{step}").version == SEGMENTED_VERSION
    repo.close()


@pytest.mark.slow
def test_hsdp_copies_of_a_shard_share_its_writing(tmp_path):
    """On a 2 x 2 mesh (Replicate, Shard(0)) two ranks hold each row range: every chunk is
    written once in total, by both copies in turn, and the checkpoint loads whole. Strided
    shards on the same mesh (each rank two row ranges) save by rank plans, load whole, and
    restore into strided DTensors (checked in the ranks)."""
    root = tmp_path / "repo"
    _spawn(rank_save_worker.hsdp_worker, 4, tmp_path, "hsdp",
           lambda init, out: (4, init, str(root), out))
    stats = [json.loads((tmp_path / "out-hsdp" / f"stats-{r}.json").read_text())
             for r in range(4)]
    repo = CheckpointStore(root, create=False)
    manifest = repo.manifest("step-1")
    assert manifest.version == SEGMENTED_VERSION
    chunks = sum(len(t.chunks) for t in manifest.tensors)
    assert sum(s["written"] for s in stats) == chunks
    by_copy = [sum(s["written"] for s in stats if s["coordinate"][0] == k) for k in (0, 1)]
    assert min(by_copy) >= chunks // 4, by_copy  # both copies write their share
    state = repo.load("step-1")
    for k, v in rank_save_worker.hsdp_truth().items():
        assert torch.equal(state["model"][k], v), k
    assert repo.verify("step-1").ok
    # strided shards (two row ranges far apart per rank): planned by every rank, whole
    assert all(s["strided_by_rank_plans"] for s in stats)
    state = repo.load("step-2")
    for k, v in rank_save_worker.hsdp_truth().items():
        assert torch.equal(state["model"][k], v), k
    assert repo.verify("step-2").ok
    repo.close()


@pytest.mark.slow
def test_rank_plans_on_a_real_s3_server(tmp_path, seaweedfs_endpoint):
    """The same protocol against SeaweedFS: segments put by builders, the root created
    create-only by rank 0, and nothing rewritten by the second save."""
    uri = new_bucket_uri(seaweedfs_endpoint)
    _spawn(rank_save_worker.s3_worker, 3, tmp_path, "s3",
           lambda init, out: (3, init, uri, seaweedfs_endpoint, out))
    repo = CheckpointStore(uri, endpoint_url=seaweedfs_endpoint, create=False)
    t = rank_save_worker.truth()
    state = repo.load("step-2")
    assert torch.equal(state["model"]["emb"], t["emb"])
    assert torch.equal(state["optim"]["step"], t["step"])
    assert repo.verify("step-2").ok
    assert repo.manifest("step-2").segment_refs() == repo.manifest("step-1").segment_refs()
    repo.close()
