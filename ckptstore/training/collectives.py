"""JSON values and integer vectors over a torch.distributed group, without pickle: the
messages of the collective saves (training/distributed.py, training/rank_save.py).

JSON travels as uint8 tensors (canonical JSON), its length first; every call is a
collective: each rank of `group` makes the same calls in the same order. A call that fails
in the transport (a rank died or left: gloo's "Connection reset by peer", a timeout) raises
CollectiveError naming the exchange, not the backend's bare RuntimeError."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from ..deps import missing

try:
    import torch
    import torch.distributed as dist
except ModuleNotFoundError as _exc:
    raise missing(_exc) from None

from ..errors import CollectiveError
from ..format.canonical import canonical_json

P = ParamSpec("P")
R = TypeVar("R")


def _exchange(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, its transport failures raised as CollectiveError."""
    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:
            raise CollectiveError(
                f"an exchange between the ranks ({fn.__name__}) failed: a rank died, left the "
                f"group or timed out ({type(exc).__name__}: {str(exc)[:300]})") from exc
    return call


def _as_tensor(data: bytes, size: int) -> torch.Tensor:
    buf = torch.zeros(size, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


@_exchange
def all_gather_json(obj: Any, group: Any) -> list[Any]:
    """All-gather one JSON value per rank: every rank receives every rank's, padded to the
    longest (bytes received per rank: world x the longest)."""
    data = canonical_json(obj)
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, _as_tensor(data, longest), group=group)
    return [json.loads(bytes(b[: int(s.item())].numpy())) for b, s in zip(bufs, sizes)]


@_exchange
def gather_json(obj: Any, group: Any, dst: int = 0) -> list[Any] | None:
    """Gather one JSON value per rank on rank `dst` (group rank) only: the list there, None
    elsewhere. Rank `dst` receives world x the longest value."""
    data = canonical_json(obj)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    longest = size.clone()
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
    n = int(longest.item())
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)] if rank == dst else None
    dist.gather(size, sizes, dst=dist.get_global_rank(group, dst), group=group)
    bufs = [torch.zeros(n, dtype=torch.uint8) for _ in range(world)] if rank == dst else None
    dist.gather(_as_tensor(data, n), bufs, dst=dist.get_global_rank(group, dst), group=group)
    if bufs is None or sizes is None:
        return None
    return [json.loads(bytes(b[: int(s.item())].numpy())) for b, s in zip(bufs, sizes)]


@_exchange
def broadcast_json(obj: Any, group: Any, src: int = 0) -> Any:
    """Broadcast rank `src`'s JSON value to every rank (other ranks pass anything)."""
    data = canonical_json(obj) if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = _as_tensor(data, int(size.item()))
    dist.broadcast(buf, src=src, group=group)
    return json.loads(bytes(buf.numpy()))


@_exchange
def all_reduce_ints(values: list[int], group: Any, op: str = "max") -> list[int]:
    """The element-wise max (or min) of an int64 vector over every rank."""
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN,
                    group=group)
    return [int(v) for v in t.tolist()]


@_exchange
def all_to_all_bytes(parts: list[bytes], group: Any) -> list[bytes]:
    """Send `parts[r]` to rank r, receive what every rank sent this one (in rank order):
    one exchange of the sizes, one of the bytes."""
    world = dist.get_world_size(group)
    sizes = torch.tensor([len(p) for p in parts], dtype=torch.int64)
    got = torch.zeros(world, dtype=torch.int64)
    dist.all_to_all_single(got, sizes, group=group)
    out_sizes = [int(n) for n in got.tolist()]
    data = b"".join(parts)
    send = _as_tensor(data, len(data))
    recv = torch.zeros(sum(out_sizes), dtype=torch.uint8)
    dist.all_to_all_single(recv, send, out_sizes, [len(p) for p in parts], group=group)
    raw = bytes(recv.numpy())
    out, at = [], 0
    for n in out_sizes:
        out.append(raw[at:at + n])
        at += n
    return out
