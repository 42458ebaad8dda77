"""Everything that touches torch: tensors to raw byte views and back. The only module of the core
that imports torch; it is imported lazily, the first time a torch object is met."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..deps import missing
from ..errors import UnsupportedTypeError

try:
    import torch
except ModuleNotFoundError as _exc:
    raise missing(_exc) from None
from . import dtypes
from .leaf import ArrayLeaf
from .manifest import TensorEntry
from .regions import Runs

# torch dtypes numpy lacks are viewed as unsigned ints of the same width
_BITS_VIEW = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


def _dtype_table() -> dict[torch.dtype, tuple[dtypes.DType, torch.dtype | None]]:
    """torch dtype -> (its DType, the unsigned type its bits are viewed as when numpy lacks it,
    else None), for every storable dtype this torch build has."""
    table = {}
    for name, dt in dtypes.DTYPES.items():
        tdt = getattr(torch, name, None)
        if isinstance(tdt, torch.dtype):
            table[tdt] = (dt, None if dt.numpy_native else _BITS_VIEW[tdt.itemsize])
    return table


_DTYPES = _dtype_table()


def _torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise UnsupportedTypeError(f"this torch build has no dtype {name}")
    return dt


def dtype_name(dt: torch.dtype) -> str | None:
    """ckptstore's name of a torch dtype, or None if it cannot be stored."""
    info = _DTYPES.get(dt)
    return None if info is None else info[0].name


def raw_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a CPU tensor's element bits, same shape and strides."""
    info = _DTYPES.get(t.dtype)
    assert info is not None
    if info[1] is not None:
        t = t.view(info[1])
    return t.numpy()


def tensor_leaf(t: Any, key: str) -> ArrayLeaf:
    """Describe a tensor for saving. The leaf views the tensor's memory when it is on the CPU;
    other devices are copied to the CPU here."""
    cls = type(t)
    if cls is not torch.Tensor and not isinstance(t, torch.Tensor):
        kind = f"{cls.__module__}.{cls.__qualname__}"
        raise UnsupportedTypeError(f"{key}: cannot store {kind}")
    if t.layout != torch.strided or t.is_quantized or t.is_meta:
        raise UnsupportedTypeError(f"{key}: only dense strided tensors can be stored "
                                   f"(got layout {t.layout}, quantized={t.is_quantized})")
    info = _DTYPES.get(t.dtype)
    if info is None:
        raise UnsupportedTypeError(f"{key}: tensors of dtype {t.dtype} cannot be stored")
    requires_grad = bool(t.requires_grad)
    if cls is torch.Tensor:  # the common case: no Parameter, no DTensor, nothing to detach
        parameter = False
        base = t.detach() if requires_grad else t
    else:
        parameter = isinstance(t, torch.nn.Parameter)
        local = dtensor_local(t, key)
        if local is not None:
            return _dtensor_leaf(local, key, requires_grad, parameter)
        base = t.detach()
    if base.is_conj():
        base = base.resolve_conj()
    if base.is_neg():
        base = base.resolve_neg()
    if not base.is_cpu:
        base = base.cpu()
    array = raw_numpy(base)
    storage = base.untyped_storage()
    return ArrayLeaf(
        key=key, kind="torch", dtype=info[0], array=array,
        requires_grad=requires_grad, parameter=parameter,
        storage_identity=(storage.data_ptr(), storage.nbytes()) if array.size else None,
        storage_offset=base.storage_offset(), storage_stride=tuple(base.stride()),
    )


def _dtensor_leaf(local: tuple[torch.Tensor, Runs | None, tuple[int, ...]],
                  key: str, requires_grad: bool, parameter: bool) -> ArrayLeaf:
    """The leaf of a DTensor's local part: where it lies in the global tensor when sharded."""
    tensor, runs, global_shape = local
    leaf = tensor_leaf(tensor, key)
    leaf.requires_grad, leaf.parameter = requires_grad, parameter
    if runs is not None:
        leaf.global_shape, leaf.region_runs = global_shape, runs
        leaf.row_offset = runs[0][0][1] if runs and runs[0] else 0
        leaf.storage_identity = None
    return leaf


def dtensor_local(t: Any, key: str) -> tuple[torch.Tensor, Runs | None, tuple[int, ...]] | None:
    """For a DTensor: (local tensor, where it lies in the global tensor as per-dim runs
    (format/regions.py) or None when it holds the whole tensor, global shape). None for any
    other tensor.

    Any device mesh, any mix of Shard(d), Replicate() and strided shards (FSDP2 over tensor
    parallelism), several mesh dims sharding one tensor dim, uneven splits: the global
    indexes of the local part are what torch itself computes, mesh dim after mesh dim
    (torch.distributed.tensor._utils, as its compute_local_shape_and_global_offset does).
    Partial() raises UnsupportedTypeError saying what to do."""
    cls = type(t)
    if cls.__name__ != "DTensor" or not cls.__module__.startswith("torch.distributed"):
        return None
    from torch.distributed.tensor import Partial, Replicate

    placements = tuple(t.placements)
    mesh = t.device_mesh
    global_shape = tuple(int(s) for s in t.shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial):
            raise UnsupportedTypeError(
                f"{key}: DTensor placement {p} on mesh dim {mesh_dim} holds unreduced partial "
                "values, which a checkpoint can neither store nor fill; reduce them first, "
                "e.g. t.redistribute(t.device_mesh, [Replicate() or Shard(d) per mesh dim])")
        if not isinstance(p, (*_shard_types(), Replicate)):
            raise UnsupportedTypeError(
                f"{key}: DTensor placement {p!r} on mesh dim {mesh_dim} is not supported; "
                "redistribute to Shard(d) or Replicate() placements before saving or loading")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UnsupportedTypeError(f"{key}: this rank is not part of the DTensor's device mesh")
    local = t.to_local()
    runs = _local_runs(global_shape, tuple(mesh.shape), coordinate, placements)
    shape = tuple(sum(n for _l, _g, n in r) for r in runs)
    if shape != tuple(local.shape):
        raise UnsupportedTypeError(f"{key}: DTensor local tensor of shape {tuple(local.shape)} "
                                   f"differs from its placements' local shape {shape}")
    if runs == tuple(((0, 0, n),) if n else () for n in global_shape):
        return local, None, global_shape
    return local, runs, global_shape


