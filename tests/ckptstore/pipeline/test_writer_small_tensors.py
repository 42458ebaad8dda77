"""The fast paths for many small tensors change speed, never results.

- A save caches the writer's own Manifest only when it provably equals what a reader parses
  (`parses_back_equal`); these tests check that it then really does, with the same types and
  dict order, for states covering every tensor and leaf kind the suite uses. A segmented
  (version-3) save caches the parse of its root instead, which reads its index as a reader
  does.
- `_fast_tensor` (parsing) agrees with the reference `_parse_tensor` on every input, valid or
  mutated, and `_entry_json` (writing) gives the bytes of `canonical_json(to_json())`.
- The encoder's and the staging arena's shortcuts keep their results.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore import CheckpointStore, FormatError, Shard, UnsupportedTypeError
from ckptstore.format import manifest as M
from ckptstore.format import manifest_parse as P
from ckptstore.format.codecs import Codec
from ckptstore.format.tree import TreeEncoder, key_string, leaf_keys, leaf_paths
from ckptstore.layout import blob_key
from ckptstore.pipeline import staging
from ckptstore.pipeline.staging import StagingArena
from ckptstore.pipeline.writer import KnownChunks
from tests.helpers import assert_same, json_paths, sealed_manifest

TORCH_DTYPES = [getattr(torch, name) for name in M.DTYPES if hasattr(torch, name)]


def _bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def rich_state() -> dict:
    """Every kind of leaf and node the suite saves: each dtype and shape class, views, tied
    storage, parameters, numpy arrays and scalars, bytes, OrderedDict with _metadata, Shard."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return _rich_state()


def _rich_state() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    emb = torch.nn.Parameter(torch.randn(10, 4))
    big = torch.randn(300, 30)
    state: dict = {
        "dtypes": {str(dt).removeprefix("torch."): {
            "scalar": _bits(dt, (), i), "empty": _bits(dt, (0, 3), i),
            "vec": _bits(dt, (17,), i), "mat": _bits(dt, (33, 5), i)}
            for i, dt in enumerate(TORCH_DTYPES)},
        "model": model.state_dict(),  # OrderedDict with _metadata
        "params": {"p": torch.nn.Parameter(torch.randn(3, 3)),
                   "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
                   "g": torch.randn(4, requires_grad=True)},
        "tied": {"emb": emb, "head": emb.detach(), "slice": big[10:20], "full": big,
                 "same": [big, big], "t": big.t()},
        "views": {"strided": big[::3, 1::4], "expanded": torch.ones(1, 8).expand(5, 8),
                  "conj": torch.randn(4, dtype=torch.complex64).conj(),
                  "neg": torch.randn(6)._neg_view()},
        "np": {"f32": np.arange(12, dtype=np.float32).reshape(3, 4),
               "big_endian": np.arange(5, dtype=">i4"), "bool": np.array([True, False]),
               "c": np.array([1 + 2j], dtype=np.complex64), "zero_d": np.array(3.5),
               "fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
               "s32": np.float32(1.25), "s64": np.int64(-7), "sb": np.bool_(True)},
        "values": {"str": "hé\x00llo \"q\" \\ \u2028", "int": -(2**70), "float": -0.0,
                   "nan": float("nan"), "inf": float("-inf"), "none": None, "t": True,
                   "bytes": b"\x00\xff", "empty_bytes": b"", "tuple": (1, (2, [3])),
                   7: "int key", "od": OrderedDict([("b", 1), ("a", 2)]), "el": [], "ed": {}},
        "shard": Shard(torch.arange(12.0).reshape(4, 3), 0, (4, 3)),
        "large": torch.randn(1000, 100),
        "k\u00e9y \"quoted\"\\ \x01\n": torch.randn(3),
    }
    return state


SAVE_OPTIONS = [{}, {"chunk_bytes": 64 * 1024}, {"compression": "zstd", "chunk_bytes": 1 << 16},
                {"compression": "lz4"}, {"compression": "blosc:3", "chunk_bytes": 1 << 17}]


@pytest.fixture(params=SAVE_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items())
                or "default")
def saved(request, tmp_path):
    """(repo, writer's cached Manifest, committed bytes) of a rich state."""
    repo = CheckpointStore(tmp_path / "r", **request.param)
    repo.test_options = request.param
    repo.save("a", rich_state(), metadata={"step": 3, "b": [1, 2.5, None], "a": {"z": 1, "y": 2}})
    yield repo, repo.manifest("a"), repo.store.get("checkpoints/a.json")
    repo.close()


def test_writer_manifest_is_cached_and_equals_the_parse(saved):
    repo, cached, raw = saved
    assert P.parses_back_equal(cached, "a")  # so _write kept the writer's own object
    parsed = P.parse_manifest(raw, "a")
    assert parsed == cached
    assert repr(parsed) == repr(cached)  # same types (1 vs 1.0 vs True) and dict order
    assert cached.to_bytes() == raw
    assert_same(repo.load("a"), CheckpointStore(repo.store.uri).load("a"))


