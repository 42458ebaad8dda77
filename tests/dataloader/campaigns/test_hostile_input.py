"""Hostile and absurd input (reliability issue, item 7): resume states and dataset indexes.

Every bad input is refused with a clear error naming the field -- StateMismatchError (a
ValueError) for states, FormatError for index bytes -- quickly (the slow-risk cases carry a
wall-clock bound) and without large allocations; valid inputs behave as before.
"""

from __future__ import annotations

import copy
import json
import random
import tracemalloc
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dataloader
from ckptstore.errors import FormatError, IntegrityError
from ckptstore.stores import open_store
from ckptstore.toolkit import canonical_json, digest
from dataloader import StateMismatchError
from dataloader.format import INDEX_KEY, MAX_INDEX_BYTES, DatasetIndex
from dataloader.order import MAX_WORLD_SIZE, advance, complement, merge_intervals, rank_plan
from tests.dataloader.conftest import ids_of

# -- helpers ------------------------------------------------------------------------------


def _uri() -> str:
    return f"memory://hostile-{uuid.uuid4().hex}"


def _ds(uri: str, **kw: Any) -> dataloader.StreamingDataset:
    kw.setdefault("shuffle", True)
    kw.setdefault("seed", 7)
    kw.setdefault("shuffle_window", 64)
    kw.setdefault("fields", ["id"])
    return dataloader.StreamingDataset(uri, **kw)


def _bounded(
    fn: Callable[[], Any], exc: type[BaseException], match: str, max_mib: int = 64
) -> BaseException:
    """Run `fn`, expect `exc` matching `match`; also check the peak traced allocation and
    that the message stays short (a hostile value must not be echoed whole)."""
    tracemalloc.start()
    try:
        with pytest.raises(exc, match=match) as info:
            fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < max_mib << 20, f"peak allocation {peak / 2**20:.0f} MiB"
    assert len(str(info.value)) < 600, str(info.value)[:200]
    return info.value


def _doc(uri: str) -> dict[str, Any]:
    return json.loads(open_store(uri).get(INDEX_KEY))


def _forge(doc: dict[str, Any]) -> bytes:
    """Index bytes for `doc` with a fingerprint that matches its content: what an attacker who
    edits dataset.json writes (the fingerprint is a self-digest, not a signature)."""
    body = {k: v for k, v in doc.items() if k != "fingerprint"}
    return canonical_json({**body, "fingerprint": DatasetIndex.compute_fingerprint(body)})


def _copy_store(src_uri: str) -> str:
    src, uri = open_store(src_uri), _uri()
    dst = open_store(uri)
    for info in src.list():
        dst.put(info.key, src.get(info.key))
    return uri


def _forged_uri(src_uri: str, mutate: Callable[[dict[str, Any]], Any]) -> str:
    uri = _copy_store(src_uri)
    doc = _doc(src_uri)
    mutate(doc)
    open_store(uri).put(INDEX_KEY, _forge(doc))
    return uri


def _state(uri: str, **kw: Any) -> dict[str, Any]:
    """A real mid-epoch loader state (two batches of 8 delivered)."""
    loader = dataloader.StreamingLoader(_ds(uri, **kw), batch_size=8, num_workers=0)
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict()
    it.close()
    return json.loads(json.dumps(state))


# -- resume state -------------------------------------------------------------------------

