"""`ckpt export` to Hugging Face-style sharded safetensors and to a plain zarr v3 group, read
back with the safetensors and zarr libraries alone (no ckptstore on the reading side)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from safetensors import safe_open

from ckptstore import CheckpointStore
from ckptstore.cli import main
from ckptstore.tools.exports import INDEX_NAME, parse_size, plan_shards
from tests import dist_worker
from tests.ckptstore.training.test_distributed import run as run_ranks


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(300, 64, generator=g)
    return {
        "model": {"emb.weight": emb, "head.weight": emb,  # tied
                  "layers": [{"w": torch.randn(128, 64, generator=g),
                              "b": torch.randn(64, generator=g)} for _ in range(4)],
                  "bf": torch.randn(33, 7, generator=g).to(torch.bfloat16),
                  "scalar": torch.tensor(3.5)},
        "np": np.arange(50, dtype=np.int32).reshape(5, 10),
        "step": 7, "note": "hello", "blob": b"\x00\x01",
    }


@pytest.fixture
def repo(tmp_path: Path) -> CheckpointStore:
    r = CheckpointStore(tmp_path / "repo", chunk_bytes=16 * 1024)
    r.save("s1", _state(), metadata={"step": 7})
    return r


def _flat(state: dict) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}

    def walk(obj: object, path: tuple) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, (*path, k))
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                walk(v, (*path, i))
        elif isinstance(obj, (torch.Tensor, np.ndarray)):
            out[".".join(map(str, path))] = obj
    walk(state, ())
    return out


def _read_shards(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    index = json.loads((folder / INDEX_NAME).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / name), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 - not a dict
                assert index["weight_map"][k] == name
                tensors[k] = f.get_tensor(k)
    return index, tensors


def test_parse_size_and_plan() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("100kb") == 100_000
    assert parse_size("1024") == 1024
    for bad in ("", "5XB", "-1GB", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert plan_shards([("a", 6), ("b", 5), ("c", 20), ("d", 1)], 10) == [
        ["a"], ["b"], ["c"], ["d"]]
    assert plan_shards([("a", 3), ("b", 3), ("c", 3), ("d", 3)], 10) == [["a", "b", "c"], ["d"]]


def test_sharded_safetensors_round_trip(repo: CheckpointStore, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hf"
    rc = main(["--json", "export", str(tmp_path / "repo"), "s1", str(out),
               "--format", "safetensors", "--max-shard-size", "40KB"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    doc = json.loads(cap.out)
    index, tensors = _read_shards(out)
    expected = _flat(_state())
    # the tied head is written once (as save_pretrained does) and named in the index
    assert doc["tied"] == {"model.head.weight": "model.emb.weight"}
    assert json.loads(index["metadata"]["ckptstore.tied"]) == doc["tied"]
    del expected["model.head.weight"]
    assert set(tensors) == set(expected)
    for k, v in expected.items():
        want = torch.from_numpy(v) if isinstance(v, np.ndarray) else v
        assert torch.equal(tensors[k], want), k
    shard_files = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shard_files) == doc["files"] > 2
    assert shard_files[0] == f"model-00001-of-{len(shard_files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in tensors.values())
    for f in shard_files:  # no shard is over the limit unless one tensor alone is
        with safe_open(str(out / f), framework="pt") as sf:
            sizes = [sf.get_tensor(k).numel() * sf.get_tensor(k).element_size()
                     for k in sf.keys()]  # noqa: SIM118
        assert sum(sizes) <= 40_000 or len(sizes) == 1
    assert sorted(doc["skipped"]) == ["blob", "note", "step"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf")]  # no temp left


def test_single_file_when_out_ends_in_safetensors(repo: CheckpointStore, tmp_path: Path) -> None:
    out = tmp_path / "m.safetensors"
    assert main(["--json", "export", str(tmp_path / "repo"), "s1", str(out)]) == 0
    with safe_open(str(out), framework="pt") as f:
        assert torch.equal(f.get_tensor("model.layers.2.w"), _state()["model"]["layers"][2]["w"])
    # a size limit that the one file cannot meet is refused before anything is written
    small = tmp_path / "small.safetensors"
    assert main(["export", str(tmp_path / "repo"), "s1", str(small),
                 "--max-shard-size", "1KB"]) == 2
    assert not small.exists()


def test_zarr_export_opens_without_ckptstore(repo: CheckpointStore, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ckpt.zarr"
    assert main(["--json", "export", str(tmp_path / "repo"), "s1", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == ["blob"]
    code = f"""
