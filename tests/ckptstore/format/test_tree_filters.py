"""format/tree.py's filtered walks (`decode`, `leaf_keys`, `tied_keys` with a KeyFilter)
skip a container's unselected children without walking them; they must give exactly what
the plain rule gives: a leaf is kept iff its dotted key passes the filter, a container is
dropped when none of it could be kept (an empty one included) or it had children and all
were dropped; a selected empty container is kept. Checked
against that rule, written out naively, on random trees (dotted dict keys, tied tensors,
empty containers and wide dicts included)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.format.tree import KeyFilter, decode, leaf_keys, tied_keys

NAMES = st.sampled_from(["a", "b", "c", "a.b", "0", "1", "w"])
LEAF = st.one_of(st.integers(0, 5).map(lambda i: {"tensor": i}),
                 st.integers(-3, 3).map(lambda v: {"int": v}), st.just({"none": None}))


def _trees() -> Any:
    return st.recursive(LEAF, lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda xs: {"list": xs}),
        st.dictionaries(NAMES, inner, max_size=5).map(
            lambda d: {"dict": [[["s", k], v] for k, v in d.items()]})), max_leaves=25)


def _could_hold(keep: KeyFilter, key: str) -> bool:
    """Some kept key is `key` or lies below it, or `key` lies below a kept key."""
    return keep(key) or any(w == key or w.startswith(key + ".") for w in keep.wanted)


def _naive(node: Any, keep: KeyFilter, key: str | None) -> Any:
    """The rule, without any pruning: (value, dropped). A container that can hold no kept
    key is dropped whole (an empty one too)."""
    (kind, value), = node.items()
    if kind in ("dict", "list"):
        pairs = ([(k, c) for (_t, k), c in value] if kind == "dict" else list(enumerate(value)))
        if key is not None and not _could_hold(keep, key):
            return None, True
        out = [(k, _naive(c, keep, str(k) if key is None else f"{key}.{k}")) for k, c in pairs]
        kept = [(k, v) for k, (v, dropped) in out if not dropped]
        if pairs and not kept:
            return None, True
        return (dict(kept) if kind == "dict" else [v for _k, v in kept]), False
    if not keep("" if key is None else key):
        return None, True
    return {"tensor": f"T{value}", "int": value, "none": None}[kind], False


def _naive_leaves(node: Any, keep: KeyFilter, key: str | None = None) -> list[tuple[int, str]]:
    (kind, value), = node.items()
    if kind in ("dict", "list"):
        pairs = ([(k, c) for (_t, k), c in value] if kind == "dict" else list(enumerate(value)))
        return [x for k, c in pairs
                for x in _naive_leaves(c, keep, str(k) if key is None else f"{key}.{k}")]
    leaf = "" if key is None else key
    return [(value, leaf)] if kind == "tensor" and keep(leaf) else []


def _paths(node: Any, key: str | None = None) -> list[str]:
    (kind, value), = node.items()
    here = [] if key is None else [key]
    if kind in ("dict", "list"):
        pairs = ([(k, c) for (_t, k), c in value] if kind == "dict" else list(enumerate(value)))
        return here + [p for k, c in pairs
                       for p in _paths(c, str(k) if key is None else f"{key}.{k}")]
    return here


@settings(max_examples=400, deadline=None)
@given(_trees().filter(lambda t: "dict" in t or "list" in t), st.data())
def test_filtered_walks_equal_the_plain_rule(tree: Any, data: st.DataObject) -> None:
    paths = _paths(tree)
    keys = data.draw(st.lists(st.one_of(st.sampled_from(paths), st.text("ab.0", max_size=4)),
                              min_size=1, max_size=3)) if paths else ["x"]
    keep = KeyFilter(keys)
    want, dropped = _naive(tree, keep, None)
    got = decode(tree, lambda i: f"T{i}", keep)
    assert (got if not dropped else None) == want or (dropped and got in ({}, []))
    pairs = _naive_leaves(tree, keep)
    first: dict[int, str] = {}
    tied: dict[int, list[str]] = {}
    for i, k in pairs:
        if i in first:
            tied.setdefault(i, []).append(k)
        else:
            first[i] = k
    assert leaf_keys(tree, keep) == first
    assert tied_keys(tree, keep) == tied