# (field, value, message fragment); the state of the 523-sample dataset has epoch 0,
# world_size 1, consumed 16, base [].
BAD_STATE_FIELDS = [
    ("world_size", 10**9, "'world_size'"),
    ("world_size", MAX_WORLD_SIZE + 1, "'world_size'"),
    ("world_size", 0, "'world_size'"),
    ("world_size", 2.0, "'world_size'"),
    ("world_size", True, "'world_size'"),
    ("consumed", 10**30, "'consumed'"),
    ("consumed", 524, "'consumed'"),  # more than the 523 items an epoch holds
    ("consumed", 16.0, "'consumed'"),
    ("consumed", 16.7, "'consumed'"),
    ("consumed", True, "'consumed'"),
    ("consumed", -1, "'consumed'"),
    ("epoch", 0.0, "'epoch'"),
    ("epoch", 2**70, "'epoch'"),
    ("epoch", None, "'epoch'"),
    ("base", [[0.5, 3.7]], "'base'"),
    ("base", [[0, 2**70]], "'base'"),
    ("base", [[-(2**70), 3]], "'base'"),
    ("base", [[0, 524]], "'base'"),  # past the end of the epoch
    ("base", [[5, 3]], "'base'"),
    ("base", [[0, 5], [3, 8]], "'base'"),  # overlapping
    ("base", [[6, 8], [0, 2]], "'base'"),  # unsorted
    ("base", [[0, 5], [5, 8]], "'base'"),  # touching: not as state_dict writes it
    ("base", [0, 5], "'base'"),  # flat
    ("base", [[0, 5, 6]], "'base'"),
    ("base", [[True, 5]], "'base'"),
    ("base", "0-5", "'base'"),
    ("base", {"0": 5}, "'base'"),
    ("rank", 1, "'rank'"),  # world_size is 1
    ("rank", -1, "'rank'"),
    ("rank", 0.0, "'rank'"),
    ("rank", None, "'rank'"),
    ("version", True, "version"),
    ("version", 1.0, "version"),
    ("balance", "spread", "balance"),
    ("balance", ["none"], "balance"),
    ("batch_size", 2.5, "'batch_size'"),
    ("batch_size", 0, "'batch_size'"),
    ("fingerprint", 123, "another dataset"),
    ("kind", "mixed", "kind"),
    ("order", [1, 2], "order"),
    ("order", None, "order"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("field,value,match", BAD_STATE_FIELDS)
def test_bad_state_field_is_refused(small_uri, field, value, match):
    state = _state(small_uri)
    bad = {**state, field: value}
    loader = dataloader.StreamingLoader(_ds(small_uri), batch_size=8, num_workers=0)
    _bounded(lambda: loader.load_state_dict(bad), StateMismatchError, match)
    # the dataset alone refuses it too, and a refused state changes nothing
    ds = _ds(small_uri)
    before = ds.state_dict()
    _bounded(lambda: ds.load_state_dict(bad), StateMismatchError, match)
    assert ds.state_dict() == before
    assert isinstance(StateMismatchError("x"), ValueError)


@pytest.mark.timeout(10)
def test_world_size_1e9_is_refused_fast(small_uri):
    """Used to fold the consumed items of 10**9 ranks one by one (hours)."""
    state = {**_state(small_uri), "world_size": 10**9, "rank": 0}
    loader = dataloader.StreamingLoader(_ds(small_uri), batch_size=8)
    _bounded(lambda: loader.load_state_dict(state), StateMismatchError, "'world_size'")


def test_consumed_1e30_is_refused_not_silently_empty(small_uri):
    state = {**_state(small_uri), "consumed": 10**30}
    loader = dataloader.StreamingLoader(_ds(small_uri), batch_size=8)
    with pytest.raises(StateMismatchError, match=r"'consumed'.*epoch 0.*\[0, 523\]"):
        loader.load_state_dict(state)


def test_float_base_is_refused_not_truncated(small_uri):
    state = {**_state(small_uri), "base": [[0.5, 3.7]]}
    with pytest.raises(StateMismatchError, match=r"'base'.*int"):
        _ds(small_uri).load_state_dict(state)


def test_base_2_70_is_refused_not_overflow(small_uri):
    state = {**_state(small_uri), "base": [[0, 2**70]]}
    with pytest.raises(StateMismatchError, match="'base'"):
        _ds(small_uri).load_state_dict(state)


@pytest.mark.parametrize(
    "key,value",
    [("seed", 7.0), ("shuffle", 1), ("window_blocks", 4.0), ("mode", "tokens"), ("extra", 1)],
)
def test_order_options_compare_with_exact_types(small_uri, key, value):
    """`True == 1` and `4.0 == 4` in Python; a state's ordering options must match exactly."""
    state = _state(small_uri)
    if key == "window_blocks":
        value = float(state["order"]["window_blocks"])
    bad = {**state, "order": {**state["order"], key: value}}
    with pytest.raises(StateMismatchError, match=f"ordering options.*{key}"):
        _ds(small_uri).load_state_dict(bad)


def test_state_must_be_a_mapping(small_uri):
    for bad in (None, [("format", "x")], "state", 7):
        with pytest.raises(StateMismatchError, match="not a dataloader state"):
            _ds(small_uri).load_state_dict(bad)  # type: ignore[arg-type]


def test_valid_states_still_resume_exactly(small_uri):
    """The validation accepts what state_dict writes: numpy ints, tuples, a full epoch."""
    full = ids_of(dataloader.StreamingLoader(_ds(small_uri), batch_size=8))
    state = _state(small_uri)
    state["consumed"] = np.int64(state["consumed"])
    loader = dataloader.StreamingLoader(_ds(small_uri), batch_size=8)
    loader.load_state_dict(state)
    assert ids_of(loader) == full[16:]
    done = {**_state(small_uri), "consumed": 523}  # every item consumed: a finished pass
    loader.load_state_dict(done)
    assert ids_of(loader) == []


@pytest.mark.timeout(30)
def test_largest_world_size_resumes_fast_and_exactly(small_uri):
    """A state of MAX_WORLD_SIZE ranks is valid: its topology change is folded in O(ranks)."""
    full = ids_of(dataloader.StreamingLoader(_ds(small_uri), batch_size=64))
    base = [[0, 100], [200, 300]]
    state = {**_state(small_uri), "world_size": MAX_WORLD_SIZE, "base": base, "consumed": 1}
    loader = dataloader.StreamingLoader(_ds(small_uri), batch_size=64)
    loader.load_state_dict(state)
    # 323 items were left; each of the first 323 of 2**20 ranks took one: nothing is left
    assert ids_of(loader) == []
    state["consumed"] = 0
    loader.load_state_dict(state)
    assert ids_of(loader) == full[100:200] + full[300:]


def test_dataset_topology_arguments_are_checked(small_uri):
    for kw, match in [
        ({"rank": 0, "world_size": 10**9}, "world_size"),
        ({"rank": 0, "world_size": 2.0}, "world_size"),
        ({"rank": True, "world_size": 2}, "rank"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"rank": 0.5, "world_size": 2}, "rank"),
    ]:
        with pytest.raises(ValueError, match=match):
            _ds(small_uri, **kw)
    with pytest.raises(ValueError, match="epoch"):
        _ds(small_uri).set_epoch(True)  # type: ignore[arg-type]


# -- tokens and mixing states -------------------------------------------------------------


@pytest.fixture(scope="module")
def tokens_uri() -> str:
    uri = _uri()
    docs = [np.arange(i % 50 + 1, dtype=np.int32) for i in range(200)]
    dataloader.write_dataset(uri, ({"tokens": d} for d in docs), rows_per_chunk=20)
    return uri


def test_token_state_is_validated(tokens_uri):
    ds = dataloader.TokenDataset(tokens_uri, 16, shuffle=True, shuffle_window=60)
    state = ds.state_dict()
    total = ds.epoch_order(0).total
    ds.load_state_dict({**state, "consumed": total})  # a finished pass is valid
    with pytest.raises(StateMismatchError, match="'consumed'"):
        ds.load_state_dict({**state, "consumed": total + 1})
    for key, value in [("seq_len", 16.0), ("pad_id", False), ("remainder", "pad")]:
        bad = {**state, "order": {**state["order"], key: value}}
        with pytest.raises(StateMismatchError, match=key):
            ds.load_state_dict(bad)


def test_token_arguments_are_checked(tokens_uri):
    for kw, match in [
        ({"seq_len": 16.5}, "seq_len"),
        ({"seq_len": True}, "seq_len"),
        ({"seq_len": 16, "pad_id": 1.5}, "pad_id"),
        ({"seq_len": 16, "pad_id": 2**40}, "pad_id"),  # does not fit the int32 tokens
    ]:
        with pytest.raises(ValueError, match=match):
            dataloader.TokenDataset(tokens_uri, **kw)


@pytest.fixture(scope="module")
def mix_sources() -> tuple[str, str]:
    a, b = _uri(), _uri()
    dataloader.write_dataset(a, ({"id": i} for i in range(100)), rows_per_chunk=16)
    dataloader.write_dataset(b, ({"id": 1000 + i} for i in range(300)), rows_per_chunk=16)
    return a, b


def _mixer(a: str, b: str) -> dataloader.MixedLoader:
    return dataloader.MixedLoader(
        [dataloader.StreamingDataset(a, seed=1), dataloader.StreamingDataset(b, seed=2)],
        [0.25, 0.75],
        8,
        seed=1,
        num_workers=0,
    )


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "change,match",
    [
        (lambda s: s.update(seed=True), "seed"),
        (lambda s: s.update(seed=1.0), "seed"),
        (lambda s: s.update(weights="ab"), "weights"),
        (lambda s: s.update(weights=[1.0]), "weights"),
        (lambda s: s.update(weights=[0.25, float("nan")]), "weights"),
        (lambda s: s.update(weights=[True, 0.75]), "weights"),
        (lambda s: s.update(position=2.5), "position"),
        (lambda s: s.update(position=True), "position"),
        (lambda s: s.update(position=-1), "position"),
        (lambda s: s.update(position=2**70), "position"),
        (lambda s: s.update(sources="x"), "sources"),
        (lambda s: s.update(sources=s["sources"][:1]), "sources"),
        (lambda s: s["sources"][1].update(consumed=10**30), "source 1.*'consumed'"),
        (lambda s: s["sources"][1].update(world_size=10**9), "source 1.*'world_size'"),
        (lambda s: s.update(version=True), "version"),
    ],
)
def test_bad_mixed_state_is_refused_and_changes_nothing(mix_sources, change, match):
    m = _mixer(*mix_sources)
    it = iter(m)
    next(it)
    next(it)
    state = json.loads(json.dumps(m.state_dict()))
    it.close()
    target = _mixer(*mix_sources)
    before = target.state_dict()
    bad = copy.deepcopy(state)
    change(bad)
    _bounded(lambda: target.load_state_dict(bad), StateMismatchError, match)
    assert target.state_dict() == before
    target.load_state_dict(state)  # the good state still loads
    assert target.state_dict() == state


