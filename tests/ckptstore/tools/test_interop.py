"""Export to / import from safetensors, weights-only torch files and DCP directories."""

from __future__ import annotations

import os
import uuid
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptstore import CheckpointStore, FormatError
from ckptstore.tools.interop import (
    TrustRequiredError,
    detect_format,
    export_checkpoint,
    import_checkpoint,
)
from tests.helpers import assert_same

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32,
          torch.uint32, torch.int64, torch.uint64, torch.float16, torch.bfloat16, torch.float32,
          torch.float64, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture
def repo():
    r = CheckpointStore(f"memory://{uuid.uuid4().hex}")
    yield r
    r.close()


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for dt in DTYPES:
        x = torch.randn(5, 3, generator=g) * 4
        out[f"t.{str(dt).removeprefix('torch.')}"] = (x > 0 if dt == torch.bool else x.to(dt))
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.zeros(0, 4)
    out["strided"] = torch.arange(20.0).reshape(4, 5).t()
    return out


def test_safetensors_roundtrip_every_dtype_tied_and_strided(repo, tmp_path: Path) -> None:
    state = {"model": tensors(), "step": 3}
    state["model"]["tied"] = state["model"]["t.float32"]
    repo.save("a", state, {"step": 3})
    out = tmp_path / "a.safetensors"
    rep = export_checkpoint(repo, "a", out)
    assert rep.format == "safetensors" and rep.skipped == ["step"]
    from safetensors.torch import load_file

    flat = load_file(str(out))
    for key, value in state["model"].items():
        assert_same(flat[f"model.{key}"], value.contiguous(), key)
    imp = import_checkpoint(repo, "b", out)
    assert imp.format == "safetensors" and imp.tensors == len(state["model"])
    back = repo.load("b")
    assert set(back) == {f"model.{k}" for k in state["model"]}
    for key, value in state["model"].items():
        assert_same(back[f"model.{key}"], value.contiguous(), key)
    meta = repo.manifest("b").metadata
    assert meta["step"] == 3 and meta["imported_from"]["format"] == "safetensors"


def test_safetensors_refuses_complex128_and_existing_files(repo, tmp_path: Path) -> None:
    repo.save("c", {"z": torch.zeros(2, dtype=torch.complex128), "x": torch.ones(2)})
    with pytest.raises(FormatError, match="complex128"):
        export_checkpoint(repo, "c", tmp_path / "c.safetensors")
    assert not list(tmp_path.iterdir())  # no partial or temp file left
    export_checkpoint(repo, "c", tmp_path / "x.safetensors", keys=["x"])
    with pytest.raises(FileExistsError):
        export_checkpoint(repo, "c", tmp_path / "x.safetensors", keys=["x"])
    export_checkpoint(repo, "c", tmp_path / "x.safetensors", keys=["x"], overwrite=True)


