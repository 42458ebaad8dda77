"""format/tree_pages.py: wide containers of a version-3 state tree stored as pages.

A paged tree must read back as exactly the tree it was made from, walked whole or through
any key filter (checked on random trees paged with tiny thresholds, against the same walks of
the unpaged tree); a partial restore reads only the pages that can hold its keys; a page that
breaks a rule is refused when it is read; and in a repository the pages are blobs like the
others (reused when unchanged, kept by gc, checked by verify, read only when needed)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore import CheckpointStore, FormatError
from ckptstore.format.canonical import canonical_str
from ckptstore.format.hashing import XXH3_128
from ckptstore.format.manifest_parse import check_tree
from ckptstore.format.segment_encoding import TreeRef
from ckptstore.format.tree import KeyFilter, decode, leaf_keys, tied_keys
from ckptstore.format.tree_pages import PAGE_ITEMS, PagedItems, PageSet, page_loads, paginate
from ckptstore.layout import blob_key

digest = XXH3_128.digest


class Pages:
    """An in-memory blob source that counts reads."""

    def __init__(self, blobs: list[tuple[TreeRef, bytes]]) -> None:
        self.blobs = {ref.digest: data for ref, data in blobs}
        self.reads: list[str] = []

    def __call__(self, ref: TreeRef) -> bytes:
        self.reads.append(ref.digest)
        return self.blobs[ref.digest]


def resolved(tree: Any, above: int, per_page: int, n_tensors: int = 100
             ) -> tuple[Any, Pages]:
    """`tree` paged, written as JSON and read back as a reader does."""
    top, pages = paginate(tree, digest, above, per_page)
    source = Pages(pages)
    back = json.loads(canonical_str(top))
    check_tree(back, n_tensors, 0, PageSet([r for r, _ in pages], source, n_tensors, "t",
                                           check_tree))
    return back, source


NAMES = st.sampled_from(["a", "b", "c", "a.b", "a.c", "0", "1", "10", "2", "w", "w.0"])
LEAF = st.one_of(st.integers(0, 5).map(lambda i: {"tensor": i}),
                 st.integers(-3, 3).map(lambda v: {"int": v}), st.just({"str": "x"}))


def _trees() -> Any:
    return st.recursive(LEAF, lambda inner: st.one_of(
        st.lists(inner, max_size=6).map(lambda xs: {"list": xs}),
        st.lists(inner, max_size=4).map(lambda xs: {"tuple": xs}),
        st.dictionaries(NAMES, inner, max_size=7).map(
            lambda d: {"dict": [[["s", k], v] for k, v in d.items()]}),
        st.dictionaries(st.integers(0, 12), inner, max_size=7).map(
            lambda d: {"dict": [[["i", k], v] for k, v in d.items()]}),
        st.tuples(st.dictionaries(NAMES, inner, max_size=5), inner).map(
            lambda p: {"odict": [[["s", k], v] for k, v in p[0].items()], "meta": p[1]})),
        max_leaves=30)


def _paths(node: Any, key: str | None = None) -> list[str]:
    kind = next(k for k in node if k != "meta")
    here = [] if key is None else [key]
    value = node[kind]
    if kind in ("dict", "odict"):
        pairs = [(k, c) for (_t, k), c in value]
    elif kind in ("list", "tuple"):
        pairs = list(enumerate(value))
    else:
        return here
    return here + [p for k, c in pairs for p in _paths(c, str(k) if key is None else f"{key}.{k}")]


def _load(i: int) -> str:
    return f"T{i}"


@settings(max_examples=300, deadline=None)
@given(_trees().filter(lambda t: len(t) > 1 or next(iter(t)) in ("dict", "list", "tuple",
                                                                "odict")),
       st.integers(0, 3), st.integers(1, 3), st.data())
def test_a_paged_tree_walks_as_the_tree_it_was_made_from(
        tree: Any, above: int, per_page: int, data: st.DataObject) -> None:
    back, _source = resolved(tree, above, per_page)
    assert decode(back, _load) == decode(tree, _load)
    assert leaf_keys(back) == leaf_keys(tree) and tied_keys(back) == tied_keys(tree)
    paths = _paths(tree)
    keys = data.draw(st.lists(st.one_of(st.sampled_from(paths or ["x"]),
                                        st.text("abw.01", max_size=4)), min_size=1, max_size=3))
    keep = KeyFilter(keys)
    again, _ = resolved(tree, above, per_page)  # nothing read yet: the filter reads alone
    assert repr(decode(again, _load, keep)) == repr(decode(tree, _load, keep))
    assert leaf_keys(again, keep) == leaf_keys(tree, keep)
    assert tied_keys(again, keep) == tied_keys(tree, keep)


def _wide(n: int) -> dict[str, Any]:
    return {"dict": [[["s", f"layers.{i}.w"], {"tensor": i}] for i in range(n)]
            + [[["s", "state"], {"dict": [[["i", i], {"dict": [[["s", "m"], {"tensor": i}],
                                                              [["s", "step"], {"int": i}]]}]
                                          for i in range(n)]}],
               [["s", "params"], {"list": [{"int": i} for i in range(n)]}]]}


@pytest.mark.parametrize("key", ["layers.1234.w", "state.777.m", "state.777", "params.5"])
def test_one_key_reads_one_page_of_each_container_on_its_path(key: str) -> None:
    n = 3000
    back, source = resolved(_wide(n), 1024, PAGE_ITEMS, n)
    assert source.reads == []  # the top blob names the pages; none is read yet
    keep = KeyFilter([key])
    got = decode(back, _load, keep)
    # the root (n + 2 children) is paged; the asked key's container is one page more
    assert len(source.reads) == (1 if key.startswith("layers") else 2)
    assert json.dumps(got) == json.dumps(decode(_wide(n), _load, keep))


def test_a_selected_container_reads_all_its_pages() -> None:
    back, source = resolved(_wide(3000), 1024, PAGE_ITEMS, 3000)
    got = decode(back, _load, KeyFilter(["params"]))
    assert got == {"params": list(range(3000))}
    params_pages = -(-3000 // PAGE_ITEMS)
    assert len(source.reads) == 1 + params_pages  # its root page, then every page of it


def _tampered(edit: Any) -> Any:
    """A paged tree whose first root page was edited by `edit(doc)` and stored under its new
    digest (so only the tree rules can refuse it)."""
    top, pages = paginate(_wide(3000), digest, 1024, PAGE_ITEMS)
    first = top["paged"]["pages"][0]["digest"]
    (ref0, data0), = [p for p in pages if p[0].digest == first]
    rest = [p for p in pages if p[0].digest != first]
    doc = json.loads(data0)
    edit(doc)
    bad = canonical_str(doc).encode()
    new = TreeRef(digest(bad), len(bad))
    text = canonical_str(top).replace(ref0.digest, new.digest).replace(
        f'"size":{ref0.size}', f'"size":{new.size}', 1)
    refs = [new, *(r for r, _ in rest)]
    source = Pages([(new, bad), *rest])
    back = json.loads(text)
    check_tree(back, 3000, 0, PageSet(refs, source, 3000, "t", check_tree))
    return back


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["items"].reverse(), "out of order"),
    (lambda d: d["items"].pop(), "holds 511 items"),
    (lambda d: d["items"][3].__setitem__(0, 999999), "out of range"),
    (lambda d: d["items"][3].__setitem__(2, {"tensor": 99999}), "tensor index"),
    (lambda d: d.__setitem__("kind", "list"), "not a dict page"),
    (lambda d: d["items"][1].__setitem__(1, ["s", d["items"][0][1][1]]), "out of order"),
])
def test_a_page_that_breaks_a_rule_is_refused_when_read(edit: Any, match: str) -> None:
    back = _tampered(edit)
    with pytest.raises(FormatError, match=match):
        decode(back, _load)


def test_a_page_missing_from_the_root_list_and_a_bad_descriptor_are_refused() -> None:
    top, pages = paginate(_wide(3000), digest, 1024, PAGE_ITEMS)
    source = Pages(pages)
    refs = [r for r, _ in pages]
    unlisted = [r for r in refs if r.digest != top["paged"]["pages"][0]["digest"]]
    with pytest.raises(FormatError, match="not listed by the manifest root"):
        check_tree(json.loads(canonical_str(top)), 3000, 0,
                   PageSet(unlisted, source, 3000, "t", check_tree))
    with pytest.raises(FormatError, match="paged tree node outside"):
        check_tree(json.loads(canonical_str(top)), 3000)
    doc = json.loads(canonical_str(top))
    doc["paged"]["count"] += 1
    with pytest.raises(FormatError, match="do not add up"):
        check_tree(doc, 3000, 0, PageSet(refs, source, 3000, "t", check_tree))
    doc = json.loads(canonical_str(top))
    doc["paged"]["pages"].reverse()
    with pytest.raises(FormatError, match="not in order"):
        check_tree(doc, 3000, 0, PageSet(refs, source, 3000, "t", check_tree))


# ----------------------------------------------------------------------- in a repository
N = 3000


def state(bump: int | None = None, extra: bool = False) -> dict[str, Any]:
    model = {f"layers.{i}.w": torch.full((2,), float(i)) for i in range(N)}
    if bump is not None:
        model[f"layers.{bump}.w"] = model[f"layers.{bump}.w"] + 1
    if extra:
        model["layers.1500.x"] = torch.zeros(1)
    optim = {"state": {i: {"step": i, "m": np.full((2,), i, np.float32)} for i in range(N)},
             "param_groups": [{"lr": 0.1, "params": list(range(N))}]}
    return {"model": model, "optim": optim}


def root(path: Path, name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((path / "checkpoints" / f"{name}.json").read_bytes())
    return doc


def test_pages_round_trip_and_are_blobs_of_the_checkpoint(tmp_path: Path) -> None:
    s = state()
    CheckpointStore(str(tmp_path)).save("a", s)
    doc = root(tmp_path, "a")
    pages = doc["tree_pages"]
    assert len(pages) == 3 * -(-N // PAGE_ITEMS)  # model, optim.state, params
    assert all((tmp_path / blob_key(p["digest"])).stat().st_size == p["size"] for p in pages)
    assert doc["tree_blob"]["size"] < 64 * 1024  # the top of the tree names the pages
    repo = CheckpointStore(str(tmp_path))
    m = repo.manifest("a")
    assert {p["digest"] for p in pages} <= {b.digest for b in m.index_blobs()}
    assert m.to_bytes() == (tmp_path / "checkpoints" / "a.json").read_bytes()
    out = repo.load("a")
    assert list(out["model"]) == list(s["model"])
    assert all(torch.equal(out["model"][k], v) for k, v in s["model"].items())
    assert list(out["optim"]["state"]) == list(range(N))
    assert out["optim"]["param_groups"] == s["optim"]["param_groups"]
    assert repo.verify("a").problems == []
    repo.gc(grace_seconds=0)
    assert CheckpointStore(str(tmp_path)).verify("a").problems == []


def _page_holding(tmp_path: Path, name: str, key: str) -> str:
    """The digest of the page of `name`'s tree that holds the dotted `key`."""
    m = CheckpointStore(str(tmp_path)).manifest(name)
    top, child = key.split(".", 1)
    items = next(c for (_t, k), c in m.tree["dict"] if k == top)["dict"]
    assert isinstance(items, PagedItems)
    for j, page in enumerate(items.pages):
        if any(n == child for _p, n, _i in items.page(j)):
            return page.ref.digest
    raise AssertionError(key)