# -- interval arithmetic: the fast versions equal the reference loops ---------------------


def _ref_merge(iv: np.ndarray) -> list[list[int]]:
    iv = np.asarray(iv, dtype=np.int64).reshape(-1, 2)
    iv = iv[iv[:, 1] > iv[:, 0]]
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    out: list[list[int]] = []
    for a, b in iv.tolist():
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _ref_complement(iv: np.ndarray, total: int) -> list[list[int]]:
    out, pos = [], 0
    for a, b in _ref_merge(iv):
        a, b = min(a, total), min(b, total)
        if a > pos:
            out.append([pos, a])
        pos = max(pos, b)
    if pos < total:
        out.append([pos, total])
    return out


def _ref_advance(total: int, base: np.ndarray, world: int, balance: str, consumed: int) -> list:
    parts = [np.asarray(base, dtype=np.int64).reshape(-1, 2)]
    for r in range(world):
        plan = rank_plan(total, base, world, r, balance)
        left, done = min(consumed, plan.real), []
        for a, b in plan.segments:
            if left <= 0:
                break
            n = min(b - a, left)
            done.append((a, a + n))
            left -= n
        parts.append(np.asarray(done, dtype=np.int64).reshape(-1, 2))
    return _ref_merge(np.concatenate(parts))


_intervals = st.lists(
    st.tuples(st.integers(0, 120), st.integers(0, 30)).map(lambda t: [t[0], t[0] + t[1]]),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(
    base=_intervals,
    total=st.integers(0, 150),
    world=st.integers(1, 12),
    balance=st.sampled_from(["none", "drop", "pad"]),
    consumed=st.integers(0, 40),
)
def test_interval_arithmetic_matches_reference(base, total, world, balance, consumed):
    iv = np.asarray(base, dtype=np.int64).reshape(-1, 2)
    assert merge_intervals(iv).tolist() == _ref_merge(iv)
    assert complement(iv, total).tolist() == _ref_complement(iv, total)
    assert advance(total, iv, world, balance, consumed).tolist() == _ref_advance(
        total, iv, world, balance, consumed
    )


@pytest.mark.timeout(10)
def test_advance_is_linear_in_ranks_and_intervals():
    base = np.asarray([[i * 4, i * 4 + 2] for i in range(50_000)], dtype=np.int64)
    done = advance(400_000, base, MAX_WORLD_SIZE, "pad", 1)
    assert done[0, 0] == 0 and int((done[:, 1] - done[:, 0]).sum()) >= 100_000


# -- dataset.json: bytes ------------------------------------------------------------------


@pytest.fixture(scope="module")
def index_doc(small_uri) -> dict[str, Any]:
    return _doc(small_uri)


def _fields(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["name"]: f for f in doc["fields"]}


def _set_dtype(doc: dict[str, Any], field: str, array: str, dtype: Any) -> None:
    _fields(doc)[field]["dtype"] = dtype
    doc["arrays"][array]["dtype"] = dtype


def _no_fields(doc: dict[str, Any]) -> None:
    doc.update(fields=[], arrays={}, num_samples=2**31, rows_per_chunk=1)


def _one_giant_block(doc: dict[str, Any]) -> None:
    """2**31 samples in one block of a scalar field: one 16 GiB chunk and a 2**31-sample
    shuffle permutation, unless refused."""
    n = 2**31
    a = doc["arrays"]["id"]
    a.update(shape=[n], chunk_shape=[n], chunks_per_shard=1)
    a["shards"] = [
        {**a["shards"][0], "chunks": [a["shards"][0]["chunks"][0]], "nbytes": 8 * n + 20}
    ]
    doc.update(num_samples=n, rows_per_chunk=n, fields=[_fields(doc)["id"]], arrays={"id": a})


def _giant_fixed_chunk(doc: dict[str, Any]) -> None:
    _fields(doc)["image"]["shape"] = [65536, 65536]
    a = doc["arrays"]["image"]
    a.update(shape=[523, 65536, 65536], chunk_shape=[16, 65536, 65536])


def _deep_metadata(doc: dict[str, Any]) -> None:
    node: dict[str, Any] = {}
    doc["metadata"] = node
    for _ in range(200):
        node["x"] = {}
        node = node["x"]


def _extra_array(doc: dict[str, Any]) -> None:
    doc["arrays"]["extra"] = {**doc["arrays"]["id"], "path": "extra"}


def _rename_array(doc: dict[str, Any], old: str, new: str) -> None:
    doc["arrays"][new] = {**doc["arrays"].pop(old), "path": new}
    for f in doc["fields"]:
        f["arrays"] = {r: (new if p == old else p) for r, p in f["arrays"].items()}


BAD_INDEXES: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
    ("chunk_shape_0", lambda d: d["arrays"]["id"].update(chunk_shape=[0]), "chunk_shape"),
    ("chunk_shape_float", lambda d: d["arrays"]["id"].update(chunk_shape=[16.0]), "chunk_shape"),
    ("fixed_shape_0", lambda d: _fields(d)["image"].update(shape=[0, 3]), "shape"),
    ("no_fields_2e31_samples", _no_fields, "field"),
    ("one_giant_block", _one_giant_block, "rows_per_chunk"),
    ("giant_fixed_chunk", _giant_fixed_chunk, "chunk"),
    ("num_samples_mismatch", lambda d: d.update(num_samples=2**31), "rows"),
    ("num_samples_bool", lambda d: d.update(num_samples=True), "num_samples"),
    ("num_samples_float", lambda d: d.update(num_samples=523.0), "num_samples"),
    ("num_samples_2_70", lambda d: d.update(num_samples=2**70), "num_samples"),
    ("rows_per_chunk_0", lambda d: d.update(rows_per_chunk=0), "rows_per_chunk"),
    ("version_true", lambda d: d.update(version=True), "version"),
    ("big_endian", lambda d: _set_dtype(d, "id", "id", ">i8"), "dtype"),
    ("native_order_spelling", lambda d: _set_dtype(d, "id", "id", "=i8"), "dtype"),
    ("structured_dtype", lambda d: _set_dtype(d, "id", "id", "i8,i8"), "dtype"),
    ("list_dtype", lambda d: _set_dtype(d, "id", "id", [["a", "<i8"]]), "dtype"),
    ("object_dtype", lambda d: _set_dtype(d, "id", "id", "O"), "dtype"),
    ("long_dtype", lambda d: _set_dtype(d, "id", "id", "x" * 1_000_000), "dtype"),
    ("field_array_dtype_differ", lambda d: _fields(d)["id"].update(dtype="<f8"), "dtype"),
    ("str_not_bytes", lambda d: _set_dtype(d, "text", "text/data", "<i4"), "dtype"),
    ("offsets_int32", lambda d: d["arrays"]["tokens/offsets"].update(dtype="<u8"), "dtype"),
    ("scalar_ndim_1", lambda d: _fields(d)["id"].update(ndim=1), "ndim"),
    ("ragged_ndim_1e6", lambda d: _fields(d)["tokens"].update(ndim=10**6), "ndim"),
    ("fixed_ndim_mismatch", lambda d: _fields(d)["image"].update(ndim=3), "ndim"),
    ("unknown_key", lambda d: d["arrays"]["id"].update(extra=1), "unknown"),
    ("unknown_root_key", lambda d: d.update(comment="hi"), "unknown"),
    ("missing_compressor", lambda d: d["arrays"]["id"].pop("compressor"), "compressor"),
    ("missing_metadata", lambda d: d.pop("metadata"), "metadata"),
    ("duplicate_field", lambda d: d["fields"].append(dict(d["fields"][0])), "duplicate"),
    ("path_differs_from_key", lambda d: d["arrays"]["id"].update(path="score"), "path"),
    ("path_traversal", lambda d: _rename_array(d, "id", "../id"), "path"),
    ("unused_array", _extra_array, "not used"),
    ("shard_nbytes_tiny", lambda d: d["arrays"]["id"]["shards"][0].update(nbytes=1), "nbytes"),
    (
        "shard_nbytes_huge",
        lambda d: d["arrays"]["id"]["shards"][0].update(nbytes=2**62),
        "nbytes",
    ),
    ("chunks_per_shard_0", lambda d: d["arrays"]["id"].update(chunks_per_shard=0), "chunks"),
    (
        "chunk_recorded_absent",
        lambda d: d["arrays"]["id"]["shards"][0]["chunks"].__setitem__(0, None),
        "absent",
    ),
    (
        "chunk_digest_outside_shape",
        lambda d: d["arrays"]["id"]["shards"][-1]["chunks"].__setitem__(
            -1, d["arrays"]["id"]["shards"][0]["chunks"][0]
        ),
        "outside",
    ),
    ("bad_digest", lambda d: d["arrays"]["id"]["shards"][0].update(index="zz"), "digest"),
    ("deep_metadata", _deep_metadata, "metadata.*nested"),
    (
        "block_bounds_float",
        lambda d: _fields(d)["tokens"]["block_bounds"].__setitem__(1, 1.0),
        "block_bounds",
    ),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name,mutate,match", BAD_INDEXES, ids=[b[0] for b in BAD_INDEXES])
def test_forged_index_is_refused(index_doc, name, mutate, match):
    doc = copy.deepcopy(index_doc)
    mutate(doc)
    raw = _forge(doc)
    _bounded(lambda: DatasetIndex.from_bytes(raw), FormatError, match)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("mutate", [_no_fields, _one_giant_block, _giant_fixed_chunk])
def test_absurd_sizes_allocate_nothing_on_open(small_uri, mutate):
    """These used to parse and then make the reader allocate 16 GiB or more."""
    uri = _forged_uri(small_uri, mutate)
    _bounded(lambda: dataloader.StreamingDataset(uri, shuffle=True), FormatError, ".")


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "raw,match",
    [
        (b"[" * 200_000, "nested|JSON"),
        (b'{"a":' * 100_000, "nested|JSON"),
        (b"\xff\xfe{}", "UTF-8|JSON"),
        (b"", "JSON"),
        (b"[]", "expected dict"),
        (b'{"format": NaN}', "JSON"),
    ],
)
def test_malformed_index_bytes_are_refused(raw, match):
    _bounded(lambda: DatasetIndex.from_bytes(raw), FormatError, match)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_refused(index_doc, token):
    raw = _forge(copy.deepcopy(index_doc)).replace(
        b'"metadata":{}', b'"metadata":{"x":%s}' % token.encode()
    )
    assert token.encode() in raw
    with pytest.raises(FormatError, match="JSON|finite"):
        DatasetIndex.from_bytes(raw)