def test_cached_manifest_gives_the_same_incremental_save(saved):
    repo, cached, _raw = saved
    from_cached, from_parsed = KnownChunks(), KnownChunks()
    from_cached.add_manifest(cached)
    from_parsed.add_manifest(CheckpointStore(repo.store.uri).manifest("a"))
    assert from_cached._refs == from_parsed._refs
    state = rich_state()
    state["large"] = state["large"] + 1
    info_cached = repo.save("b", state, parent="a")
    info_fresh = CheckpointStore(repo.store.uri, **repo.test_options).save("c", state,
                                                                          parent="a")
    assert info_cached.written_bytes == info_fresh.written_bytes
    assert info_cached.reused_bytes == info_fresh.reused_bytes > 0


def _reference_bytes(m: M.Manifest) -> bytes:
    """Manifest bytes the straightforward way: canonical_json of the whole document."""
    return sealed_manifest({
        "format": M.FORMAT_NAME, "version": m.version, "hash": M.HASH_NAME, "name": m.name,
        "created": m.created, "parent": m.parent, "metadata": m.metadata, "tree": m.tree,
        "tensors": [t.to_json() for t in m.tensors]})


def test_a_segmented_save_caches_the_parse_of_its_root_not_the_writers_entries(tmp_path):
    state = {"blocks": {str(i): torch.full((3,), float(i)) for i in range(1500)},
             "step": 7, "tied": None}
    state["tied"] = state["blocks"]["5"]
    repo = CheckpointStore(tmp_path / "r")
    repo.save("a", state)
    read: list[str] = []  # what this process reads back through its store from now on
    get = repo.store.get
    repo.store.get = lambda key, *a, **k: (read.append(key), get(key, *a, **k))[1]
    cached = repo.manifest("a")
    assert cached.version == M.SEGMENTED_VERSION
    assert type(cached.tensors) is not tuple  # index blobs read through a source, on use
    raw = CheckpointStore(repo.store.uri).store.get("checkpoints/a.json")
    assert cached.to_bytes() == raw
    fresh = CheckpointStore(repo.store.uri).manifest("a")
    assert list(cached.tensors) == list(fresh.tensors)
    assert (cached.tree_ref(), cached.tree_page_refs()) == (fresh.tree_ref(),
                                                            fresh.tree_page_refs())
    assert_same(repo.load("a"), state)
    # the next save in this process learns its parent's chunks from that parse, as a fresh
    # one does
    state["blocks"]["7"] = state["blocks"]["7"] + 0.5  # a value no other block holds
    info = repo.save("b", state)
    assert info.chunks_written == 1 and info.chunks_reused == 1499
    assert_same(CheckpointStore(repo.store.uri).load("b"), state)
    # the index blobs this process wrote were served from memory, never read back
    index = {blob_key(ref.digest) for ref in fresh.index_blobs()}
    assert len(index) > 3 and not index & set(read)


def test_fast_paths_taken_and_equal_to_the_reference(saved):
    _repo, cached, raw = saved
    docs = json.loads(raw)["tensors"]
    for i, doc in enumerate(docs):
        fast = P._fast_tensor(doc)
        assert fast is not None, doc["attributes"]["ckptstore"]["key"]
        assert fast == P._parse_tensor(doc, i)
        assert M._entry_json(fast) == M.canonical_str(doc)
    assert _reference_bytes(cached) == raw


def test_to_bytes_of_entries_the_fast_writer_skips():
    """Entries failing entry_problem (never written by a save) still serialize exactly."""
    good = P.parse_manifest(_small_manifest_bytes())
    entry = good.tensors[0]
    odd = [replace(entry, chunks=()),  # wrong chunk count
           replace(entry, shape=(np.int64(entry.shape[0]), *entry.shape[1:])),  # numpy int
           replace(entry, chunk_rows=True),  # a bool where an int belongs
           replace(entry, requires_grad=1)]
    for e in odd:
        m = replace(good, tensors=(e,))
        try:
            want: bytes | type = _reference_bytes(m)
        except TypeError:  # numpy ints are not JSON: both ways refuse them
            want = TypeError
        if want is TypeError:
            with pytest.raises(TypeError):
                m.to_bytes()
        else:
            assert m.to_bytes() == want


def _small_manifest_bytes() -> bytes:
    repo = CheckpointStore("memory://")
    repo.save("s", {"w": torch.randn(5, 2), "o": OrderedDict(a=np.arange(3))}, metadata={"x": 1})
    return repo.store.get("checkpoints/s.json")


