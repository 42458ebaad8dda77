"""Wide containers of a version-3 state tree, stored as pages (docs/format.md §3.5).

A container with more than `PAGED_ABOVE` children (a model's state dict, an optimizer's
`state`, a parameter group's `params` list) is written as a *paged node*: its children sorted
by name (the dotted-key part: a dict key, a list position) and cut into pages of `PAGE_ITEMS`,
each page a blob of its own, the node naming each page's first name. A partial restore then
reads only the pages that can hold a requested key (found by bisecting those first names),
not the whole tree.

On read, `PageSet.resolve` replaces a paged node's descriptor by a `PagedItems`: a sequence
that behaves as the container's list of children (every page read, in the original order,
when iterated) and answers `reaching(key, keep)` from the pages a key filter can reach.

Writer: `paginate`. Reader: `PageSet` (given to `check_tree`), `PagedItems`, `page_loads`.
"""

from __future__ import annotations

import bisect
import functools
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from ..collector import paused_collector
from ..concurrency import outcome, read_ahead
from ..errors import FormatError
from .canonical import canonical_str, reject_constant
from .hashing import is_digest
from .segment_encoding import TreeRef
from .tree import CONTAINERS, KeyFilter, node_kind

#: a container with more children than this is paged (a version-3 tree only)
PAGED_ABOVE = 1024
#: children per page (the last page of a container may hold fewer)
PAGE_ITEMS = 512
#: pages fetched side by side by a read of many pages of one container
PAGE_READ_AHEAD = 8
_DICTS = ("dict", "odict")
_DESCRIPTOR_FIELDS = frozenset({"kind", "count", "pages"})
_PAGE_FIELDS = frozenset({"first", "count", "digest", "size"})

Digest = Callable[[bytes], str]
PageBlob = tuple[TreeRef, bytes]


def child_name(kind: str, item: Any, position: int) -> str:
    """The dotted-key part of a container's child: its dict key as a string, or its list
    position. Siblings' names are unique (the encoder refuses `{1: x, "1": y}`)."""
    return str(item[0][1]) if kind in _DICTS else str(position)


# ------------------------------------------------------------------------------- writing
def paginate(tree: Any, digest: Digest, above: int = PAGED_ABOVE, per_page: int = PAGE_ITEMS
             ) -> tuple[Any, list[PageBlob]]:
    """`tree` with every container of more than `above` children replaced by its paged node,
    and the page blobs (each distinct page once, a nested page before the page naming it).
    Nodes without a wide container below them are shared with `tree`, not copied."""
    pages: dict[str, PageBlob] = {}
    out = _paged(tree, digest, above, per_page, pages)
    return out, list(pages.values())


def _is_plain_leaf(node: Any) -> bool:
    return type(node) is dict and len(node) == 1 and ("tensor" in node or "int" in node)


def _paged(node: Any, digest: Digest, above: int, per_page: int,
           pages: dict[str, PageBlob]) -> Any:
    if _is_plain_leaf(node):
        return node
    kind, value = node_kind(node)
    if kind not in CONTAINERS:
        return node
    dicts = kind in _DICTS
    changed = False
    items = []
    for item in value:
        child = item[1] if dicts else item
        new = child if _is_plain_leaf(child) else _paged(child, digest, above, per_page, pages)
        if new is not child:
            changed = True
            item = [item[0], new] if dicts else new
        items.append(item)
    meta = node.get("meta")
    new_meta = None if meta is None else _paged(meta, digest, above, per_page, pages)
    if len(items) <= above:
        if not changed and new_meta is meta:
            return node
        out: dict[str, Any] = {kind: items}
    else:
        out = {"paged": _descriptor(kind, items, digest, per_page, pages)}
    if new_meta is not None:
        out["meta"] = new_meta
    return out