def test_valid_index_with_metadata_still_parses(index_doc):
    doc = copy.deepcopy(index_doc)
    doc["metadata"] = {"lr": 0.5, "name": "naïve", "tags": [1, 2.5e-3, None, True], "n": {"a": {}}}
    idx = DatasetIndex.from_bytes(_forge(doc))
    assert idx.metadata == doc["metadata"]
    assert DatasetIndex.from_bytes(idx.to_bytes()) == idx


# -- dataset.json against the store --------------------------------------------------------


@pytest.mark.timeout(10)
def test_index_size_is_capped_before_reading(tmp_path: Path, small_samples):
    """A (sparse) dataset.json over the cap is refused from its size alone: never read."""
    root = tmp_path / "big"
    dataloader.write_dataset(str(root), small_samples[:20], rows_per_chunk=8)
    index = root / INDEX_KEY
    index.chmod(0o644)
    with open(index, "r+b") as fh:
        fh.truncate(MAX_INDEX_BYTES + 1)
    _bounded(lambda: dataloader.StreamingDataset(str(root)), FormatError, "larger than", 16)
    assert MAX_INDEX_BYTES == 256 << 20


def test_index_read_uses_stat_then_a_bounded_read(small_uri, monkeypatch):
    uri = _copy_store(small_uri)
    store = open_store(uri)
    calls: list[str] = []
    for name in ("get", "get_range"):
        real = getattr(store, name)

        def spy(key: str, *args: Any, _real: Any = real, _name: str = name) -> Any:
            calls.append(f"{_name} {key}")
            return _real(key, *args)

        monkeypatch.setattr(store, name, spy)
    dataloader.StreamingDataset(store)
    assert f"get {INDEX_KEY}" not in calls


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "array,edit,match",
    [
        ("id", lambda z: z.update(data_type="uint64"), "data_type"),
        ("id", lambda z: z.update(shape=[524]), "shape"),
        ("tokens/data", lambda z: _endian(z, "big"), "endian"),
        ("id", lambda z: z.update(zarr_format=2), "zarr_format"),
        ("id", lambda z: z["codecs"][0]["configuration"].update(chunk_shape=[8]), "chunk"),
        ("id", lambda z: z.update(node_type="group"), "node_type"),
    ],
)
def test_index_must_agree_with_zarr_metadata(small_uri, array, edit, match):
    uri = _copy_store(small_uri)
    store = open_store(uri)
    z = json.loads(store.get(f"{array}/zarr.json"))
    edit(z)
    store.put(f"{array}/zarr.json", json.dumps(z).encode())
    _bounded(lambda: _ds(uri, fields=None), FormatError, match)