def test_parses_back_equal_refuses_what_would_not_round_trip():
    m = P.parse_manifest(_small_manifest_bytes())
    assert P.parses_back_equal(m, "s") and not P.parses_back_equal(m, "other")
    e = m.tensors[0]
    bad = [
        replace(m, created=int(m.created)),
        replace(m, version=True),  # == 1, but not the int a parse gives
        replace(m, extra={"x": 1}),
        replace(m, metadata={"t": (1, 2)}),
        replace(m, metadata={"b": 1, "a": 2}),  # not in sorted order
        replace(m, metadata={1: "int key"}),
        replace(m, metadata={"f": float("inf")}),
        replace(m, metadata={"a": [1, "x", {"b": [None, True, 2.5, (3,)]}]}),  # deep inside
        replace(m, metadata={"a": [[float("nan")]]}),
        replace(m, metadata={"a": ["x", b"bytes"]}),
        replace(m, metadata={"a": {"b": np.int64(1)}}),
        replace(m, metadata={"a": [{"d": 1, "c": 2}]}),
        replace(m, tree={"odict": [], "meta": {"none": None}}),  # parse sorts "meta" first
        replace(m, tree={"tensor": 5}),
        replace(m, parent="../x"),
        replace(m, tensors=(replace(e, shape=(np.int64(e.shape[0]), *e.shape[1:])),)),
        replace(m, tensors=(replace(e, codec=Codec("zstd", 1000)),)),
        replace(m, tensors=(replace(e, requires_grad=1),)),
        replace(m, tensors=(replace(e, chunks=e.chunks * 2),)),
        replace(m, tensors=(replace(e, chunks=(replace(e.chunks[0], digest="F" * 32),)),)),
        replace(m, tensors=(replace(e, kind="numpy", parameter=True),)),
        replace(m, tensors=list(m.tensors)),
    ]
    for b in bad:
        assert not P.parses_back_equal(b), b
    # committed_manifest then parses the committed bytes instead of keeping the object
    odd = replace(m, created=int(m.created))
    got = P.committed_manifest(odd, odd.to_bytes(), "s")
    assert got is not odd and got == P.parse_manifest(odd.to_bytes(), "s")
    bad_codec = replace(m, tensors=(replace(e, codec=Codec("zstd", 1000)),))
    with pytest.raises(FormatError):
        P.committed_manifest(bad_codec, bad_codec.to_bytes(), "s")


# ------------------------------------------------------ fast parse == reference, on anything
def _valid_docs() -> list:
    repo = CheckpointStore("memory://", chunk_bytes=1 << 16)
    base = torch.randn(40, 3)
    repo.save("v", {"w": base, "tied": base[2:5], "np": np.arange(6.0).reshape(2, 3),
                    "b": b"xy", "p": torch.nn.Parameter(torch.randn(2)), "s": torch.tensor(1),
                    "u8": np.arange(6, dtype=np.uint8).reshape(3, 2),
                    "f8": torch.zeros(4, dtype=torch.float8_e4m3fn)})
    repo.save("z", {"w": torch.randn(400, 100)}, compression="zstd")  # not packed: compressed
    docs = json.loads(repo.store.get("checkpoints/v.json"))["tensors"]
    docs += json.loads(repo.store.get("checkpoints/z.json"))["tensors"]
    assert {d["attributes"]["ckptstore"]["codec"] is None for d in docs} == {True, False}
    return docs


VALID_DOCS = _valid_docs()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 70) | st.integers()
    | st.sampled_from([0.0, 3.0, 1.5, -1.0]) | st.text(max_size=6)
    | st.sampled_from(["a" * 32, "0" * 32, "0" * 31, "bool", "uint8", "float32", "torch",
                       "numpy", "bytes", "regular", "array", "little"]),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)


DOC_PATHS = [(i, p) for i, d in enumerate(VALID_DOCS) for p in json_paths(d) if p]


def _same_verdict(doc) -> None:
    fast = P._fast_tensor(doc)
    try:
        slow = P._parse_tensor(doc, 0)
    except FormatError:
        assert fast is None, "the fast path accepted what the reference refuses"
        return
    if fast is not None:
        assert fast == slow and repr(fast) == repr(slow)
    elif M.canonical_str(slow.to_json()) == M.canonical_str(doc):
        raise AssertionError("the fast path refused a canonical entry")
    if M.entry_problem(slow) is None:
        assert M._entry_json(slow) == M.canonical_str(slow.to_json())


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(DOC_PATHS), json_values, st.booleans())
def test_fast_tensor_parse_agrees_with_reference(where, value, delete):
    i, path = where
    doc = json.loads(json.dumps(VALID_DOCS[i]))
    node = doc
    for p in path[:-1]:
        node = node[p]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    _same_verdict(doc)


