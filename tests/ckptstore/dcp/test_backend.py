"""ckptstore as a torch.distributed.checkpoint storage backend (ckptstore.dcp): real DCP
saves and loads on one process and on gloo ranks (FSDP2 saved on 2 ranks, resharded onto 3
and onto 1), async saves with both executors, create-only names, verification, no pickle
anywhere, deduplication, a SIGKILL during a save, and the interop both ways with
CheckpointStore.save / load."""

from __future__ import annotations

import copy
import io
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import ckptstore
import ckptstore.dcp as cdcp
from ckptstore import (
    CheckpointExistsError,
    CheckpointStore,
    FormatError,
    IntegrityError,
    InvalidNameError,
    UnsupportedTypeError,
)
from ckptstore.cli import main as ckpt_main
from ckptstore.dcp.plain import MAGIC
from tests import dcp_worker as W
from tests.helpers import assert_same, spawn_ranks

# DCP warns on every call made without a process group, even with no_dist=True
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
REPO_ROOT = Path(__file__).resolve().parents[3]
PICKLE_HEADERS = tuple(bytes([0x80, p]) for p in range(2, 6))
ZIP_MAGIC = b"PK\x03\x04"


# ------------------------------------------------------------------------------ helpers
def _state(seed: int = 0, zero: bool = False) -> dict[str, Any]:
    """A state with a model, an Adam state after one step, tensors of many dtypes and
    shapes (0-d, empty, non-contiguous, several chunks) and non-tensor values of every plain
    kind."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    g = torch.Generator().manual_seed(seed + 1)
    big = torch.randn(300, 257, generator=g)
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "t": {
            "big": big,
            "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
            "f16": torch.randn(5, generator=g).half(),
            "i64": torch.arange(-50, 50, dtype=torch.int64),
            "bool": torch.rand(9, generator=g) > 0.5,
            "c64": torch.randn(4, 3, dtype=torch.complex64, generator=g),
            "u8": torch.randint(0, 255, (17,), dtype=torch.uint8, generator=g),
            "f8": torch.randn(6, 6, generator=g).to(torch.float8_e4m3fn),
            "scalar": torch.tensor(3.25),
            "empty": torch.zeros(0, 5),
            "strided": torch.randn(40, 24, generator=g).t(),  # a non-contiguous view
        },
        "values": {"step": 12, "lr": 0.25, "nan": math.nan, "inf": -math.inf,
                   "name": "run-ä", "none": None, "flag": True, "pair": (1, "b", 2.5),
                   "ints": [1, 2, 3], "raw": b"\x00\x01\xff", "nested": {"a": {"b": "c"}}},
    }
    if zero:
        _zero(state)
    return state


def _zero(obj: Any) -> None:
    """Zero every tensor of a state in place and overwrite its plain values (as a freshly
    built destination would hold), keeping structure and shapes."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, torch.Tensor):
                v.zero_()
            elif isinstance(v, (dict, list)):
                _zero(v)
            elif k != "params":
                obj[k] = None
    elif isinstance(obj, list):
        for v in obj:
            _zero(v)


def _same_state(a: Any, b: Any, path: str = "") -> None:
    """assert_same, with NaNs equal (float.hex of NaN is the same string)."""
    assert_same(a, b, path)


def assert_no_pickle(root: Path) -> None:
    """No object of the repository, and no chunk any manifest references (members of packs
    included), starts like a pickle (protocols 2-5) or a zip archive (torch.save)."""
    files = [p for p in root.rglob("*") if p.is_file()]
    assert files
    for p in files:
        head = p.read_bytes()[:4]
        assert not head.startswith(PICKLE_HEADERS), p
        assert not head.startswith(ZIP_MAGIC), p
    repo = CheckpointStore(root, create=False)
    for name in repo.names():
        for entry in repo.manifest(name).tensors:
            for c in entry.chunks:
                blob = root / "blobs" / c.blob[:2] / c.blob
                with blob.open("rb") as f:
                    f.seek(c.offset)
                    head = f.read(4)
                assert not head.startswith(PICKLE_HEADERS), (name, entry.key)
                assert not head.startswith(ZIP_MAGIC), (name, entry.key)
    repo.close()


