"""Pure computations behind ls/du/diff/show (ckptstore/tools/inspection.py)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from ckptstore import CheckpointStore
from ckptstore.tools.inspection import diff, key_matcher, leaves, usage, value_of


@pytest.fixture
def repo():
    r = CheckpointStore(f"memory://{uuid.uuid4().hex}", chunk_bytes=4096)
    yield r
    r.close()


def test_diff_by_digest(repo) -> None:
    w = np.arange(4096, dtype=np.float32)
    repo.save("a", {"w": w, "v": w[:10].copy(), "gone": 1, "same": "x", "f": 1.0},
              {"step": 1})
    w2 = w.copy()
    w2[-1] = -1  # only the last 4 KiB row block changes
    repo.save("b", {"w": w2, "v": w[:10].astype(np.float64), "new": np.zeros(2),
                    "same": "x", "f": float("nan")}, {"step": 2})
    d = diff(repo.manifest("a"), repo.manifest("b"))
    assert not d.same
    assert d.added == ("new",) and d.removed == ("gone",)
    changes = {c.key: c.detail for c in d.changed}
    assert changes == {"w": "1 of 4 chunk(s) differ", "v": "dtype float32 -> float64",
                       "f": "1.0 -> 'nan'"}
    assert d.unchanged == ("same",)
    assert d.metadata == {"step": (1, 2)}
    assert diff(repo.manifest("a"), repo.manifest("a")).same


def test_diff_sees_what_dotted_keys_hide_and_refuses_two_hashes(repo) -> None:
    # int vs str keys (load_state_dict then restores nothing), an empty container vs none,
    # a list vs a tuple: 'same' before; and two hash algorithms: every tensor 'changed'
    repo.save("a", {"optim": {"state": {0: np.ones(2)}}, "e": {}, "p": [1, 2]})
    repo.save("b", {"optim": {"state": {"0": np.ones(2)}}, "p": (1, 2)})
    changes = {c.key: c.detail for c in diff(repo.manifest("a"), repo.manifest("b")).changed}
    assert changes == {"optim.state": "dict with int keys -> dict with str keys",
                       "e": "empty dict -> absent", "p": "list -> tuple"}
    other = CheckpointStore(f"memory://{uuid.uuid4().hex}", hash="sha256-128")
    other.save("a", {"p": [1, 2]})
    with pytest.raises(ValueError, match="xxh3-128 and sha256-128"):
        diff(repo.manifest("a"), other.manifest("a"))
    other.close()


def test_codec_is_not_a_change_but_chunking_cannot_be_compared(repo) -> None:
    w = np.arange(8192, dtype=np.float32)
    repo.save("raw", {"w": w})
    repo.save("zstd", {"w": w}, compression="zstd")
    assert diff(repo.manifest("raw"), repo.manifest("zstd")).same
    other = CheckpointStore(f"memory://{uuid.uuid4().hex}", chunk_bytes=8192)
    other.save("big", {"w": w})
    d = diff(repo.manifest("raw"), other.manifest("big"))
    assert [c.detail for c in d.changed] == ["chunked differently: contents not comparable "
                                             "by digest"]


def test_usage_unique_bytes_and_listing_figures(repo) -> None:
    rng = np.random.default_rng(0)
    shared = rng.standard_normal(2048).astype(np.float32)  # 8 KiB: two 4 KiB chunks
    repo.save("a", {"s": shared, "x": rng.standard_normal(2048).astype(np.float32)})
    repo.save("b", {"s": shared, "x": rng.standard_normal(2048).astype(np.float32)})
    ma, mb = repo.manifest("a"), repo.manifest("b")
    u = usage([ma, mb])
    ua, ub = u.checkpoints
    assert ua.logical_bytes == ub.logical_bytes == 16384
    assert ua.referenced_bytes == ub.referenced_bytes == 16384
    assert ua.unique_bytes == ub.unique_bytes == 8192  # `s` is shared: only `x` is freed
    assert u.referenced_bytes == 3 * 8192
    assert u.dedup_ratio == pytest.approx(32768 / (3 * 8192))
    sizes = {i.key.rsplit("/", 1)[-1]: i.size for i in repo.store.list("blobs/")}
    gone = next(iter(ma.blob_digests() - mb.blob_digests()))
    sizes.pop(gone)
    sizes["f" * 32] = 123  # garbage
    listed = usage([ma, mb], sizes)
    assert listed.missing_blobs == (gone,)
    assert listed.unreferenced_blobs == 1 and listed.unreferenced_bytes == 123


def test_leaves_aliases_and_matcher(repo) -> None:
    w = np.ones(3)
    repo.save("a", {"model": {"w": w, "tied": w, "b": np.zeros(1)}, "opt": [1, np.float32(2)]})
    ls = leaves(repo.manifest("a"))
    assert [leaf.key for leaf in ls] == ["model.w", "model.tied", "model.b", "opt.0", "opt.1"]
    assert ls[1].alias_of == "model.w" and ls[0].alias_of is None
    assert value_of(ls[4].node) == ("numpy.float32", 2.0)
    m = key_matcher(["model"])
    assert m("model.w") and not m("modelx") and not m("opt.0")
    g = key_matcher(["*.b", "opt.?"])
    assert g("model.b") and g("opt.1") and not g("model.w")
    assert key_matcher(None)("anything")


def test_ordered_dict_metadata_is_not_a_leaf_and_reads_from_a_fresh_store(tmp_path) -> None:
    from collections import OrderedDict

    sd = OrderedDict(weight=np.ones((2, 2), np.float32), bias=np.zeros(2, np.float32))
    sd._metadata = OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]
    with CheckpointStore(tmp_path / "r") as r:
        r.save("a", {"model": sd, "step": 1})
    with CheckpointStore(tmp_path / "r", create=False) as fresh:  # parsed from the bytes
        keys = [leaf.key for leaf in leaves(fresh.manifest("a"))]
    assert keys == ["model.weight", "model.bias", "step"]
