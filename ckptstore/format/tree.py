"""The typed state tree: turning a nested state into JSON nodes plus a list of array leaves, and
back. No pickle: only the forms below exist, everything else is refused with the key path.

Node forms (each a one-field JSON object):
  {"dict": [[key, node], ...]}        key = ["s", str] or ["i", int]
  {"odict": [...], "meta": node?}     collections.OrderedDict; "meta" = its `_metadata` attribute
  {"list": [node, ...]}  {"tuple": [node, ...]}
  {"none": null} {"bool": b} {"int": i} {"float": "<float.hex()>"} {"str": s}
  {"np_scalar": [dtype, "<hex bytes>"]}
  {"tensor": i} {"bytes": i}          index into the manifest's tensors (same index twice =
                                      the same object twice)

A tree read from a version-3 manifest may hold a wide container's children as a
tree_pages.PagedItems instead of a list: it iterates as that list (reading every page), and
the filtered walks here ask it (`children(..., keep)`) for the pages a key filter reaches.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from ..errors import UnsupportedTypeError
from . import dtypes
from .leaf import ArrayLeaf
from .shard import Shard

Path = tuple[str | int, ...]


def key_string(path: Path) -> str:
    """Dotted key of a path: ('model', 'w') -> 'model.w'; ('state', 0) -> 'state.0'."""
    return ".".join(map(str, path))


def _is_torch(obj: object) -> bool:
    return type(obj).__module__.split(".", 1)[0] == "torch"


_ARRAY_TYPES: set[type] = set()  # classes already seen to be stored as arrays (tensors)


@functools.cache
def _tensor_leaf_fn() -> Callable[[Any, str], ArrayLeaf]:
    """torch_interop.tensor_leaf, imported when first needed (the only module importing torch)."""
    from . import torch_types as torch_interop

    return torch_interop.tensor_leaf


class TreeEncoder:
    """Walks one state, collecting array leaves. Use once per save."""

    def __init__(self) -> None:
        self.leaves: list[ArrayLeaf] = []
        self._memo: dict[int, int] = {}  # id(obj) -> leaf index, for repeated objects
        self._keepalive: list[object] = []
        self._dotted = False  # some dict key contains a "." (keys may then collide)

    def encode_state(self, state: Any) -> Any:
        """The tree node of a whole state. Raises UnsupportedTypeError if two of its values
        have the same dotted key (`{"a": {"b": x}, "a.b": y}`, `{1: x, "1": y}`): loads by
        key (`into=`, `keys=`) could not tell them apart."""
        tree = self.encode(state)
        if self._dotted:
            check_unique_keys(state)
        return tree

    def encode(self, obj: Any, path: Path = ()) -> Any:
        """The tree node of `obj`; array leaves are appended to `self.leaves`."""
        if len(path) > 200:
            raise UnsupportedTypeError(f"{key_string(path)[:200]}: state nested deeper than 200")
        cls = type(obj)
        if cls is dict:
            return {"dict": self._items(obj, path)}
        if cls in _ARRAY_TYPES:
            return {"tensor": self._array(obj, path)}
        if obj is None:
            return {"none": None}
        if isinstance(obj, np.generic):
            return self._np_scalar(obj, path)
        if isinstance(obj, bool):
            return {"bool": obj}
        if cls is int:
            return {"int": obj}
        if cls is float:
            return {"float": obj.hex()}
        if cls is str:
            return {"str": obj}
        if cls is bytes:
            return {"bytes": self._array(obj, path)}
        if isinstance(obj, (np.ndarray, Shard)) or _is_torch(obj):
            index = self._array(obj, path)
            _ARRAY_TYPES.add(cls)
            return {"tensor": index}
        if cls is OrderedDict:
            items = self._items(obj, path)
            meta = getattr(obj, "_metadata", None)
            if meta is None:
                return {"odict": items}
            # keys in sorted order, as parse_manifest returns them (see parses_back_equal)
            return {"meta": self.encode(meta, (*path, "_metadata")), "odict": items}
        if cls is list:
            return {"list": [self.encode(v, (*path, i)) for i, v in enumerate(obj)]}
        if cls is tuple:
            return {"tuple": [self.encode(v, (*path, i)) for i, v in enumerate(obj)]}
        raise UnsupportedTypeError(
            f"{key_string(path) or '<root>'}: cannot store a value of type "
            f"{cls.__module__}.{cls.__qualname__} (allowed: dict, OrderedDict, list, "
            "tuple, torch tensors, numpy arrays and scalars, None, bool, int, float, str, bytes)")

    def _items(self, obj: dict[Any, Any], path: Path) -> list[Any]:
        items = []
        ints = False
        for k, v in obj.items():
            if type(k) is str:
                key: list[Any] = ["s", k]
                if "." in k:
                    self._dotted = True
            elif type(k) is int:
                key = ["i", k]
                ints = True
            else:
                raise UnsupportedTypeError(
                    f"{key_string(path) or '<root>'}: dict key {k!r:.60} is a "
                    f"{type(k).__name__}; only str and int keys can be stored")
            items.append([key, self.encode(v, (*path, k))])
        if ints:
            same = {str(k) for k in obj if type(k) is int} & {k for k in obj if type(k) is str}
            if same:
                k = sorted(same)[0]
                raise UnsupportedTypeError(
                    f"{key_string(path) or '<root>'}: keys {int(k)} and {k!r} are both "
                    f"written {key_string((*path, k))!r}; rename one of them")
        return items

    def _np_scalar(self, obj: np.generic, path: Path) -> Any:
        dt = dtypes.from_numpy(obj.dtype)
        if dt is None:
            raise UnsupportedTypeError(f"{key_string(path)}: numpy scalar of dtype {obj.dtype} "
                                       "cannot be stored")
        raw = np.asarray(obj).astype(dt.numpy_dtype).tobytes()
        return {"np_scalar": [dt.name, raw.hex()]}

    def _array(self, obj: Any, path: Path) -> int:
        index = self._memo.get(id(obj))
        if index is not None:
            return index
        key = key_string(path)
        if isinstance(obj, bytes):
            leaf = ArrayLeaf(key, "bytes", dtypes.DTYPES["uint8"], np.frombuffer(obj, np.uint8))
        elif isinstance(obj, Shard):
            inner = TreeEncoder()
            inner.encode(obj.data, path)
            if len(inner.leaves) != 1:
                raise UnsupportedTypeError(f"{key}: a Shard must hold a tensor or array")
            leaf = replace(inner.leaves[0], global_shape=obj.global_shape, row_offset=obj.offset,
                           storage_identity=None)
        elif isinstance(obj, np.ndarray):
            leaf = numpy_leaf(obj, key)
        else:
            leaf = _tensor_leaf_fn()(obj, key)
        self.leaves.append(leaf)
        self._memo[id(obj)] = len(self.leaves) - 1
        self._keepalive.append(obj)  # ids stay unique while the encoder lives
        return len(self.leaves) - 1


def check_unique_keys(state: Any) -> None:
    """Raise UnsupportedTypeError if two values (or containers) in `state` have the same
    dotted key. One pass building each key from its parent's; paths only on a collision."""
    seen: set[str] = set()
    stack: list[tuple[Any, str | None]] = [(state, None)]
    while stack:
        obj, key = stack.pop()
        if key is not None:
            if key in seen:
                _raise_collision(state, key)
            seen.add(key)
        if isinstance(obj, dict):
            items: Any = obj.items()
        elif type(obj) in (list, tuple):
            items = enumerate(obj)
        else:
            continue
        stack.extend((v, str(k) if key is None else f"{key}.{k}") for k, v in items)