def _endian(z: dict[str, Any], endian: str) -> None:
    for codec in z["codecs"][0]["configuration"]["codecs"]:
        if codec["name"] == "bytes":
            codec["configuration"] = {"endian": endian}


@pytest.mark.timeout(10)
def test_dtype_reinterpretation_is_refused_on_open(small_uri):
    """A forged index that reads the int64 `id` column as uint64 (same size, so every chunk
    digest still matches) disagrees with the array's zarr metadata."""
    uri = _forged_uri(small_uri, lambda d: _set_dtype(d, "id", "id", "<u8"))
    DatasetIndex.from_bytes(open_store(uri).get(INDEX_KEY))  # self-consistent on its own
    _bounded(lambda: _ds(uri), FormatError, "data_type")


@pytest.mark.parametrize(
    "payload,match", [(b"{", "JSON"), (b"[" * 100_000, "nested|JSON"), (b" " * (2 << 20), "larger")]
)
def test_bad_zarr_metadata_bytes_are_refused(small_uri, payload, match):
    uri = _copy_store(small_uri)
    open_store(uri).put("id/zarr.json", payload)
    _bounded(lambda: _ds(uri), FormatError, match)
    open_store(uri).delete("id/zarr.json")
    with pytest.raises(FormatError, match="missing"):
        _ds(uri)