def _repo_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _first_failure(exc: CheckpointException) -> BaseException:
    failure = exc.failures[min(exc.failures)]
    return failure[0] if isinstance(failure, tuple) else failure


# ------------------------------------------------------------------------ one process
def test_round_trip_with_dcps_own_planners(tmp_path: Path) -> None:
    """dcp.save / dcp.load with DCP's default planners and ckptstore's storage: every value
    back bit for bit, DCP's Metadata rebuilt exactly, no pickle stored."""
    root = tmp_path / "repo"
    state = _state()
    writer = cdcp.StorageWriter(root, "s1", chunk_bytes=64 << 10, metadata={"step": 12})
    saved_md = dcp_save(state, storage_writer=writer, no_dist=True)
    info = writer.last_save
    assert info is not None and info.written_bytes > 0 and info.reused_bytes == 0
    reader = cdcp.StorageReader(root)
    md = reader.read_metadata()
    assert reader.loaded == "s1"
    assert md.state_dict_metadata == saved_md.state_dict_metadata
    assert md.planner_data == saved_md.planner_data
    assert md.storage_data == saved_md.storage_data and md.version == saved_md.version
    assert md.storage_meta is not None and saved_md.storage_meta is not None
    assert md.storage_meta.save_id == saved_md.storage_meta.save_id
    assert md.storage_meta.checkpoint_id == "s1"
    dest = _state(seed=9, zero=True)
    dcp_load(dest, storage_reader=cdcp.StorageReader(root, "s1"), no_dist=True)
    _same_state(dest, state)
    assert_no_pickle(root)
    writer.close()


def test_round_trip_with_ckptstore_planners_and_helpers(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    state = _state(seed=2)
    info = cdcp.save(state, root, "h1", chunk_bytes=32 << 10)
    assert info is not None and info.name == "h1" and info.tensors > 20
    dest = _state(seed=5, zero=True)
    assert cdcp.load(dest, root) == "h1"
    _same_state(dest, state)
    # DCP's own load planner reads what ckptstore's save planner wrote, and vice versa
    dest2 = _state(seed=6, zero=True)
    dcp_load(dest2, storage_reader=cdcp.StorageReader(root, "h1"), planner=DefaultLoadPlanner(),
             no_dist=True)
    _same_state(dest2, state)
    assert_no_pickle(root)


def test_a_dcp_checkpoint_is_a_ckptstore_checkpoint(tmp_path: Path) -> None:
    """CheckpointStore.load returns plain tensors and values of the global state at DCP's
    flattened keys; ckpt ls / show / verify / export work on it."""
    root = tmp_path / "repo"
    state = _state(seed=3)
    cdcp.save(state, root, "d1", metadata={"step": 12})
    with CheckpointStore(root) as repo:
        got = repo.load("d1")
        assert repo.list()[0].metadata["step"] == 12
        assert repo.verify("d1").ok
    assert torch.equal(got["t"]["big"], state["t"]["big"])
    assert torch.equal(got["t"]["strided"], state["t"]["strided"])
    assert got["t"]["bf16"].dtype == torch.bfloat16
    assert got["values"]["pair"] == (1, "b", 2.5) and got["values"]["raw"] == b"\x00\x01\xff"
    assert got["values"]["nested"] == {"a": {"b": "c"}}
    assert math.isnan(got["values"]["nan"])
    # DCP keys are strings: the optimizer's parameter ids come back as "0", "1", ...
    assert torch.equal(got["optim"]["state"]["0"]["exp_avg"],
                       state["optim"]["state"][0]["exp_avg"])
    assert got["optim"]["param_groups"][0]["lr"] == 0.01
    assert got["optim"]["param_groups"][0]["params"] == [0, 1, 2, 3]
    for args in (["ls", str(root)], ["show", str(root), "d1"], ["verify", str(root), "d1"]):
        assert ckpt_main(args) == 0, args
    out = tmp_path / "model.safetensors"
    assert ckpt_main(["export", str(root), "d1", str(out), "--keys", "model"]) == 0
    from safetensors.torch import load_file

    exported = load_file(str(out))
    assert torch.equal(exported["0.weight"], state["model"]["0.weight"])


def test_dcp_loads_a_checkpoint_checkpointstore_saved(tmp_path: Path) -> None:
    """The other way: a checkpoint CheckpointStore.save wrote is read by dcp.load through
    the StorageReader, keys matched as DCP flattens them (nested dicts with "."; lists of
    tensors by position; int keys as strings; tuples and other lists whole)."""
    root = tmp_path / "repo"
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 9, generator=g)
    saved: dict[str, Any] = {"model": {"w": w, "b": torch.randn(9, generator=g)},
             "layers": [torch.randn(3, generator=g), {"x": torch.arange(4)}],
             "by_id": {7: torch.ones(2, 2)}, "step": 40, "betas": (0.9, 0.99),
             "names": ["a", "b"], "tied": {"a": w, "b": w}}
    with CheckpointStore(root, chunk_bytes=1024) as repo:
        repo.save("plain", saved)
    dest: dict[str, Any] = {"model": {"w": torch.zeros(64, 9), "b": torch.zeros(9)},
            "layers": [torch.zeros(3), {"x": torch.zeros(4, dtype=torch.int64)}],
            "by_id": {7: torch.zeros(2, 2)}, "step": 0, "betas": (0.0, 0.0), "names": [],
            "tied": {"a": torch.zeros(64, 9), "b": torch.zeros(64, 9)}}
    dcp_load(dest, storage_reader=cdcp.StorageReader(root), no_dist=True)
    assert torch.equal(dest["model"]["w"], w) and torch.equal(dest["tied"]["b"], w)
    assert torch.equal(dest["layers"][0], saved["layers"][0])
    assert torch.equal(dest["layers"][1]["x"], torch.arange(4))
    assert torch.equal(dest["by_id"][7], torch.ones(2, 2))
    assert dest["step"] == 40 and dest["betas"] == (0.9, 0.99) and dest["names"] == ["a", "b"]
    md = cdcp.StorageReader(root).read_metadata()
    assert "by_id.7" in md.state_dict_metadata and "layers.1.x" in md.state_dict_metadata
    # a destination asking for a key the checkpoint lacks: DCP's own error
    with pytest.raises(CheckpointException, match="Missing key"):
        dcp_load({"nope": torch.zeros(1)}, storage_reader=cdcp.StorageReader(root),
                 no_dist=True)