def _descriptor(kind: str, items: list[Any], digest: Digest, per_page: int,
                pages: dict[str, PageBlob]) -> dict[str, Any]:
    dicts = kind in _DICTS
    names = [child_name(kind, item, i) for i, item in enumerate(items)]
    order = sorted(range(len(items)), key=names.__getitem__)
    listed = []
    for start in range(0, len(order), per_page):
        part = order[start:start + per_page]
        rows = [[i, items[i][0], items[i][1]] if dicts else [i, items[i]] for i in part]
        data = canonical_str({"items": rows, "kind": kind}).encode()
        ref = TreeRef(digest(data), len(data))
        pages.setdefault(ref.digest, (ref, data))
        listed.append({"count": len(part), "digest": ref.digest, "first": names[part[0]],
                       "size": ref.size})
    return {"count": len(items), "kind": kind, "pages": listed}


# ------------------------------------------------------------------------------- reading
Check = Callable[[Any, int, int, "PageSet"], None]  # check_tree(node, n_tensors, depth, pages)


@dataclass(frozen=True)
class _Page:
    first: str
    count: int
    ref: TreeRef


class PageSet:
    """The pages of one version-3 tree: `refs` as its root lists them, read through `source`
    (which checks each blob's digest) and validated with `check` (manifest_parse.check_tree)
    when first needed. A paged node naming a page outside `refs` is refused."""

    def __init__(self, refs: Sequence[TreeRef], source: Callable[[TreeRef], bytes],
                 n_tensors: int, where: str, check: Check) -> None:
        self.refs = {r.digest: r for r in refs}
        self._source = source
        self.n_tensors = n_tensors
        self.where = where
        self._check = check

    def resolve(self, node: dict[str, Any], depth: int) -> None:
        """Validate the paged node `node` (a `{"paged": ...}` node at `depth`) and turn it, in
        place, into `{kind: PagedItems}` (keeping its "meta")."""
        d = node["paged"]
        if not isinstance(d, dict) or set(d) != _DESCRIPTOR_FIELDS:
            raise FormatError(f"paged tree node must have the fields {sorted(_DESCRIPTOR_FIELDS)}")
        kind, count, listed = d["kind"], d["count"], d["pages"]
        if kind not in CONTAINERS:
            raise FormatError(f"paged tree node of kind {kind!r:.40}")
        if set(node) - {"paged", "meta"} or ("meta" in node and kind != "odict"):
            raise FormatError("paged tree node has unknown fields")
        if type(count) is not int or count < 1 or not isinstance(listed, list) or not listed:
            raise FormatError("paged tree node must hold a count >= 1 and its pages")
        pages = [self._page_entry(p) for p in listed]
        if sum(p.count for p in pages) != count:
            raise FormatError("paged tree node: its pages' counts do not add up to its count")
        if any(a.first >= b.first for a, b in zip(pages, pages[1:])):
            raise FormatError("paged tree node: its pages are not in order of their names")
        del node["paged"]
        node[kind] = PagedItems(self, kind, count, pages, depth)

    def _page_entry(self, p: Any) -> _Page:
        if not isinstance(p, dict) or set(p) != _PAGE_FIELDS:
            raise FormatError(f"tree page entry must have the fields {sorted(_PAGE_FIELDS)}")
        first, count, digest, size = p["first"], p["count"], p["digest"], p["size"]
        if not (isinstance(first, str) and type(count) is int and count >= 1
                and isinstance(digest, str) and is_digest(digest) and type(size) is int):
            raise FormatError(f"tree page entry {p!r:.120} is malformed")
        ref = self.refs.get(digest)
        if ref is None or ref.size != size:
            raise FormatError(f"tree page {digest} is not listed by the manifest root")
        return _Page(first, count, ref)

    def read(self, items: PagedItems, j: int) -> list[tuple[int, str, Any]]:
        """Page `j` of `items`: (position, name, item) rows, validated."""
        return self.decode(items, j, self.fetch(items, j))

    def fetch(self, items: PagedItems, j: int) -> bytes:
        """The bytes of page `j` of `items`, matched to its digest (not yet validated)."""
        return self._source(items.pages[j].ref)

    def decode(self, items: PagedItems, j: int, data: bytes) -> list[tuple[int, str, Any]]:
        """Page `j` of `items` from its fetched bytes: (position, name, item) rows, validated."""
        page = items.pages[j]
        upper = items.pages[j + 1].first if j + 1 < len(items.pages) else None
        try:
            with paused_collector():
                doc = json.loads(data.decode("utf-8"), parse_constant=reject_constant)
                return self._rows(doc, items, page, upper)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise FormatError(f"{self.where}: state tree page {page.ref.digest}: {exc}"
                              ) from None

    def _rows(self, doc: Any, items: PagedItems, page: _Page, upper: str | None
              ) -> list[tuple[int, str, Any]]:
        if not isinstance(doc, dict) or set(doc) != {"items", "kind"} or \
                doc["kind"] != items.kind or not isinstance(doc["items"], list):
            raise FormatError(f"not a {items.kind} page")
        if len(doc["items"]) != page.count:
            raise FormatError(f"holds {len(doc['items'])} items, its node says {page.count}")
        dicts = items.kind in _DICTS
        rows = []
        prev: str | None = None
        for row in doc["items"]:
            if not isinstance(row, list) or len(row) != (3 if dicts else 2):
                raise FormatError("a page item must be [position, key, node] (dicts) or "
                                  "[position, node] (lists)")
            pos = row[0]
            if type(pos) is not int or not 0 <= pos < items.length:
                raise FormatError(f"item position {pos!r:.40} out of range")
            item = [row[1], row[2]] if dicts else row[1]
            if dicts:  # the key's form is checked with the item, as in an unpaged dict
                self._check({"dict": [item]}, self.n_tensors, items.depth, self)
            else:
                self._check(item, self.n_tensors, items.depth + 1, self)
            name = child_name(items.kind, item, pos)
            if (prev is None and name != page.first) or (prev is not None and name <= prev) \
                    or (upper is not None and name >= upper):
                raise FormatError(f"item {name!r:.60} is out of order")
            prev = name
            rows.append((pos, name, item))
        return rows