def test_a_partial_load_reads_only_its_pages(tmp_path: Path) -> None:
    """Every page but the one holding the asked key is deleted: the partial load still works,
    a whole load is refused naming a missing page, and verify reports each missing page."""
    CheckpointStore(str(tmp_path)).save("a", state())
    key = "model.layers.1234.w"
    keepers = {_page_holding(tmp_path, "a", key)}
    for p in root(tmp_path, "a")["tree_pages"]:
        if p["digest"] not in keepers:
            (tmp_path / blob_key(p["digest"])).unlink()
    out = CheckpointStore(str(tmp_path)).load("a", keys=[key])
    assert torch.equal(out["model"]["layers.1234.w"], torch.full((2,), 1234.0))
    with pytest.raises(FormatError, match="index blob .* has no good copy: missing"):
        CheckpointStore(str(tmp_path)).load("a")
    report = CheckpointStore(str(tmp_path)).verify("a")
    assert {p.keys for p in report.problems} == {("(state tree page)",)}
    assert len(report.problems) == len(root(tmp_path, "a")["tree_pages"]) - 1


def test_unchanged_pages_are_not_written_again(tmp_path: Path) -> None:
    CheckpointStore(str(tmp_path)).save("a", state())
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "blobs").rglob("*") if p.is_file()}
    time.sleep(0.01)
    CheckpointStore(str(tmp_path)).save("b", state(bump=7))  # values change, the tree not
    assert root(tmp_path, "b")["tree_pages"] == root(tmp_path, "a")["tree_pages"]
    assert {p: p.stat().st_mtime_ns for p in before} == before
    # one key more: the pages naming it or a later tensor index (every optim.state page
    # here) change; the parameter list's pages do not
    CheckpointStore(str(tmp_path)).save("c", state(extra=True))
    a = {p["digest"] for p in root(tmp_path, "a")["tree_pages"]}
    c = {p["digest"] for p in root(tmp_path, "c")["tree_pages"]}
    assert len(c & a) >= -(-N // PAGE_ITEMS) and c - a
    out = CheckpointStore(str(tmp_path)).load("c", keys=["model.layers.1500.x"])
    assert torch.equal(out["model"]["layers.1500.x"], torch.zeros(1))


def test_page_loads_visits_every_page_where_it_is_named() -> None:
    tree = {"list": [_wide(1500), _wide(1500)]}  # two identical subtrees: shared pages
    back, _source = resolved(tree, 1024, PAGE_ITEMS, 1500)
    seen = [ref.digest for ref, read in page_loads(back) if read() is not None]
    _top, pages = paginate(tree, digest, 1024, PAGE_ITEMS)
    assert set(seen) == {r.digest for r, _ in pages}
    assert len(seen) == 2 * len(pages)  # the same page named twice is visited where named