def test_only_the_selected_fields_arrays_are_checked(small_uri):
    uri = _copy_store(small_uri)
    open_store(uri).delete("text/data/zarr.json")
    assert _ds(uri).num_samples == 523  # fields=["id"]
    with pytest.raises(FormatError, match="text/data"):
        _ds(uri, fields=None)


@pytest.mark.timeout(10)
def test_shard_index_entry_larger_than_a_chunk_is_refused_before_reading(small_uri):
    """A forged shard index (with its digest and the fingerprint updated to match) that
    claims a chunk of 2**40 bytes: refused before any buffer is allocated. The index is made
    one without recorded shard tables (as datasets written before them are), so the reader
    fetches the forged shard index."""
    uri = _copy_store(small_uri)
    store = open_store(uri)
    doc = _doc(uri)
    a = doc["arrays"]["id"]
    for arr in doc["arrays"].values():
        for sh in arr["shards"]:
            del sh["table"]
    key = "id/c/0"
    shard = bytearray(store.get(key))
    tail_len = 16 * a["chunks_per_shard"] + 4
    table = np.frombuffer(shard[-tail_len:-4], dtype="<u8").copy().reshape(-1, 2)
    table[0] = (0, 2**40)
    shard[-tail_len:-4] = table.tobytes()
    store.put(key, bytes(shard))
    a["shards"][0]["index"] = digest(bytes(shard[-tail_len:]))
    store.put(INDEX_KEY, _forge(doc))
    ds = _ds(uri, shuffle=False)
    _bounded(
        lambda: next(iter(dataloader.StreamingLoader(ds, batch_size=4, num_workers=0))),
        IntegrityError,
        "chunk 0",
    )


