"""DCP planners that never pickle: DCP's DefaultSavePlanner / DefaultLoadPlanner, except that
non-tensor values are ckptstore plain state (dcp/plain.py) instead of `torch.save` bytes.

* `SavePlanner.transform_object` turns a non-tensor value into a plain-value payload (any
  storage writer can store those bytes; none of them is a pickle). ckptstore's
  StorageWriter does not even ask for the bytes: it takes the value itself
  (`lookup_object`) and stores it as a node of the manifest's state tree.
* `LoadPlanner.load_bytes` accepts only plain-value payloads: bytes another planner
  serialized (a pickle) are refused with FormatError, never unpickled.
  `LoadPlanner.load_value` is what ckptstore's StorageReader calls with the decoded value.

ckptstore's StorageWriter and StorageReader treat DCP's own default planners the same way
when their serialization is not overridden (they take and place the values themselves),
so `dcp.save(state, storage_writer=...)` with no planner stores no pickle either.
"""

from __future__ import annotations

import io
from typing import Any

from ..deps import missing

try:
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner,
        DefaultSavePlanner,
    )
    from torch.distributed.checkpoint.planner import ReadItem, WriteItem, WriteItemType
except ModuleNotFoundError as _exc:
    raise missing(_exc) from None

from ..errors import FormatError
from . import plain


class SavePlanner(DefaultSavePlanner):
    """DCP's DefaultSavePlanner; non-tensor values become plain-value payloads."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(plain.payload(object, write_item.index.fqn))
        return object


class LoadPlanner(DefaultLoadPlanner):
    """DCP's DefaultLoadPlanner; non-tensor values are read from plain state only."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        data = value.getvalue() if isinstance(value, io.BytesIO) else value.read()
        if not plain.is_payload(data):
            raise FormatError(
                f"{fqn}: the checkpoint holds this value as bytes another planner serialized "
                "(a pickle, for DCP's default planner); ckptstore.dcp.LoadPlanner never "
                "unpickles. Load it with a planner that reads those bytes (DCP's "
                "DefaultLoadPlanner unpickles them) only if you trust the checkpoint")
        self.load_value(read_item, plain.from_payload(data, fqn))

    def load_value(self, read_item: ReadItem, value: Any) -> None:
        """Place a decoded non-tensor value where DCP's default planner would."""
        place_value(self, read_item, value)


def place_value(planner: DefaultLoadPlanner, read_item: ReadItem, value: Any) -> None:
    """What DefaultLoadPlanner.load_bytes does with the value it unpickled."""
    fqn = read_item.dest_index.fqn
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value


def plain_lookup(planner: Any) -> bool:
    """True when a save planner's values may be taken as they are (`lookup_object`) instead
    of serialized: DCP's default planner, or ours, with resolve_data and transform_object as
    DCP wrote them."""
    cls = type(planner)
    return (isinstance(planner, DefaultSavePlanner)
            and cls.resolve_data is DefaultSavePlanner.resolve_data
            and cls.transform_object in (DefaultSavePlanner.transform_object,
                                         SavePlanner.transform_object))


def plain_place(planner: Any) -> bool:
    """True when decoded values may be placed directly (`place_value`) instead of handed
    over as bytes: DCP's default load planner with its own load_bytes, or ours."""
    return isinstance(planner, LoadPlanner) or (
        isinstance(planner, DefaultLoadPlanner)
        and type(planner).load_bytes is DefaultLoadPlanner.load_bytes)
