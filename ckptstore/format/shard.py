"""Plain per-rank shards: a process that holds only some rows of a tensor says so with Shard.

    ckptstore.Shard(local_rows_tensor, offset=rank * rows, global_shape=(n, d))

Saving (multi-rank, through CheckpointManager) stores one tensor of `global_shape` whose rows
come from every rank's shard; loading `into=` a Shard reads only the chunks holding its rows,
whatever number of ranks wrote them. Sharding is along dim 0 only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedTypeError


@dataclass(frozen=True)
class Shard:
    """Rows [offset, offset + len(data)) of dim 0 of a tensor of shape `global_shape`."""

    data: Any  # a torch.Tensor or numpy.ndarray holding the local rows
    offset: int
    global_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        shape = tuple(getattr(self.data, "shape", ()))
        gshape = tuple(int(s) for s in self.global_shape)
        object.__setattr__(self, "global_shape", gshape)
        if not shape or len(shape) != len(gshape) or shape[1:] != gshape[1:]:
            raise UnsupportedTypeError(
                f"Shard of shape {shape} does not fit global shape {gshape} (rows of dim 0)")
        if not 0 <= self.offset or self.offset + shape[0] > gshape[0]:
            raise UnsupportedTypeError(f"Shard rows [{self.offset}, {self.offset + shape[0]}) "
                                       f"outside the global {gshape[0]} rows")

    @property
    def rows(self) -> tuple[int, int]:
        return (self.offset, self.offset + int(self.data.shape[0]))