def _raise_collision(state: Any, key: str) -> None:
    paths = [p for p in _all_paths(state) if key_string(p) == key]
    raise UnsupportedTypeError(
        f"{key!r} names two values, at {list(paths[0])} and {list(paths[1])}: loads by "
        "dotted key could not tell them apart; rename one of them")


def _all_paths(obj: Any, path: Path = ()) -> Iterator[Path]:
    if path:
        yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _all_paths(v, (*path, k))
    elif type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            yield from _all_paths(v, (*path, i))


def numpy_leaf(arr: np.ndarray, key: str) -> ArrayLeaf:
    dt = dtypes.from_numpy(arr.dtype)
    if dt is None:
        raise UnsupportedTypeError(f"{key}: numpy arrays of dtype {arr.dtype} cannot be stored "
                                   "(numeric and bool dtypes only)")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(dt.numpy_dtype)  # stored little-endian
    return ArrayLeaf(key, "numpy", dt, arr.view(dt.numpy_dtype) if arr.ndim else arr.reshape(()))


# ------------------------------------------------------------------------------- decoding
LeafLoader = Callable[[int], Any]


def node_kind(node: dict[str, Any]) -> tuple[str, Any]:
    """(kind, value) of a tree node; 'meta' is an extra field of odict nodes, not a kind."""
    for kind, value in node.items():
        if kind != "meta":
            return kind, value
    raise ValueError("tree node without a kind")