def test_recorded_shard_table_forged_is_refused_at_open(small_uri):
    """A recorded shard index (with the fingerprint updated) claiming a chunk of 2**40 bytes,
    or an absent chunk that has a digest: the index is refused when it is opened."""
    for entry, match in (([0, 2**40], "outside the shard"), (None, "present/absent")):
        uri = _copy_store(small_uri)
        doc = _doc(uri)
        doc["arrays"]["id"]["shards"][0]["table"][0] = entry
        open_store(uri).put(INDEX_KEY, _forge(doc))
        with pytest.raises(FormatError, match=match):
            _ds(uri, shuffle=False)


def test_writer_refuses_what_readers_would_refuse(tmp_path):
    with pytest.raises(ValueError, match="at least one field"):
        dataloader.write_dataset(str(tmp_path / "a"), [{}, {}])
    with pytest.raises(ValueError, match="rows_per_chunk"):
        dataloader.write_dataset(str(tmp_path / "b"), [{"x": 1}], rows_per_chunk=2**30)


# -- bit flips ----------------------------------------------------------------------------


def _tiny_index() -> bytes:
    uri = _uri()
    samples = [{"id": i, "text": f"é{i}", "v": np.arange(i, dtype=np.int16)} for i in range(5)]
    meta = {"lr": 0.5, "name": "naïve", "n": [1, 2e5]}
    dataloader.write_dataset(uri, samples, rows_per_chunk=2, shard_bytes=64, metadata=meta)
    return open_store(uri).get(INDEX_KEY)


