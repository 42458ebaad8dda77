"""The collective save plan and the N-D chunk grid, without processes: every chunk written
once, by a rank holding it, shares balanced; grid manifests round-trip and are validated."""

from __future__ import annotations

import math

import pytest

from ckptstore.errors import CkptStoreError, FormatError
from ckptstore.format.dtypes import DTYPES
from ckptstore.format.hashing import XXH3_128
from ckptstore.format.manifest import ChunkRef, Manifest, TensorEntry
from ckptstore.format.manifest_parse import parse_manifest
from ckptstore.format.regions import block_runs, boxes
from ckptstore.pipeline.options import SaveOptions
from ckptstore.pipeline.planning import plan_collective


def _desc(key, gshape, offset, shape, dtype="float32"):
    return {"key": key, "kind": "torch", "dtype": dtype, "shape": list(shape),
            "global": list(gshape), "runs": [list(map(list, r)) for r in
                                             block_runs(tuple(offset), tuple(shape))],
            "partial": tuple(shape) != tuple(gshape)}


def _split(n, parts, i):
    per = -(-n // parts)
    return min(n, i * per), min(n, (i + 1) * per)


def _mesh_descs(key, gshape, placements, mesh=(2, 2)):
    """Descriptions of one tensor on a 2-D mesh, placements as (tensor dim or None) per mesh
    dim, applied in order like DTensor (a dim sharded twice is split again)."""
    out = []
    for rank in range(math.prod(mesh)):
        coord = (rank // mesh[1], rank % mesh[1])
        lo, hi = [0] * len(gshape), list(gshape)
        for mdim, d in enumerate(placements):
            if d is None:
                continue
            a, b = _split(hi[d] - lo[d], mesh[mdim], coord[mdim])
            lo[d], hi[d] = lo[d] + a, lo[d] + b
        out.append(_desc(key, gshape, lo, [b - a for a, b in zip(lo, hi)]))
    return out


def _check_plan(descs_by_leaf, options):
    world = len(descs_by_leaf[0])
    descs = [[leaf[r] for leaf in descs_by_leaf] for r in range(world)]
    layouts, load = plan_collective(descs, options)
    for i, lay in enumerate(layouts):
        for c, owner in enumerate(lay.owners):
            region = lay.region(c)
            d = descs[owner][i]
            owned = boxes(tuple(tuple(tuple(x) for x in r) for r in d["runs"]))
            assert any(b.contains(region) for b in owned), (i, c, owner)
    mean = sum(load) / len(load)
    return layouts, load, max(load) / mean


def test_2x2_shard0_shard1_grid_written_once_and_balanced():
    opts = SaveOptions(chunk_bytes=4096, pack_threshold=0)
    leaves = [_mesh_descs("w", (64, 48), [0, 1]), _mesh_descs("u", (7, 5), [0, 1])]
    layouts, load, ratio = _check_plan(leaves, opts)
    assert layouts[0].chunk_shape is not None and 48 % layouts[0].chunk_shape[1] == 0
    assert sum(load) == (64 * 48 + 7 * 5) * 4  # every byte once
    assert ratio <= 1.25


def test_replicated_chunks_spread_over_holders():
    opts = SaveOptions(chunk_bytes=8192, pack_threshold=1024)
    leaves = [_mesh_descs("rep", (300, 64), [None, None]),
              _mesh_descs("half", (128, 64), [None, 1]),  # replicated over mesh dim 0
              _mesh_descs("fsdp", (120, 32), [0, 0])]
    leaves += [_mesh_descs(f"bias{i}", (16,), [None, None]) for i in range(10)]  # packed
    layouts, load, ratio = _check_plan(leaves, opts)
    assert sum(load) == (300 * 64 + 128 * 64 + 120 * 32 + 160) * 4
    assert ratio <= 1.25, load
    assert all(lay.packed for lay in layouts[3:])


def test_sharded_dims_cut_finer_for_resharding():
    opts = SaveOptions()  # 16 MiB chunks, 4 MiB minimum for resharding cuts
    (lay,), _load, _r = _check_plan([_mesh_descs("down", (4096, 8192), [0, 1])], opts)
    assert lay.chunk_shape == (512, 2048)  # 32 MiB shards (2048, 4096) cut to 4 MiB chunks
    # dim 1, which no saving rank splits, is cut too: Shard(1) on restore reads no more
    (lay,), _load, _r = _check_plan([_mesh_descs("up", (8192, 4096), [0, 0])], opts)
    assert lay.chunk_shape == (512, 2048)
    # a replicated tensor keeps its row blocks
    (lay,), _load, _r = _check_plan([_mesh_descs("rep", (8192, 4096), [None, None])], opts)
    assert lay.chunk_shape is None and lay.chunk_rows == 1024


def test_uncovered_tensor_is_refused():
    leaves = [[_desc("w", (10, 4), (0, 0), (4, 4)), _desc("w", (10, 4), (6, 0), (4, 4))]]
    with pytest.raises(CkptStoreError, match="do not cover"):
        plan_collective([[leaf[r] for leaf in leaves] for r in range(2)], SaveOptions())


def _grid_manifest(chunk_shape, n_chunks=None):
    shape = (5, 6)
    grid = [-(-n // c) for n, c in zip(shape, chunk_shape)]
    chunks = []
    for gi in range(grid[0]):
        for gj in range(grid[1]):
            rows = min(5, (gi + 1) * chunk_shape[0]) - gi * chunk_shape[0]
            cols = min(6, (gj + 1) * chunk_shape[1]) - gj * chunk_shape[1]
            d = XXH3_128.digest(bytes([gi, gj]))
            chunks.append(ChunkRef(d, 0, rows * cols * 4, rows * cols * 4, d))
    entry = TensorEntry("w", "torch", DTYPES["float32"], shape, chunk_shape[0], None,
                        tuple(chunks[:n_chunks]), chunk_shape=tuple(chunk_shape))
    return Manifest(name="g", created=1.0, metadata={}, tree={"dict": []}, tensors=(entry,))


def test_grid_manifest_round_trips_and_is_validated():
    m = _grid_manifest((2, 4))
    data = m.to_bytes()
    assert b'"chunk_shape":[2,4]' in data
    assert b'"chunk_grid":{"configuration":{"chunk_shape":[2,4]' in data
    back = parse_manifest(data)
    assert back.tensors[0] == m.tensors[0] and len(back.tensors[0].chunks) == 6
    assert back.tensors[0].chunk_region(5) == ((4, 5), (4, 6))
    with pytest.raises(FormatError, match="chunk_shape give 6"):
        parse_manifest(_grid_manifest((2, 4), n_chunks=5).to_bytes())
    # a row-block entry keeps its old form: no chunk_shape attribute at all
    row = TensorEntry("r", "numpy", DTYPES["uint8"], (3, 2), 3, None, (ChunkRef(
        XXH3_128.digest(b"x"), 0, 6, 6, XXH3_128.digest(b"x")),))
    assert "chunk_shape" not in row.to_json()["attributes"]["ckptstore"]


def test_region_reads_fill_strided_parts_exactly(tmp_path):
    """Runs with several pieces per dim (FSDP2's strided shards) read into place, from row
    blocks, counting only the chunks that overlap."""
    import numpy as np

    from ckptstore import CheckpointStore
    from ckptstore.format.regions import index_runs
    from ckptstore.pipeline.reader import CheckpointReader
    from ckptstore.pipeline.regions import RegionReads

    full = np.arange(40 * 6, dtype=np.float64).reshape(40, 6)
    repo = CheckpointStore(tmp_path / "r", chunk_bytes=4 * 6 * 8)  # 4-row chunks
    repo.save("s", {"w": full})
    entry = repo.manifest("s").tensors[0]
    assert entry.chunk_rows == 4 and len(entry.chunks) == 10
    rows = [8, 9, 10, 11, 24, 25, 26, 27]  # two 4-row runs: chunks 2 and 6 only
    cols = [1, 2, 4]  # two runs on dim 1
    runs = (index_runs(rows), index_runs(cols))
    out = np.zeros((len(rows), len(cols)))
    reader = CheckpointReader(repo.store, repo.load_options)
    regions = RegionReads(reader)
    regions.add(entry, out.reshape(-1).view(np.uint8), out.shape, runs)
    regions.run()
    np.testing.assert_array_equal(out, full[np.ix_(rows, cols)])
    assert reader.bytes_read == 2 * 4 * 6 * 8  # the two overlapping chunks, once each
    repo.close()