@pytest.mark.parametrize("mutate", [
    lambda a, d: a["chunks"][0].update(offset=True),
    lambda a, d: a["chunks"][0].update(size=float(a["chunks"][0]["size"])),
    lambda a, d: a.update(chunk_rows=float(a["chunk_rows"])),
    lambda a, d: d.update(zarr_format=3.0),  # == 3: the reference accepts it too
    lambda a, d: d.update(fill_value=False),  # == 0 in Python: the reference accepts it too
    lambda a, d: d.update(shape=[*d["shape"], 1]),
    lambda a, d: a["chunks"][0].update(digest=a["chunks"][0]["digest"].upper()),
    lambda a, d: a["chunks"][0].update(blob=a["chunks"][0]["blob"][:-1] + "g"),
    lambda a, d: a.update(requires_grad=0),
    lambda a, d: a.update(kind="numpy"),
    lambda a, d: a.update(storage={"id": 0, "nbytes": 4, "offset": 0, "stride": [1]}),
    lambda a, d: a.update(codec={"id": "zstd", "level": 1}),
    lambda a, d: a.update(key=["k"]),
    lambda a, d: a.update(dtype=["float32"]),
    lambda a, d: a.update(chunk_rows=0),
    lambda a, d: a["chunks"][0].update(size=a["chunks"][0]["size"] + 1),
    lambda a, d: a["chunks"][0].update(nbytes=a["chunks"][0]["nbytes"] + 4),
    lambda a, d: a["chunks"][0].update(offset=a["chunks"][0]["offset"] + 1),
    lambda a, d: a["chunks"][0].update(size=2 * a["chunks"][0]["nbytes"] + 65537),
    lambda a, d: a["chunks"].append(a["chunks"][0]),
    lambda a, d: (a.update(kind="bytes"), a.pop("requires_grad", None), a.pop("parameter", None)),
    lambda a, d: a.get("storage", {}).update(nbytes=4),
    lambda a, d: a.get("storage", {}).update(stride=[-1] * len(d["shape"])),
    lambda a, d: a.get("storage", {}).update(stride=[]),
    lambda a, d: a.get("storage", {}).update(id=True),
])
def test_targeted_mutations_agree_with_reference(mutate):
    for doc in VALID_DOCS:
        doc = json.loads(json.dumps(doc))
        mutate(doc["attributes"]["ckptstore"], doc)
        _same_verdict(doc)


# ------------------------------------------------------------------- encoder and staging
def test_ordered_dict_metadata_node_and_array_type_cache():
    model = torch.nn.Linear(2, 2)
    enc = TreeEncoder()
    node = enc.encode(model.state_dict())
    assert list(node) == ["meta", "odict"]  # the order parse_manifest gives
    with pytest.raises(UnsupportedTypeError, match="^b"):  # tensor class cached, check kept
        TreeEncoder().encode({"a": torch.zeros(2), "b": torch.zeros(2, 2).to_sparse()})
    paths = leaf_paths(TreeEncoder().encode({"x": [model.weight, {"y": model.weight}]}))
    assert paths == {0: ("x", 0)}


def test_leaf_keys_are_the_dotted_leaf_paths():
    t = torch.zeros(1)
    odd = {"": {"x": t, "": torch.ones(1)}, 3: [torch.ones(2), (b"b",)], "a.b": torch.ones(3),
           "a": {"b": torch.ones(4)}, "root": t}
    for state in (rich_state(), odd, torch.zeros(2), [torch.zeros(1)]):
        node = TreeEncoder().encode(state)
        assert leaf_keys(node) == {i: key_string(p) for i, p in leaf_paths(node).items()}


def test_staging_copies_small_and_large_arrays(monkeypatch):
    monkeypatch.setattr(staging, "POOL_MIN_BYTES", 4096)
    monkeypatch.setattr(staging, "SPLIT_BYTES", 10_000)
    big = torch.randn(200, 50)
    state = {"small": [torch.randn(i) for i in range(20)], "big": big, "big2": big + 1,
             "t": big.t(), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
             "np": np.arange(10, dtype=">i8"), "b": b"bytes"}
    enc = TreeEncoder()
    enc.encode(state)
    arena = StagingArena(workers=3)
    for _ in range(2):  # the second stage reuses the arena
        staged = arena.stage(enc.leaves)
        for leaf, s in zip(enc.leaves, staged):
            assert s.key == leaf.key and s.storage_identity == leaf.storage_identity
            assert s.array.shape == leaf.array.shape and s.array.flags.c_contiguous
            assert np.array_equal(s.array, leaf.array)
            if s.array.size:
                assert np.shares_memory(s.array, arena._arena)
    before = staged[[lf.key for lf in enc.leaves].index("big")].array.copy()
    big.zero_()  # the caller changes its tensor: the staged copy keeps the old values
    assert np.array_equal(staged[[lf.key for lf in enc.leaves].index("big")].array, before)
