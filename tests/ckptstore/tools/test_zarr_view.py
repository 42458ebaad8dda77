"""zarr-python reads checkpoints through ckptstore.zarr_store, lazily and verified."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

import ckptstore
from ckptstore import CheckpointStore, IntegrityError
from ckptstore.layout import blob_key


@pytest.mark.parametrize("compression", [None, "zstd", "blosc"])
def test_zarr_reads_slices_equal_to_the_original(store_uri, store_options, compression):
    repo = CheckpointStore(store_uri, chunk_bytes=4096, compression=compression, **store_options)
    w = torch.randn(101, 7)  # 28-byte rows, 146 rows per chunk... forced smaller below
    state = {
        "model": {"w": w, "bias": torch.arange(5, dtype=torch.int32), "bf": w.to(torch.bfloat16)},
        "np3d": np.arange(5 * 4 * 3, dtype=np.float64).reshape(5, 4, 3),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "big": torch.arange(10_000, dtype=torch.float32).reshape(1000, 10),
    }
    repo.save("z", state)
    group = zarr.open_group(store=ckptstore.zarr_store(repo, "z"), mode="r")
    assert group.attrs["ckptstore"]["checkpoint"] == "z"
    assert np.array_equal(group["model.w"][10:20], w[10:20].numpy())
    assert np.array_equal(group["model.w"][:], w.numpy())
    assert np.array_equal(group["model.bias"][:], np.arange(5, dtype=np.int32))
    bits = group["model.bf"][:]
    assert bits.dtype == np.uint16
    assert torch.equal(torch.from_numpy(bits).view(torch.bfloat16), w.to(torch.bfloat16))
    assert group["model.bf"].attrs["ckptstore"]["dtype"] == "bfloat16"
    assert np.array_equal(group["np3d"][1:4, 2], state["np3d"][1:4, 2])
    assert group["scalar"][()] == 2.5
    assert group["empty"].shape == (0, 3)
    big = group["big"]
    assert big.chunks[0] < 1000  # really several row blocks
    assert np.array_equal(big[995:1000], state["big"][995:1000].numpy())  # padded last block
    assert sorted(group.array_keys()) == sorted(
        ["model.w", "model.bias", "model.bf", "np3d", "scalar", "empty", "big"])
    repo.close()


def test_zarr_view_verifies_chunks(tmp_path):
    repo = CheckpointStore(tmp_path / "r")
    repo.save("z", {"t": torch.randn(1000, 100)})
    blob = repo.manifest("z").tensors[0].chunks[0].blob
    path = tmp_path / "r" / blob_key(blob)
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    group = zarr.open_group(store=ckptstore.zarr_store(repo, "z"), mode="r")
    with pytest.raises(IntegrityError):
        group["t"][:5]
    path.unlink()
    with pytest.raises(IntegrityError, match="missing"):
        group["t"][:5]


def test_zarr_view_is_read_only(tmp_path):
    repo = CheckpointStore(tmp_path / "r")
    repo.save("z", {"t": torch.zeros(3)})
    store = ckptstore.zarr_store(repo, "z")
    group = zarr.open_group(store=store, mode="r")
    with pytest.raises(PermissionError):
        group["t"][0] = 1.0


def test_every_key_is_an_array_of_its_own(tmp_path):
    # the same tensor object under two keys came out once; a key '_' took the root key's
    # name and a key 'zarr.json' the group's metadata name
    repo = CheckpointStore(tmp_path / "r")
    emb = torch.arange(6.0)
    repo.save("s", {"emb": emb, "head": emb, "": torch.ones(2), "_": torch.full((2,), 7.0),
                    "zarr.json": torch.zeros(3)})
    group = zarr.open_group(store=ckptstore.zarr_store(repo, "s"), mode="r")
    arrays = dict(group.arrays())
    assert sorted(arrays) == ["%5F", "_", "emb", "head", "zarr%2Ejson"]
    assert arrays["head"][:].tolist() == emb.tolist() == arrays["emb"][:].tolist()
    assert arrays["_"][:].tolist() == [1.0, 1.0] and arrays["%5F"][:].tolist() == [7.0, 7.0]
    assert arrays["zarr%2Ejson"][:].tolist() == [0.0, 0.0, 0.0]