class KeyFilter:
    """The selection `keys=[...]` makes: a dotted key is kept (a call) if it equals one of
    `keys` or lies below one; `reaches(key)` says whether the subtree at a dotted key can hold
    a kept key, so that walks of a large tree skip the rest of it."""

    def __init__(self, keys: Iterable[str]):
        self.wanted = set(keys)
        self._above = {w[:i] for w in self.wanted for i, c in enumerate(w) if c == "."}

    def __call__(self, key: str) -> bool:
        if key in self.wanted:
            return True
        dot = key.find(".")
        while dot >= 0:
            if key[:dot] in self.wanted:
                return True
            dot = key.find(".", dot + 1)
        return False

    def reaches(self, key: str) -> bool:
        return key in self._above or self(key)

    def child_names(self, key: str | None) -> tuple[set[str], set[str]]:
        """For a container at dotted `key` (None: the root) that is not itself kept, the names
        of the children `reaches` accepts, as (exact names, names N such that a child named
        `N.<anything>` is accepted too): what finds them in a container paged by name."""
        prefix = "" if key is None else key + "."
        cut = len(prefix)
        exact = {w[cut:] for w in (*self.wanted, *self._above) if w.startswith(prefix)}
        below = {w[cut:] for w in self.wanted if w.startswith(prefix)}
        return exact, below


def decode(node: Any, load_leaf: LeafLoader, keep: KeyFilter | None = None,
           path: Path = ()) -> Any:
    """Rebuild the state from a validated tree. `load_leaf(i)` returns tensor i's object.
    With `keep`, only leaves whose dotted key passes are kept, and containers left empty by the
    filter are dropped (returned as _DROP to the parent)."""
    kind, value = node_kind(node)
    key = key_string(path) if keep is not None and path else None  # only a filter needs it
    if keep is not None and key is not None and kind in CONTAINERS and not keep.reaches(key):
        return _DROP  # what walking it would give: every leaf dropped
    if kind in ("dict", "odict"):
        out: dict[Any, Any] = OrderedDict() if kind == "odict" else {}
        for k, child in children(kind, value, key, keep):
            if keep is not None and _dropped(keep, key_string((*path, k))):
                continue
            v = decode(child, load_leaf, keep, (*path, k))
            if v is not _DROP:
                out[k] = v
        if keep is not None and not out and value:
            return _DROP
        if kind == "odict" and "meta" in node and (keep is None or out):
            out._metadata = decode(node["meta"], load_leaf, None, (*path, "_metadata"))  # type: ignore[attr-defined]
        return out
    if kind in ("list", "tuple"):
        items = [decode(c, load_leaf, keep, (*path, i))
                 for i, c in children(kind, value, key, keep)
                 if keep is None or not _dropped(keep, key_string((*path, i)))]
        kept = [v for v in items if v is not _DROP]
        if keep is not None and not kept and value:
            return _DROP
        return tuple(kept) if kind == "tuple" else kept
    if keep is not None and not keep(key_string(path)):
        return _DROP
    if kind == "none":
        return None
    if kind in ("bool", "int", "str"):
        return value
    if kind == "float":
        return float.fromhex(value)
    if kind == "np_scalar":
        dt = dtypes.by_name(value[0])
        return np.frombuffer(bytes.fromhex(value[1]), dtype=dt.numpy_dtype)[0].astype(
            dt.numpy_dtype.newbyteorder("="))[()]
    if kind in ("tensor", "bytes"):
        return load_leaf(value)
    raise AssertionError(f"unvalidated tree node {kind}")


def _dropped(keep: KeyFilter, key: str) -> bool:
    """True if `decode` of the child at dotted `key` would return _DROP, decided without
    walking it (a wide dict's unselected children cost a set lookup each): nothing at or
    below `key` can be kept (an empty container there included: a filtered load returns what
    was selected and the containers leading to it, nothing else)."""
    return not keep.reaches(key)


class _Drop:
    def __repr__(self) -> str:
        return "<dropped>"


_DROP: Any = _Drop()