import json, sys, zarr, numpy as np
assert not any(m.startswith("ckptstore") for m in sys.modules)
g = zarr.open_group({str(out)!r}, mode="r")
res = {{name: np.asarray(a[...]).tolist() for name, a in g.arrays()}}
res["__attrs__"] = dict(g.attrs)
res["__bf__"] = dict(g["model.bf"].attrs)
res["__chunks__"] = list(g["model.emb.weight"].chunks)
assert not any(m.startswith("ckptstore") for m in sys.modules)
print(json.dumps(res))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    st = _state()
    assert np.array_equal(np.array(res["model.layers.1.w"], dtype=np.float32),
                          st["model"]["layers"][1]["w"].numpy())
    assert np.array_equal(np.array(res["np"]), st["np"])
    assert res["model.scalar"] == 3.5
    bits = np.array(res["model.bf"], dtype=np.uint16)
    assert torch.equal(torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16),
                       st["model"]["bf"])
    assert res["__bf__"]["ckptstore"]["dtype"] == "bfloat16"
    assert res["__chunks__"][0] < 300  # the checkpoint's row blocks, not one big chunk
    attrs = res["__attrs__"]["ckptstore"]
    assert attrs["checkpoint"] == "s1" and attrs["metadata"] == {"step": 7}
    assert attrs["values"]["step"] == 7 and attrs["values"]["note"] == "hello"
    assert "blob" not in res and "blob" not in attrs["values"]  # bytes: left out, reported


def test_export_of_a_checkpoint_saved_on_two_ranks(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    run_ranks(dist_worker.save_worker, 2, tmp_path, root, "plain", "save")
    out = tmp_path / "hf"
    assert main(["--json", "export", str(root), "step-3", str(out), "--format", "safetensors",
                 "--max-shard-size", "64KiB"]) == 0
    _index, tensors = _read_shards(out)
    truth = dist_worker.truth()
    assert torch.equal(tensors["model.rep"], truth["rep"])
    assert torch.equal(tensors["emb"], truth["emb"])
    assert torch.equal(tensors["dt"], truth["dt"])
    zarr.open_group(str(tmp_path / "z.zarr"), mode="w")  # OUT exists: refused, then --force
    assert main(["export", str(root), "step-3", str(tmp_path / "z.zarr")]) == 2
    assert main(["export", str(root), "step-3", str(tmp_path / "z.zarr"), "--force"]) == 0
    z = zarr.open_group(str(tmp_path / "z.zarr"), mode="r")
    assert np.array_equal(z["emb"][...], truth["emb"].numpy())


def test_exported_files_honour_the_umask(repo: CheckpointStore, tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        one = tmp_path / "one.safetensors"
        assert main(["export", str(tmp_path / "repo"), "s1", str(one)]) == 0
        shards = tmp_path / "shards"
        assert main(["export", str(tmp_path / "repo"), "s1", str(shards), "--format",
                     "safetensors"]) == 0
        os.umask(0o077)
        private = tmp_path / "private.pt"
        assert main(["export", str(tmp_path / "repo"), "s1", str(private)]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(one.stat().st_mode) == 0o644
    assert stat.S_IMODE(shards.stat().st_mode) == 0o755
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in shards.iterdir())
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