def _tensor_runs(index: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
    """`index_runs` of a 1-D index tensor, without a Python loop over its elements."""
    index = index.reshape(-1).to(torch.int64)
    breaks = (torch.nonzero(index[1:] - index[:-1] != 1).reshape(-1) + 1).tolist()
    starts = [0, *breaks]
    stops = [*breaks, int(index.numel())]
    return tuple((a, int(index[a]), b - a) for a, b in zip(starts, stops))


def _shard_types() -> tuple[type, ...]:
    """Shard and, where this torch has it, _StridedShard (not a Shard subclass)."""
    from torch.distributed.tensor import Shard as DShard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return (DShard,)
    return (DShard, _StridedShard)


def _local_runs(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                coordinate: Any, placements: tuple[Any, ...]) -> Runs:
    """Per dim, the runs of global indexes this mesh coordinate holds."""
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets

    sizes = list(global_shape)
    indexes: dict[int, Any] = {}
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, _shard_types()):
            continue
        p: Any = placement
        d = p.dim
        size, index = _get_shard_size_and_offsets(
            sizes[d], mesh_shape[mesh_dim], int(coordinate[mesh_dim]), p, indexes.get(d),
            global_shape[d], False)
        sizes[d] = int(size)
        indexes[d] = index
    runs: list[tuple[tuple[int, int, int], ...]] = []
    for d, n in enumerate(global_shape):
        if sizes[d] == 0:
            runs.append(())
        elif d in indexes:
            runs.append(_tensor_runs(indexes[d]))
        else:
            runs.append(((0, 0, n),))
    return tuple(runs)


def byte_view(t: torch.Tensor) -> np.ndarray | None:
    """A writable flat uint8 view of a CPU tensor's bytes if it is contiguous, else None."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    if t.numel() == 0:
        return np.empty(0, np.uint8)
    return raw_numpy(t.detach()).reshape(-1).view(np.uint8)


class TorchMaterializer:
    """Creates torch tensors for one load, rebuilding shared storages (tied weights)."""

    def __init__(self) -> None:
        self._storages: dict[int, torch.UntypedStorage] = {}

    def new(self, entry: TensorEntry) -> tuple[Any, np.ndarray, Any]:
        """Return (tensor, flat uint8 buffer to fill, finish callback or None)."""
        dt = _torch_dtype(entry.dtype.name)
        if entry.storage is not None:
            ref = entry.storage
            storage = self._storages.get(ref.id)
            if storage is None:
                storage = torch.UntypedStorage(ref.nbytes)  # type: ignore[no-untyped-call]
                self._storages[ref.id] = storage
            t = torch.empty(0, dtype=dt)
            t.set_(storage, ref.offset, entry.shape, ref.stride)
        else:
            t = torch.empty(entry.shape, dtype=dt)
        view = byte_view(t)
        finish = None
        if view is None:  # a strided view into a shared storage: fill a temp, then copy
            tmp = torch.empty(entry.shape, dtype=dt)
            view = byte_view(tmp)
            assert view is not None

            def finish(t: torch.Tensor = t, tmp: torch.Tensor = tmp) -> None:
                t.copy_(tmp)
        return self.wrap(t, entry), view, finish

    @staticmethod
    def wrap(t: torch.Tensor, entry: TensorEntry) -> Any:
        if entry.parameter:
            return torch.nn.Parameter(t, requires_grad=entry.requires_grad)
        if entry.requires_grad and t.is_floating_point():
            t.requires_grad_(True)
        return t

    @staticmethod
    def into(dest: Any, entry: TensorEntry) -> tuple[Any, np.ndarray, Any]:
        """Fill an existing tensor in place (no grad tracking); a temp buffer is used only when
        the destination is not a contiguous CPU tensor."""
        dt = _torch_dtype(entry.dtype.name)
        target = dest.detach()
        view = byte_view(target)
        if view is not None:
            return dest, view, None
        tmp = torch.empty(tuple(target.shape), dtype=dt)
        tmp_view = byte_view(tmp)
        assert tmp_view is not None

        def finish() -> None:
            with torch.no_grad():
                target.copy_(tmp)
        return dest, tmp_view, finish


def check_destination(dest: Any, entry: TensorEntry) -> str | None:
    """Why `dest` cannot receive `entry` in place, or None if it can."""
    if not isinstance(dest, torch.Tensor):
        return f"destination is a {type(dest).__name__}, checkpoint holds a torch tensor"
    name = dtype_name(dest.dtype)
    if name != entry.dtype.name:
        return f"destination dtype {dest.dtype} != stored {entry.dtype.name}"
    return None
