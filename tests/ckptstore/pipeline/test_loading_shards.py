"""Row shards: loading only some rows into a Shard reads only the chunks they need."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckptstore import CheckpointStore, KeyMismatchError, Shard, UnsupportedTypeError


def test_load_rows_into_shards_reads_only_needed_chunks(tmp_path):
    repo = CheckpointStore(tmp_path / "r", chunk_bytes=4000)  # 10 rows of 100 fp32 per chunk
    full = torch.randn(95, 100)
    repo.save("s", {"w": full, "n": np.arange(95 * 3).reshape(95, 3)})
    for start, stop in [(0, 10), (13, 47), (90, 95), (40, 41), (0, 95)]:
        dest = Shard(torch.zeros(stop - start, 100), start, (95, 100))
        ndest = Shard(np.zeros((stop - start, 3), dtype=np.int64), start, (95, 3))
        out = repo.load("s", into={"w": dest, "n": ndest})
        assert out["w"] is dest
        assert torch.equal(dest.data, full[start:stop])
        assert np.array_equal(ndest.data, np.arange(95 * 3).reshape(95, 3)[start:stop])


def test_shard_reads_only_overlapping_chunks(tmp_path):
    repo = CheckpointStore(tmp_path / "r", chunk_bytes=4000)
    repo.save("s", {"w": torch.randn(100, 100)})
    from ckptstore.pipeline.loading import load_state
    from ckptstore.pipeline.reader import CheckpointReader

    reader = CheckpointReader(repo.store)
    load_state(reader, repo.manifest("s"), into={"w": Shard(torch.zeros(10, 100), 20, (100, 100))})
    assert reader.bytes_read == 4000  # exactly one chunk


def test_shard_mismatches_are_refused(tmp_path):
    repo = CheckpointStore(tmp_path / "r")
    repo.save("s", {"w": torch.randn(10, 4)})
    with pytest.raises(KeyMismatchError):
        repo.load("s", into={"w": Shard(torch.zeros(5, 4), 0, (11, 4))})
    with pytest.raises(UnsupportedTypeError):
        Shard(torch.zeros(5, 4), 8, (10, 4))


def test_partial_shard_needs_a_multi_rank_save(tmp_path):
    repo = CheckpointStore(tmp_path / "r")
    with pytest.raises(TypeError, match="CheckpointManager"):
        repo.save("s", {"w": Shard(torch.zeros(5, 4), 0, (10, 4))})
    repo.save("whole", {"w": Shard(torch.ones(10, 4), 0, (10, 4))})  # covers it all: fine
    assert torch.equal(repo.load("whole")["w"], torch.ones(10, 4))