def test_torch_export_is_weights_only_loadable_and_reimports(repo, tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    sd = model.state_dict()
    state = {"model": sd, "optim": {"state": {0: {"exp_avg": torch.ones(3)}},
                                    "param_groups": [{"lr": 0.1, "params": [0]}]},
             "np": np.arange(4, dtype=np.int32), "npf": np.float32(1.5), "step": 7,
             "pair": (1, "x"), "blob": b"\x00\x01"}
    repo.save("a", state)
    rep = export_checkpoint(repo, "a", tmp_path / "a.pt")
    assert sorted(rep.converted) == ["np", "npf"]
    loaded = torch.load(tmp_path / "a.pt", weights_only=True)
    assert isinstance(loaded["model"], OrderedDict)
    assert torch.equal(loaded["model"]["weight"], sd["weight"])
    assert loaded["optim"]["state"][0]["exp_avg"].tolist() == [1, 1, 1]
    assert loaded["pair"] == (1, "x") and loaded["blob"] == b"\x00\x01"
    assert loaded["npf"] == 1.5 and loaded["np"].dtype == torch.int32
    import_checkpoint(repo, "b", tmp_path / "a.pt")
    assert_same(repo.load("b")["model"], repo.load("a")["model"])
    assert repo.load("b")["optim"]["state"][0]["exp_avg"].tolist() == [1, 1, 1]


def test_a_0d_numpy_array_keeps_its_shape_in_every_export(repo, tmp_path: Path) -> None:
    # np.ascontiguousarray makes a 0-d array 1-d: exports wrote shape (1,)
    from safetensors.torch import load_file

    repo.save("s", {"lr": np.array(2.5, dtype=np.float32), "w": torch.ones(2)})
    export_checkpoint(repo, "s", tmp_path / "s.pt")
    export_checkpoint(repo, "s", tmp_path / "s.safetensors")
    for lr in (torch.load(tmp_path / "s.pt", weights_only=True)["lr"],
               load_file(tmp_path / "s.safetensors")["lr"]):
        assert lr.shape == () and float(lr) == 2.5


def test_an_export_into_the_repositorys_own_folder_is_refused(tmp_path: Path) -> None:
    # with overwrite (--force), an OUT of <repo>/blobs replaced the repository's blobs
    repo = CheckpointStore(tmp_path / "r")
    repo.save("s", {"w": torch.ones(4)})
    for out in (tmp_path / "r" / "blobs", tmp_path / "r", tmp_path):
        with pytest.raises(ValueError, match="repository being exported"):
            export_checkpoint(repo, "s", out, fmt="safetensors", overwrite=True)
    assert repo.verify("s").ok
    repo.close()


def test_a_torch_export_refuses_keys_that_select_part_of_a_list(repo, tmp_path: Path) -> None:
    # a partial load closes lists up: layers.2 was written as layers.0
    layers = [torch.full((2,), float(i)) for i in range(3)]
    repo.save("s", {"layers": layers, "step": 3})
    with pytest.raises(ValueError, match="some elements of the list at 'layers'"):
        export_checkpoint(repo, "s", tmp_path / "part.pt", keys=["layers.2"])
    assert not (tmp_path / "part.pt").exists()
    export_checkpoint(repo, "s", tmp_path / "all.pt", keys=["layers"])
    got = torch.load(tmp_path / "all.pt", weights_only=True)["layers"]
    assert [t.tolist() for t in got] == [t.tolist() for t in layers]


def test_exports_that_cannot_be_written_say_why(repo, tmp_path: Path) -> None:
    # torch's and safetensors' own errors came out as 'ckpt: internal error'
    repo.save("s", {"w": torch.ones(2)})
    unwritable = Path("/proc/self")  # a folder in which no file can be created
    if unwritable.is_dir():
        for out in (unwritable / "x.pt", unwritable / "x.safetensors"):
            with pytest.raises(OSError, match=f"cannot write {out}"):
                export_checkpoint(repo, "s", out)
    if hasattr(torch, "float4_e2m1fn_x2"):
        repo.save("f4", {"x": torch.zeros((), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)})
        with pytest.raises(FormatError, match="0-d"):
            export_checkpoint(repo, "f4", tmp_path / "f4.safetensors")


class _Evil:
    def __reduce__(self):  # what a hostile .pt file carries
        return (os.system, ("touch /tmp/ckptstore-pwned",))


def test_torch_import_never_runs_pickled_code(repo, tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": _Evil()}, path)
    flag = Path("/tmp/ckptstore-pwned")
    flag.unlink(missing_ok=True)
    with pytest.raises(FormatError, match="never unpickles") as info:
        import_checkpoint(repo, "e", path)
    assert "weights_only" not in str(info.value)  # no advice to unpickle it after all
    assert not flag.exists()
    assert repo.names() == []
    (tmp_path / "junk.pt").write_bytes(b"garbage" * 10)
    with pytest.raises(FormatError):
        import_checkpoint(repo, "j", tmp_path / "junk.pt")


def test_dcp_import_needs_trust_then_reads_through_dcp(repo, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    sd = {"model": {"w": torch.randn(3, 4), "b": torch.zeros(4, dtype=torch.bfloat16)},
          "step": 5}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert detect_format(tmp_path / "dcp") == "dcp"
    with pytest.raises(TrustRequiredError, match="pickle"):
        import_checkpoint(repo, "d", tmp_path / "dcp")
    assert repo.names() == []
    rep = import_checkpoint(repo, "d", tmp_path / "dcp", trust_pickle=True)
    assert rep.format == "dcp" and rep.tensors == 2
    back = repo.load("d")
    assert_same(back["model"], sd["model"])
    assert back["step"] == 5


def test_format_detection_by_content(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"x": torch.ones(1)}, str(tmp_path / "weights.bin"))
    assert detect_format(tmp_path / "weights.bin") == "safetensors"
    torch.save({"x": torch.ones(1)}, tmp_path / "w.safetensors")  # misnamed
    assert detect_format(tmp_path / "w.safetensors") == "torch"
    (tmp_path / "dir").mkdir()
    with pytest.raises(FormatError, match="not a torch.distributed.checkpoint"):
        detect_format(tmp_path / "dir")