class PagedItems(Sequence[Any]):
    """A paged container's children, as the list an unpaged node holds (`[key, node]` items
    for dicts, nodes for lists): iterating or indexing reads every page. `reaching` reads only
    the pages a key filter can reach. Pages are read once, when first needed; a page that
    cannot be read raises FormatError from the access that needed it (and is tried again by
    the next). Thread-safe."""

    def __init__(self, pageset: PageSet, kind: str, count: int, pages: list[_Page],
                 depth: int) -> None:
        self.kind = kind
        self.length = count
        self.pages = pages
        self.depth = depth
        self._set = pageset
        self._firsts = [p.first for p in pages]
        self._rows: dict[int, list[tuple[int, str, Any]]] = {}
        self._all: list[Any] | None = None
        self._reached: tuple[KeyFilter, str | None, list[tuple[Any, Any]]] | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.length

    def read_page(self, j: int) -> list[tuple[int, str, Any]]:
        """Page `j` as `page` gives it, but not kept (unless `page` kept it already): for one
        pass over every page of many checkpoints (verify)."""
        got = self._rows.get(j)
        return got if got is not None else self._set.read(self, j)

    def pages_read_ahead(self) -> Iterator[Callable[[], list[tuple[int, str, Any]]]]:
        """For each page in order, a call that gives it as `read_page` does (not kept) or
        raises why it cannot; the pages not kept are fetched PAGE_READ_AHEAD ahead of the one
        taken (a store's round trips overlap) and decoded by their call, on its thread."""
        kept = set(self._rows)
        fetches = [functools.partial(outcome, functools.partial(self._set.fetch, self, j))
                   for j in range(len(self.pages)) if j not in kept]
        with closing(read_ahead(fetches, PAGE_READ_AHEAD)) as fetched:
            for j in range(len(self.pages)):
                yield (functools.partial(self.read_page, j) if j in kept else
                       functools.partial(self._decoded, j, next(fetched)))

    def _decoded(self, j: int, data: Callable[[], bytes]) -> list[tuple[int, str, Any]]:
        return self._set.decode(self, j, data())

    def page(self, j: int) -> list[tuple[int, str, Any]]:
        got = self._rows.get(j)
        if got is None:
            with self._lock:
                got = self._rows.get(j)
                if got is None:
                    got = self._rows[j] = self._set.read(self, j)
        return got

    def _read_pages(self, wanted: Sequence[int]) -> None:
        """Read and keep the pages among `wanted` not read yet: fetched PAGE_READ_AHEAD at a
        time (a store's round trips overlap), each validated on the calling thread as it
        arrives. A page that cannot be read raises here; those before it are kept."""
        todo = [j for j in wanted if j not in self._rows]
        if len(todo) <= 1:
            return  # `page` reads it when needed
        with closing(read_ahead([functools.partial(self._set.fetch, self, j) for j in todo],
                                PAGE_READ_AHEAD)) as fetched:
            for j in todo:
                rows = self._set.decode(self, j, next(fetched))
                with self._lock:
                    self._rows.setdefault(j, rows)

    def _everything(self) -> list[Any]:
        got = self._all
        if got is None:
            self._read_pages(range(len(self.pages)))
            ordered: list[Any] = [None] * self.length
            seen = 0
            for j in range(len(self.pages)):
                for pos, _name, item in self.page(j):
                    if ordered[pos] is None:
                        seen += 1
                    ordered[pos] = item
            if seen != self.length:
                raise FormatError(f"{self._set.where}: a paged tree node's items do not hold "
                                  "every position once")
            got = self._all = ordered
        return got

    def __iter__(self) -> Iterator[Any]:
        return iter(self._everything())

    def __getitem__(self, i: Any) -> Any:
        return self._everything()[i]

    def __repr__(self) -> str:
        return f"PagedItems({self.kind}, {self.length} children in {len(self.pages)} pages)"

    def reaching(self, key: str | None, keep: KeyFilter) -> list[tuple[Any, Any]]:
        """(name, child) of the children under this container (at dotted `key`, None for the
        root) on the pages that can hold a child `keep` reaches, in the container's order:
        every child `keep.reaches` accepts, and others from the same pages (callers filter)."""
        cached = self._reached
        if cached is not None and cached[0] is keep and cached[1] == key:
            return cached[2]  # the walks of one load ask the same question several times
        got = self._reaching(key, keep)
        self._reached = (keep, key, got)
        return got

    def _reaching(self, key: str | None, keep: KeyFilter) -> list[tuple[Any, Any]]:
        dicts = self.kind in _DICTS
        if key is not None and keep(key):
            wanted: Sequence[int] = range(len(self.pages))
        else:
            exact, below = keep.child_names(key)
            found: set[int] = set()
            for name in exact:
                j = bisect.bisect_right(self._firsts, name) - 1
                if j >= 0:
                    found.add(j)
            for name in below:  # children named `name.<anything>`
                lo = max(0, bisect.bisect_right(self._firsts, name + ".") - 1)
                hi = bisect.bisect_left(self._firsts, name + "/")  # "/" follows "."
                found.update(range(lo, hi))
            wanted = sorted(found)
        if len(wanted) == len(self.pages):  # every page: the container's own order
            return [(item[0][1], item[1]) if dicts else (pos, item)
                    for pos, item in enumerate(self._everything())]
        self._read_pages(wanted)
        rows = sorted((row for j in wanted for row in self.page(j)), key=lambda r: r[0])
        return [(item[0][1], item[1]) if dicts else (pos, item) for pos, _n, item in rows]


def page_loads(tree: Any) -> Iterator[tuple[TreeRef, Callable[[], Any]]]:
    """(page, read it) for every page of a resolved tree, depth first, a nested page after the
    page that names it (found once the caller read that page); for checking every page
    (verify). Pages read this way are not kept. A page not read, or whose read failed, hides
    the pages below it."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if "meta" in node:
            stack.append(node["meta"])
        kind, value = node_kind(node)
        if kind not in CONTAINERS:
            continue
        dicts = kind in _DICTS
        if not isinstance(value, PagedItems):
            stack.extend(item[1] if dicts else item for item in value)
            continue
        for page, read in zip(value.pages, value.pages_read_ahead()):
            rows: list[tuple[int, str, Any]] = []
            yield page.ref, functools.partial(_read_into, read, rows)
            stack.extend(item[1] if dicts else item for _pos, _name, item in rows)


def _read_into(read: Callable[[], list[tuple[int, str, Any]]],
               rows: list[tuple[int, str, Any]]) -> list[tuple[int, str, Any]]:
    rows[:] = read()
    return rows