def _flip_campaign(raw: bytes, bits: list[int]) -> tuple[int, int]:
    """Flip each bit alone; every result is refused with FormatError or parses to an index
    equal to the original. Returns (refused, equal)."""
    original = DatasetIndex.from_bytes(raw)
    refused = equal = 0
    for bit in bits:
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            idx = DatasetIndex.from_bytes(bytes(flipped))
        except FormatError:
            refused += 1
            continue
        assert idx == original, f"bit {bit} changed the index without being detected"
        assert idx.to_bytes() == original.to_bytes()
        equal += 1
    return refused, equal


@pytest.mark.timeout(120)
def test_every_bit_flip_of_a_small_index_is_caught():
    raw = _tiny_index()
    refused, equal = _flip_campaign(raw, list(range(8 * len(raw))))
    assert refused + equal == 8 * len(raw)
    # the only flips that parse spell the same JSON differently (the case of a hex digit in
    # the escape "\u00ef"): never a semantic change
    assert equal <= 2


@pytest.mark.timeout(60)
def test_random_bit_flips_of_a_real_index_are_caught(small_uri):
    raw = open_store(small_uri).get(INDEX_KEY)
    bits = random.Random(20240607).sample(range(8 * len(raw)), 400)
    refused, equal = _flip_campaign(raw, bits)
    assert refused + equal == 400 and refused > 390


def test_an_index_fingerprinted_with_the_old_ascii_escaping_still_opens(small_uri) -> None:
    """Indexes written before the dataloader shared ckptstore's canonical JSON escaped
    non-ASCII characters; their fingerprints must still check."""
    from ckptstore.toolkit import digest

    body = _doc(small_uri)
    del body["fingerprint"]
    body["metadata"] = {"note": "café"}
    legacy = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()  # ensure_ascii
    raw = canonical_json({**body, "fingerprint": digest(legacy)})
    assert DatasetIndex.from_bytes(raw).metadata == {"note": "café"}
    assert b"caf\\u00e9" not in DatasetIndex.from_bytes(raw).to_bytes()  # written UTF-8 now
