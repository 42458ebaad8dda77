"""Tokens mode: documents (a 1-D integer field, or fixed rows of tokens) packed into
fixed-length sequences, with document boundaries for the model.

Within each window the documents are taken in the window's shuffled order, concatenated and
cut into `seq_len`-token sequences; the window's remainder (< seq_len tokens) is dropped
(`remainder='drop'`) or padded with `pad_id` into one last sequence (`'pad'`). Items are these
sequences, so the number of items per window follows from the token counts the dataset index
records per block: the epoch's item order, the partition over ranks and the state work exactly
as for samples (resume is exact, on any number of ranks or workers, without reading consumed
data). Batches carry ``tokens`` (B, L), ``position_ids`` (B, L) (restarting at every document
start and sequence start), ``cu_seqlens`` (int32 boundaries over the flattened batch, as
FlashAttention's varlen kernels take them) and ``max_seqlen``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ckptstore.stores import Store

from ..format.validate import INT64_MAX, check_int
from ..order.epoch import EpochOrder
from ..read.views import TokenView, finish_tokens
from .dataset import StreamingDataset


class TokenDataset(StreamingDataset):
    """A StreamingDataset whose items are packed token sequences of `seq_len`."""

    kind = "dataset"
    full_shuffle_supported = False  # sequences are packed from a window's whole documents

    def __init__(
        self,
        uri: str | Store,
        seq_len: int,
        *,
        field: str = "tokens",
        remainder: str = "drop",
        pad_id: int = 0,
        **options: Any,
    ) -> None:
        seq_len = check_int(seq_len, "seq_len", 1, INT64_MAX, ValueError)
        if not isinstance(pad_id, int | np.integer) or isinstance(pad_id, bool):
            raise ValueError(f"pad_id: expected an int, got {pad_id!r:.40}")
        if remainder not in ("drop", "pad"):
            raise ValueError(f"remainder must be 'drop' or 'pad', got {remainder!r}")
        if "fields" in options:
            raise TypeError("TokenDataset reads only its token field; use field=")
        super().__init__(uri, fields=[field], **options)
        f = self.fields[0]
        if (
            np.dtype(f.dtype).kind not in "iu"
            or f.kind not in ("ragged", "fixed")
            or f.ndim != 1
        ):
            raise ValueError(
                f"field {field!r} ({f.kind}, {f.dtype}, ndim {f.ndim}) is not a 1-D"
                " integer token field"
            )
        info = np.iinfo(np.dtype(f.dtype))
        if not info.min <= pad_id <= info.max:
            raise ValueError(f"pad_id {pad_id} does not fit the {f.dtype} tokens of {field!r}")
        self.seq_len, self.token_field = seq_len, field
        self.remainder, self.pad_id = remainder, int(pad_id)
        rows = self.index.block_rows()
        if f.kind == "fixed":
            assert f.shape is not None
            self._block_tokens = rows * math.prod(f.shape)
        else:
            assert f.block_bounds is not None
            self._block_tokens = np.diff(np.asarray(f.block_bounds, dtype=np.int64))

    def order_options(self) -> dict[str, Any]:
        return {
            **super().order_options(),
            "mode": "tokens",
            "field": self.token_field,
            "seq_len": self.seq_len,
            "remainder": self.remainder,
            "pad_id": self.pad_id,
        }

    def item_fields(self) -> dict[str, str]:
        """The token field as items carry it: `seq_len` tokens of its dtype."""
        dtype = np.dtype(self.fields[0].dtype).name
        return {self.token_field: f"{dtype} tokens, seq_len {self.seq_len}"}

    def _items_fn(self) -> Any:
        L, pad = self.seq_len, self.remainder == "pad"

        def items(windows: list[np.ndarray]) -> np.ndarray:
            tokens = np.array([int(self._block_tokens[w].sum()) for w in windows], dtype=np.int64)
            return tokens // L + ((tokens % L > 0) if pad else 0)

        return items

    @property
    def num_tokens(self) -> int:
        return int(self._block_tokens.sum())

    def make_view(self, order: EpochOrder, w: int, blocks: list[int], data: list[Any]) -> Any:
        n = int(self.index.block_rows()[blocks].sum())
        return TokenView(
            self.fields[0],
            data,
            order.sample_perm(w, n),
            self.seq_len,
            int(order.window_items[w]),
            int(order.item_starts[w]),
            self.pad_id,
        )

    def finish_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        return finish_tokens(batch)
