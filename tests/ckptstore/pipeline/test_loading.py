"""pipeline/loading.py: a load is planned (every check before anything is allocated or read),
then executed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckptstore import CheckpointStore, KeyMismatchError
from ckptstore.pipeline.loading import plan_load


def test_one_tensor_saved_under_two_keys_loads_into_both_destinations(tmp_path):
    w = torch.randn(4, 3)
    repo = CheckpointStore(tmp_path / "r")
    repo.save("a", {"x": w, "y": w, "z": torch.ones(2)})  # stored once, referenced twice
    a, b = torch.zeros(4, 3), torch.zeros(4, 3)
    out = repo.load("a", into={"x": a, "y": b, "z": torch.zeros(2)})  # used to raise
    assert torch.equal(a, w) and torch.equal(b, w)  # both destinations filled
    assert out["x"] is a and out["y"] is a  # one object, as saved: tied stays tied
    same = torch.zeros(4, 3)
    repo.load("a", into={"x": same, "y": same, "z": torch.zeros(2)})
    assert torch.equal(same, w)
    with pytest.raises(KeyMismatchError, match="y"):  # the second destination must fit too
        repo.load("a", into={"x": torch.zeros(4, 3), "y": torch.zeros(5, 3),
                             "z": torch.zeros(2)})


def test_the_plan_checks_everything_before_reading(tmp_path):
    repo = CheckpointStore(tmp_path / "r")
    repo.save("a", {"w": torch.ones(8, 8), "b": torch.ones(8)})
    manifest = repo.manifest("a")
    plan = plan_load(manifest, keys=["w"])
    assert [manifest.tensors[i].key for i in plan.selected] == ["w"]
    with pytest.raises(KeyMismatchError, match="no key"):
        plan_load(manifest, keys=["nope"])
    with pytest.raises(KeyMismatchError, match="not in the checkpoint"):
        plan_load(manifest, into={"w": torch.zeros(8, 8), "extra": torch.zeros(1)})
    with pytest.raises(Exception, match="more than the 10"):
        plan_load(manifest, max_alloc_bytes=10)


def test_bytes_are_never_loaded_into_an_array_and_the_array_keeps_its_values(tmp_path):
    # a uint8 array at a bytes key passed the checks, and the load returned the array's old
    # contents as the bytes
    repo = CheckpointStore(tmp_path / "r")
    repo.save("s", {"blob": b"hello", "x": np.arange(3)})
    dest = {"blob": np.zeros(5, np.uint8), "x": np.zeros(3, dtype=np.int64)}
    with pytest.raises(KeyMismatchError, match="blob: the checkpoint holds bytes"):
        repo.load("s", into=dest)
    assert not dest["blob"].any() and not dest["x"].any()  # nothing read into either
    out = repo.load("s", into={"x": dest["x"]})
    assert out["blob"] == b"hello" and out["x"] is dest["x"] and dest["x"].tolist() == [0, 1, 2]


def test_a_torch_tensor_loads_into_a_numpy_array_of_its_dtype(tmp_path):
    repo = CheckpointStore(tmp_path / "r")
    repo.save("s", {"a": torch.arange(10, dtype=torch.float32),
                    "b": torch.ones(2, dtype=torch.bfloat16)})
    dest = np.zeros(10, np.float32)
    out = repo.load("s", into={"a": dest}, strict=False)
    assert out["a"] is dest and dest.tolist() == list(range(10))
    with pytest.raises(KeyMismatchError, match="b: destination dtype"):
        repo.load("s", into={"b": np.zeros(2, np.uint16)}, strict=False)