def leaf_paths(node: Any, path: Path = ()) -> dict[int, Path]:
    """Tensor index -> first path it appears at (for naming errors and partial loads)."""
    out: dict[int, Path] = {}
    _collect_paths(node, path, out)
    return out


def _collect_paths(node: Any, path: Path, out: dict[int, Path]) -> None:
    """Add every tensor leaf under `node` not yet in `out`, in depth-first order."""
    kind, value = node_kind(node)
    if kind in ("dict", "odict"):
        for (_t, k), child in value:
            _collect_paths(child, (*path, k), out)
    elif kind in ("list", "tuple"):
        for i, child in enumerate(value):
            _collect_paths(child, (*path, i), out)
    elif kind in ("tensor", "bytes"):
        out.setdefault(value, path)


CONTAINERS = frozenset({"dict", "odict", "list", "tuple"})


def children(kind: str, value: Any, key: str | None = None, keep: KeyFilter | None = None
             ) -> Iterator[tuple[Any, Any]]:
    """(name, child) of a validated container node: dict keys, or list / tuple positions.
    With `keep`, a paged container (tree_pages.PagedItems, at dotted `key`, None for the root)
    gives only the children of the pages that can hold one `keep` reaches: every child
    `keep.reaches` accepts, in order, and maybe others (the caller still tests each)."""
    reaching = None if keep is None else getattr(value, "reaching", None)
    if reaching is not None:
        return iter(reaching(key, keep))
    if kind in ("dict", "odict"):
        return ((k, child) for (_t, k), child in value)
    return enumerate(value)


def leaf_keys(node: Any, keep: KeyFilter | None = None) -> dict[int, str]:
    """Tensor index -> dotted key of the first path it appears at (with `keep`: the first
    path `keep` accepts, so a tensor tied to an unselected key is found by its selected one):
    `key_string` of each `leaf_paths` value, built without keeping a tuple per tensor."""
    out: dict[int, str] = {}
    _each_tensor_leaf(node, None, keep, out.setdefault)
    return out


def tied_keys(node: Any, keep: KeyFilter | None = None) -> dict[int, list[str]]:
    """Tensor index -> every further dotted key it appears at beyond the first (`leaf_keys`),
    for the tensors stored once and referenced from several places of the tree (the same
    object saved under two keys); with `keep`, only keys `keep` accepts."""
    first: dict[int, str] = {}
    out: dict[int, list[str]] = {}

    def visit(index: int, key: str) -> None:
        if index in first:
            out.setdefault(index, []).append(key)
        else:
            first[index] = key

    _each_tensor_leaf(node, None, keep, visit)
    return out


def _each_tensor_leaf(node: Any, key: str | None, keep: KeyFilter | None,
                      visit: Callable[[int, str], Any]) -> None:
    """`visit(tensor index, dotted key)` for every tensor leaf under `node` (at dotted `key`,
    None for the root) that `keep` accepts, in depth-first order; a child `keep` cannot
    reach is not walked."""
    kind, value = node_kind(node)
    if kind in CONTAINERS:
        for name, child in children(kind, value, key, keep):
            child_key = str(name) if key is None else f"{key}.{name}"
            if keep is None:
                # the common leaf (a tensor) visited inline: a call per leaf was most of the walk
                if type(child) is dict and len(child) == 1 and type(
                        index := child.get("tensor")) is int:
                    visit(index, child_key)
                else:
                    _each_tensor_leaf(child, child_key, keep, visit)
            elif keep.reaches(child_key):  # else it holds no accepted leaf
                _each_tensor_leaf(child, child_key, keep, visit)
    elif kind in ("tensor", "bytes"):
        leaf_key = "" if key is None else key
        if keep is None or keep(leaf_key):
            visit(value, leaf_key)


def flatten_arrays(obj: Any, path: Path = ()) -> dict[str, Any]:
    """Dotted key -> tensor/ndarray for every array leaf of a nested state (for `into=`)."""
    out: dict[str, Any] = {}
    _collect_arrays(obj, path, out)
    return out


def _collect_arrays(obj: Any, path: Path, out: dict[str, Any]) -> None:
    """Add the array leaves under `obj` to `out`; a later leaf with the same key wins."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _collect_arrays(v, (*path, k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _collect_arrays(v, (*path, i), out)
    elif type(obj) in _ARRAY_TYPES or isinstance(obj, (np.ndarray, Shard)) or _is_torch(obj):
        out[key_string(path)] = obj