def test_reads_into_strided_and_converted_destinations(tmp_path: Path) -> None:
    """Destinations that are strided views or of another dtype are filled in place."""
    root = tmp_path / "repo"
    src = torch.randn(32, 48)
    cdcp.save({"a": src, "b": src.clone()}, root, "x", chunk_bytes=2048)
    base = torch.zeros(48, 32)
    dest = {"a": base.t(), "b": torch.zeros(32, 48, dtype=torch.float64)}
    cdcp.load(dest, root, "x")
    assert dest["a"].data_ptr() == base.data_ptr() and torch.equal(base.t(), src)
    assert torch.equal(dest["b"], src.double())


def test_names_are_create_only(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    cdcp.save({"w": torch.ones(4)}, root, "n1")
    manifest = (root / "checkpoints" / "n1.json").read_bytes()
    with pytest.raises(CheckpointExistsError, match="already exists"):
        cdcp.save({"w": torch.zeros(4)}, root, "n1")
    with pytest.raises(CheckpointException) as raised:  # DCP's own call: wrapped by DCP
        dcp_save({"w": torch.zeros(4)}, storage_writer=cdcp.StorageWriter(root, "n1"),
                 no_dist=True)
    assert isinstance(_first_failure(raised.value), CheckpointExistsError)
    assert (root / "checkpoints" / "n1.json").read_bytes() == manifest
    assert not list((root / "locks").glob("save-*"))  # the refused saves left no lease
    dest = {"w": torch.zeros(4)}
    cdcp.load(dest, root, "n1")
    assert torch.equal(dest["w"], torch.ones(4))
    with pytest.raises(InvalidNameError):
        cdcp.StorageWriter(root, "no/slashes")
    assert cdcp.StorageWriter.validate_checkpoint_id("step-1")
    assert not cdcp.StorageWriter.validate_checkpoint_id("a b")


def test_checkpoint_id_names_and_latest(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    writer = cdcp.StorageWriter(root)
    for step in (1, 2):
        dcp_save({"w": torch.full((3,), float(step))}, checkpoint_id=f"step-{step}",
                 storage_writer=writer, no_dist=True)
    writer.close()
    dest = {"w": torch.zeros(3)}
    assert cdcp.load(dest, root) == "step-2" and dest["w"][0] == 2.0
    dcp_load(dest, checkpoint_id="step-1", storage_reader=cdcp.StorageReader(root),
             no_dist=True)
    assert dest["w"][0] == 1.0
    with pytest.raises(ckptstore.RepositoryNotFoundError):
        cdcp.load(dest, tmp_path / "nothing-here")
    assert not (tmp_path / "nothing-here").exists()  # a reader creates no repository
    CheckpointStore(tmp_path / "empty").close()
    with pytest.raises(ckptstore.CheckpointNotFoundError, match="no checkpoints"):
        cdcp.load(dest, tmp_path / "empty")


class CachingPlanner(DefaultSavePlanner):
    """DCP's plan caching (its class-level cache is keyed by the planner's class name)."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)


def test_dcp_plan_caching(tmp_path: Path) -> None:
    """With DCP's plan caching, later saves reuse the first plan (and its chunk grids)."""
    root = tmp_path / "repo"
    state: dict[str, Any] = {"w": torch.arange(10.0), "v": 0}
    for i in range(3):
        state["w"] += 1
        state["v"] = i
        dcp_save(state, storage_writer=cdcp.StorageWriter(root, f"c{i}"),
                 planner=CachingPlanner(), no_dist=True)
    with CheckpointStore(root) as repo:
        for i in range(3):
            got = repo.load(f"c{i}")
            assert got["v"] == i and torch.equal(got["w"], torch.arange(10.0) + i + 1)


def test_a_flipped_byte_is_caught(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    state = {"big": torch.randn(128, 64), "small": torch.randn(10), "v": 3}
    cdcp.save(state, root, "c1", chunk_bytes=8192)
    with CheckpointStore(root) as repo:
        manifest = repo.manifest("c1")
    entries = {e.key: e for e in manifest.tensors}
    for key in ("big", "small"):
        c = entries[key].chunks[-1]
        blob = root / "blobs" / c.blob[:2] / c.blob
        data = bytearray(blob.read_bytes())
        data[c.offset + 5] ^= 0x10
        os.chmod(blob, 0o644)
        blob.write_bytes(bytes(data))
        dest = {"big": torch.zeros(128, 64), "small": torch.zeros(10), "v": 0}
        with pytest.raises(IntegrityError, match=key):
            cdcp.load(dest, root, "c1")
        with pytest.raises(CheckpointException) as raised:
            dcp_load(dest, storage_reader=cdcp.StorageReader(root, "c1"), no_dist=True)
        assert isinstance(_first_failure(raised.value), IntegrityError)
        data[c.offset + 5] ^= 0x10
        blob.write_bytes(bytes(data))


def test_incremental_save_writes_only_what_changed(tmp_path: Path) -> None:
    """A second save with 10% of the tensors changed writes <= 12% of the bytes."""
    root = tmp_path / "repo"
    g = torch.Generator().manual_seed(11)
    state: dict[str, Any] = {
        "model": {f"w{i}": torch.randn(512, 256, generator=g) for i in range(20)},
        "small": {f"s{i}": torch.randn(100, generator=g) for i in range(50)}, "step": 1}
    logical = sum(t.numel() * t.element_size() for d in (state["model"], state["small"])
                  for t in d.values())
    first = cdcp.save(state, root, "s1", chunk_bytes=256 << 10)
    assert first is not None and first.written_bytes >= logical
    before = _repo_bytes(root)
    for i in range(2):
        state["model"][f"w{i}"].add_(1.0)  # 10% of the big tensors
    for i in range(5):
        state["small"][f"s{i}"].add_(1.0)  # and 10% of the small ones
    state["step"] = 2
    second = cdcp.save(state, root, "s2", chunk_bytes=256 << 10)
    assert second is not None
    grown = _repo_bytes(root) - before
    assert second.written_bytes <= 0.12 * logical, (second.written_bytes, logical)
    assert grown <= 0.12 * logical, (grown, logical)
    assert second.reused_bytes >= 0.85 * logical
    with CheckpointStore(root) as repo:
        assert repo.manifest("s2").parent == "s1"
    dest: dict[str, Any] = {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "small": {k: torch.zeros_like(v) for k, v in state["small"].items()}, "step": 0}
    cdcp.load(dest, root, "s2")
    _same_state(dest, state)


class PicklingPlanner(DefaultSavePlanner):
    """A user's own planner that serializes values itself (here: torch.save, a pickle)."""

    def transform_object(self, write_item: Any, object: Any) -> Any:  # noqa: A002
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(object, buf)
            return buf
        return object


def test_a_users_pickling_planner_is_stored_opaquely(tmp_path: Path) -> None:
    """Bytes a user's planner produced are stored as they are (a bytes leaf); ckptstore's
    LoadPlanner refuses to unpickle them; DCP's default planner (the user's choice) does."""
    root = tmp_path / "repo"
    state = {"w": torch.arange(6.0), "cfg": {"lr": 0.5}}
    cdcp.save(state, root, "p1", planner=PicklingPlanner())
    with CheckpointStore(root) as repo:
        got = repo.load("p1")
    raw = got["cfg"]["lr"]
    assert isinstance(raw, bytes) and raw.startswith(ZIP_MAGIC)  # what the planner made
    md = cdcp.StorageReader(root).read_metadata()
    assert md.storage_data["values"]["cfg.lr"] == "opaque"
    dest: dict[str, Any] = {"w": torch.zeros(6), "cfg": {"lr": 0.0}}
    with pytest.raises(FormatError, match="never unpickles"):
        cdcp.load(dest, root, "p1")
    dcp_load(dest, storage_reader=cdcp.StorageReader(root, "p1"), no_dist=True)
    assert dest["cfg"]["lr"] == 0.5 and torch.equal(dest["w"], torch.arange(6.0))


def test_values_that_are_not_plain_state_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "repo"

    class Thing:
        pass

    with pytest.raises(UnsupportedTypeError, match="extra.thing"):
        cdcp.save({"w": torch.ones(2), "extra": {"thing": Thing()}}, root, "bad")
    with CheckpointStore(root) as repo:
        assert repo.names() == []
    assert not list((root / "locks").glob("save-*"))
    # a plain-value payload never looks like a pickle
    from ckptstore.dcp.plain import from_payload, payload

    data = payload({"a": (1, 2.5, None, b"x")}, "k")
    assert data.startswith(MAGIC) and from_payload(data, "k") == {"a": (1, 2.5, None, b"x")}
    with pytest.raises(FormatError):
        from_payload(MAGIC + b'{"bytes": [], "node": {"tensor": 0}}', "k")


def test_ckptstore_planners_with_dcps_own_file_system_storage(tmp_path: Path) -> None:
    """SavePlanner / LoadPlanner work with any storage: with DCP's FileSystemWriter the
    values are plain-value payloads, not pickles; LoadPlanner refuses pickled values."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

    state: dict[str, Any] = {"w": torch.arange(5.0),
                             "cfg": {"lr": 0.5, "betas": (0.9, 0.99), "raw": b"\x01"}}
    dcp_save(state, storage_writer=FileSystemWriter(str(tmp_path / "fs")),
             planner=cdcp.SavePlanner(), no_dist=True)
    dest: dict[str, Any] = {"w": torch.zeros(5), "cfg": {"lr": 0.0, "betas": None, "raw": b""}}
    dcp_load(dest, storage_reader=FileSystemReader(str(tmp_path / "fs")),
             planner=cdcp.LoadPlanner(), no_dist=True)
    assert dest["cfg"] == {"lr": 0.5, "betas": (0.9, 0.99), "raw": b"\x01"}
    assert torch.equal(dest["w"], state["w"])
    dcp_save(state, storage_writer=FileSystemWriter(str(tmp_path / "pickled")), no_dist=True)
    with pytest.raises(CheckpointException) as raised:
        dcp_load(dest, storage_reader=FileSystemReader(str(tmp_path / "pickled")),
                 planner=cdcp.LoadPlanner(), no_dist=True)
    err = _first_failure(raised.value)
    assert isinstance(err, FormatError) and "never unpickles" in str(err)


def test_async_save_in_a_thread(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    state = _state(seed=4)
    fut = cdcp.async_save(state, root, "a1", async_checkpointer_type="thread")
    fut.result()
    dest = _state(seed=8, zero=True)
    cdcp.load(dest, root, "a1")
    _same_state(dest, state)


def test_writers_pickle_as_their_arguments(tmp_path: Path) -> None:
    """What DCP's process executor sends: the constructor's arguments, no open store."""
    root = tmp_path / "repo"
    repo = CheckpointStore(root, chunk_bytes=4096)
    writer = cdcp.StorageWriter(repo, "w1", metadata={"k": 1})
    state = writer.__getstate__()
    assert state == {"location": str(root.resolve()), "name": "w1", "metadata": {"k": 1},
                     "options": {"create": False, "chunk_bytes": 4096, "compression": None,
                                 "workers": repo.save_options.workers,
                                 "max_inflight_bytes": repo.save_options.max_inflight_bytes}}
    clone = copy.deepcopy(writer)  # __getstate__ / __setstate__, as pickling does
    dcp_save({"w": torch.arange(3)}, storage_writer=clone, no_dist=True)
    clone.close()
    assert repo.exists("w1")
    assert copy.deepcopy(cdcp.StorageReader(root, "w1")).name == "w1"
    repo.close()
    with CheckpointStore("memory://dcp-pickle") as mem:
        with pytest.raises(TypeError, match="another process"):
            copy.deepcopy(cdcp.StorageWriter(mem, "m1"))


def test_tiers(tmp_path: Path) -> None:
    near, far = tmp_path / "near", tmp_path / "far"
    writer = cdcp.StorageWriter([near, far], "t1")
    dcp_save({"w": torch.arange(10.0)}, storage_writer=writer, no_dist=True)
    writer.close()  # waits for the replication to the far tier
    dest = {"w": torch.zeros(10)}
    cdcp.load(dest, far, "t1")
    assert torch.equal(dest["w"], torch.arange(10.0))


def test_s3_location(s3_uri: str, moto_endpoint: str) -> None:
    """An s3:// location with its options; the writer pickles with them (process executor)."""
    state = _state(seed=12)
    writer = cdcp.StorageWriter(s3_uri, "s3-1", endpoint_url=moto_endpoint)
    assert writer.__getstate__()["options"] == {"endpoint_url": moto_endpoint}
    clone = copy.deepcopy(writer)
    dcp_save(state, storage_writer=clone, no_dist=True)
    clone.close()
    dest = _state(seed=13, zero=True)
    assert cdcp.load(dest, s3_uri, endpoint_url=moto_endpoint) == "s3-1"
    _same_state(dest, state)


# --------------------------------------------------------------------------- many ranks
def test_fsdp2_saved_on_2_ranks_resharded_onto_3_and_1(tmp_path: Path) -> None:
    """FSDP2 model and Adam state (get_state_dict) saved by dcp.save on 2 gloo ranks,
    async_save with the thread and the process executor, loaded back on 2, resharded by
    DCP onto 3 ranks (uneven shards; Shard(1) columns into Shard(0) rows); the 3-rank
    checkpoint read by CheckpointStore.load as global tensors, loaded on one gloo rank
    (async saves with both executors there too), and the 2-rank one into a plain model on
    one process without a process group."""
    root = tmp_path / "repo"
    spawn_ranks(W.fsdp_worker, 2, tmp_path, "save",
                lambda init, out: (2, init, str(root), out, "save"), lambda r: f"dcp-{r}")
    saved = dict(np.load(tmp_path / "out-save" / "saved.npz"))
    back = dict(np.load(tmp_path / "out-save" / "async.npz"))
    assert sorted(saved) == sorted(back) and any("exp_avg_sq" in k for k in saved)
    for k in saved:
        assert np.array_equal(saved[k], back[k]), k
    spawn_ranks(W.fsdp_worker, 3, tmp_path, "reshard",
                lambda init, out: (3, init, str(root), out, "reshard"), lambda r: f"dcp-{r}")
    loaded = dict(np.load(tmp_path / "out-reshard" / "loaded.npz"))
    final = dict(np.load(tmp_path / "out-reshard" / "final.npz"))
    for k in saved:
        assert np.array_equal(saved[k], loaded[k]), k
    with CheckpointStore(root) as repo:
        assert [i.name for i in repo.list()] == ["fsdp-2", "async-thread", "async-proc",
                                                 "fsdp-3"]
        assert repo.manifest("fsdp-3").metadata["step"] == W.STEPS + 1
        got = repo.load("fsdp-3")  # global tensors, as saved by 3 ranks
        for k, v in final.items():
            parts = k.split(".")
            node: Any = got
            if parts[0] == "model":
                node = got["model"][".".join(parts[1:])]
            else:  # optim.state.<param fqn>.<name>
                node = got["optim"]["state"][".".join(parts[2:-1])][parts[-1]]
            assert np.array_equal(node.numpy(), v), k
        assert torch.equal(got["extra"]["cols"], W.cols_truth())
        assert repo.verify("fsdp-3").ok and repo.verify("async-proc").ok
    # onto one gloo rank (FSDP2 over a mesh of one), and async saves there
    spawn_ranks(W.fsdp_worker, 1, tmp_path, "one",
                lambda init, out: (1, init, str(root), out, "one"), lambda r: f"dcp-{r}")
    one = dict(np.load(tmp_path / "out-one" / "one.npz"))
    for k in final:
        assert np.array_equal(one[k], final[k]), k
    with CheckpointStore(root) as repo:
        assert repo.names().count("one-proc") == 1 and repo.exists("one-thread")
        for name in ("one-thread", "one-proc"):
            again = repo.load(name)
            assert torch.equal(again["extra"]["cols"], W.cols_truth())
            assert np.array_equal(again["model"]["0.weight"].numpy(), final["model.0.weight"])
    # onto 1 process: the 2-rank checkpoint into a plain model's state
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 7))
    cols = torch.zeros(W.COLS_SHAPE, dtype=torch.float64)
    dest: dict[str, Any] = {"model": model.state_dict(), "extra": {"cols": cols}}
    cdcp.load(dest, root, "fsdp-2", planner=cdcp.LoadPlanner(allow_partial_load=True))
    for k, v in dest["model"].items():
        assert np.array_equal(v.numpy(), saved[f"model.{k}"]), k
    assert torch.equal(dest["extra"]["cols"], W.cols_truth())
    assert_no_pickle(root)


def test_sigkill_during_a_dcp_save_leaves_no_checkpoint(tmp_path: Path) -> None:
    """kill -9 while the blobs are written, and at the last instant before the manifest is
    created: no checkpoint is visible either time, and the same name saves afterwards."""
    roots = {"blobs": tmp_path / "mid", "commit": tmp_path / "last"}
    children = {
        when: subprocess.Popen([sys.executable, "-m", "tests.dcp_worker", str(root)],
                               cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        for when, root in roots.items()}
    try:
        for when, child in children.items():
            assert child.stdout is not None
            seen = 0
            for line in child.stdout:
                seen += line.strip() == "blob"
                if (when == "blobs" and seen == 3) or line.strip() == "commit":
                    break
            else:
                err = child.stderr.read() if child.stderr is not None else ""
                pytest.fail(f"the child ended before the kill: {err}")
            assert line.strip() != "done"
            os.kill(child.pid, signal.SIGKILL)
            assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait()
            for stream in (child.stdout, child.stderr):
                if stream is not None:
                    stream.close()
    for when, root in roots.items():
        assert list((root / "blobs").rglob("*")), when  # the save was under way
        with CheckpointStore(root) as repo:
            assert repo.names() == [] and repo.latest() is None, when
        state = W.crash_state()
        cdcp.save(state, root, "victim", chunk_bytes=64 << 10)  # no leftover lease blocks it
        dest = W.crash_state()
        for t in dest["model"].values():
            t.zero_()
        dest["step"] = 0
        cdcp.load(dest, root, "victim")
        _same_state(dest, state)
