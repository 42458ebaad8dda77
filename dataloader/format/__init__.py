"""What is stored: the dataset index (``dataset.json``), its fields and arrays, and the bytes of
the zarr objects. Imports flow down this list only:

    validate.py       checks of untrusted JSON (exact ints, key sets, capped reads)
    spec.py           the layout: names, kinds, dtypes, limits, partition prefixes
    arrays.py         ArrayInfo and ShardInfo (and their check against zarr.json)
    fields.py         FieldInfo
    index.py          DatasetIndex: parse, validate, fingerprint, load
    zarr_encoding.py  the bytes of shards and zarr.json, as zarr-python stores them
    zarr_adapter.py   a zarr-python store over a ckptstore Store (imports zarr; not imported
                      here)

Depends only on ckptstore (`errors`, `stores`, `toolkit`).
"""

from __future__ import annotations

from .arrays import ArrayInfo, ShardInfo
from .fields import FieldInfo
from .index import DatasetIndex, load_index
from .spec import INDEX_KEY, MAX_INDEX_BYTES

__all__ = [
    "INDEX_KEY", "MAX_INDEX_BYTES", "ArrayInfo", "DatasetIndex", "FieldInfo", "ShardInfo",
    "load_index",
]  # fmt: skip
