"""Everything that touches torch: tensors to raw byte views and back. The only module of the core
that imports torch; it is imported lazily, the first time a torch object is met.

Tensors on a device (CUDA) are not copied here: their leaf holds a `DeviceArray`, whose bytes
the pipeline moves through the device seam (pipeline/device.py). `TorchDevice` is the seam's
torch implementation; it lives here because this is the module that may import torch.

Why one module: the rule "only this module of the core imports torch" (the layer check
enforces it) keeps every torch call, dtype table and device copy here."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..deps import missing
from ..errors import FormatError, UnsupportedTypeError

try:
    import torch
except ModuleNotFoundError as _exc:
    raise missing(_exc) from None
from . import dtypes
from .leaf import ArrayLeaf
from .regions import Runs

if TYPE_CHECKING:  # annotations only: manifest imports tree_pages -> tree -> this module
    from .manifest import TensorEntry

# torch dtypes numpy lacks are viewed as unsigned ints of the same width
_BITS_VIEW = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}
#: on a device the bits are viewed as types every backend copies with strides (the unsigned
#: 16/32/64-bit types have only basic support there); the bytes are the same
_DEVICE_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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


def torch_dtype(name: str) -> torch.dtype:
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
    a tensor on a device is held as a DeviceArray (its bytes are copied by the pipeline)."""
    cls = type(t)
    if cls is not torch.Tensor and not isinstance(t, torch.Tensor):
        kind = f"{cls.__module__}.{cls.__qualname__}"
        raise UnsupportedTypeError(f"{key}: cannot store {kind}")
    if t.is_meta:
        raise UnsupportedTypeError(f"{key}: a tensor on the meta device holds no values; "
                                   "materialize it (e.g. module.to_empty(device=...), then "
                                   "initialize) before saving")
    if t.layout != torch.strided or t.is_quantized:
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
            leaf = _dtensor_leaf(local, key, requires_grad, parameter)
            if leaf.region_runs is not None:
                leaf.replica = dtensor_replica(t)
            return leaf
        base = t.detach()
    if base.is_conj():
        base = base.resolve_conj()
    if base.is_neg():
        base = base.resolve_neg()
    device = device_of(base)
    if device is not None:
        return _device_leaf(t, base, key, info, device, requires_grad, parameter)
    array = raw_numpy(base)
    storage = base.untyped_storage()
    return ArrayLeaf(
        key=key, kind="torch", dtype=info[0], array=array,
        requires_grad=requires_grad, parameter=parameter,
        storage_identity=(storage.data_ptr(), storage.nbytes()) if array.size else None,
        storage_offset=base.storage_offset(), storage_stride=tuple(base.stride()),
    )


def _device_leaf(t: Any, base: torch.Tensor, key: str,
                 info: tuple[dtypes.DType, torch.dtype | None], device: Any,
                 requires_grad: bool, parameter: bool) -> ArrayLeaf:
    """The leaf of a tensor on a device: a DeviceArray of its element bits (on the device),
    with the storage identity tied tensors and optimizer guards are matched by."""
    why = device.problem()
    if why is not None:
        raise UnsupportedTypeError(f"{key}: tensor on {device.name} cannot be read: {why}")
    bits = _device_bits(base, info)
    array = DeviceArray(bits, device, _numpy_of(bits.dtype), t)
    storage = base.untyped_storage()
    return ArrayLeaf(
        key=key, kind="torch", dtype=info[0], array=cast(np.ndarray, array),
        requires_grad=requires_grad, parameter=parameter,
        storage_identity=(storage.data_ptr(), storage.nbytes()) if array.size else None,
        storage_offset=int(base.storage_offset()), storage_stride=tuple(base.stride()),
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


def is_dtensor(t: Any) -> bool:
    """Whether `t` is a torch DTensor (an FSDP2 parameter is one)."""
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def dtensor_local(t: Any, key: str) -> tuple[torch.Tensor, Runs | None, tuple[int, ...]] | None:
    """For a DTensor: (local tensor, where it lies in the global tensor as per-dim runs
    (format/regions.py) or None when it holds the whole tensor, global shape). None for any
    other tensor.

    Any device mesh, any mix of Shard(d), Replicate() and strided shards (FSDP2 over tensor
    parallelism), several mesh dims sharding one tensor dim, uneven splits: the global
    indexes of the local part are what torch itself computes, mesh dim after mesh dim
    (torch.distributed.tensor._utils, as its compute_local_shape_and_global_offset does).
    Partial() raises UnsupportedTypeError saying what to do."""
    if not is_dtensor(t):
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


def dtensor_replica(t: Any) -> tuple[int, int]:
    """(index, count) of this rank among the ranks holding the same part of DTensor `t`: its
    coordinate over the mesh dims whose placement is Replicate(), and their sizes' product."""
    from torch.distributed.tensor import Replicate

    index, count = 0, 1
    for n, c, p in zip(t.device_mesh.shape, t.device_mesh.get_coordinate(), t.placements):
        if isinstance(p, Replicate):
            index, count = index * int(n) + int(c), count * int(n)
    return index, count


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
    if not t.is_cpu or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    if t.numel() == 0:
        return np.empty(0, np.uint8)
    return raw_numpy(t.detach() if t.requires_grad else t).reshape(-1).view(np.uint8)


# ------------------------------------------------------------------------------ devices
class _Flags:
    """`DeviceArray.flags`: never contiguous host memory (numpy paths copy it first)."""

    c_contiguous = False
    f_contiguous = False
    writeable = False


class DeviceArray:
    """A tensor on a device as the save pipeline holds it in `ArrayLeaf.array`: the shape,
    the numpy dtype of its element bits (`tensor` is viewed as those bits) and byte size, and
    basic slicing (row blocks, N-D boxes), each slice another DeviceArray. Its bytes are
    reached through `device` (pipeline/device.py); `copy()` and numpy conversion make a
    synchronous host copy, for what needs the bytes at once (call-time copies). `source` is
    the tensor saved (its `_version` tracks in-place changes)."""

    __slots__ = ("device", "dtype", "source", "tensor")
    flags = _Flags()

    def __init__(self, tensor: torch.Tensor, device: Any, dtype: np.dtype, source: Any) -> None:
        self.tensor = tensor
        self.device = device
        self.dtype = dtype
        self.source = source

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def ndim(self) -> int:
        return int(self.tensor.dim())

    @property
    def size(self) -> int:
        return int(self.tensor.numel())

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return int(self.tensor.shape[0])

    def __getitem__(self, index: Any) -> DeviceArray:
        return DeviceArray(self.tensor[index], self.device, self.dtype, self.source)

    def copy(self) -> np.ndarray:
        """A host copy, made now."""
        out: np.ndarray = self.device.read(self.tensor)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.copy()
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"DeviceArray({self.device.name}, {self.shape}, {self.dtype})"


class _TorchEvent:
    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


class _Done:
    """A copy that completed before it was returned (synchronous devices)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


_DONE = _Done()


class TorchDevice:
    """The device seam (pipeline/device.py) for a torch device. CUDA: one copy stream per
    device, an event after every copy, host buffers page-locked with cudaHostRegister (by the
    pool that keeps them, once). Any other device type: synchronous copies, nothing pinned
    (correct, not overlapped)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.name = str(device)
        self.cuda = device.type == "cuda"
        self._stream: Any = None
        self._lock = threading.Lock()

    def problem(self) -> str | None:
        index = self.device.index or 0
        if self.cuda:
            if not torch.cuda.is_available():
                return "CUDA is not available in this process (lost device, or hidden)"
            count = torch.cuda.device_count()
        elif (torch.accelerator.is_available() and (acc := torch.accelerator.current_accelerator())
              is not None and acc.type == self.device.type):
            count = torch.accelerator.device_count()
        else:
            return None  # a device type torch reaches otherwise (its copies say if not)
        if index >= count:
            return f"this process sees {count} {self.device.type} device(s)"
        return None

    def _copy_stream(self) -> Any:
        with self._lock:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            return self._stream

    def mark(self) -> Any:
        if not self.cuda:
            return _DONE
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return _TorchEvent(event)

    def pin(self, buffer: np.ndarray) -> None:
        if self.cuda and buffer.nbytes:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            # 1: cudaHostRegisterPortable (pinned for every device of the process)
            rc = int(cudart.cudaHostRegister(int(buffer.ctypes.data), buffer.nbytes, 1))
            if rc:
                raise RuntimeError(f"cudaHostRegister of {buffer.nbytes} bytes failed "
                                   f"(cudaError {rc})")

    def unpin(self, buffer: np.ndarray) -> None:
        if self.cuda and buffer.nbytes:
            torch.cuda.cudart().cudaHostUnregister(  # type: ignore[no-untyped-call]
                int(buffer.ctypes.data))

    def to_host(self, src: torch.Tensor, dst: np.ndarray, after: Any) -> Any:
        out = torch.from_numpy(dst)
        if not self.cuda:
            out.copy_(src)
            return _DONE
        stream = self._copy_stream()
        with torch.cuda.stream(stream):
            if isinstance(after, _TorchEvent):
                stream.wait_event(after.event)
            out.copy_(src, non_blocking=True)
            # blocking: a thread waiting for it sleeps in the driver instead of spinning
            event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            event.record(stream)
        return _TorchEvent(event)

    def to_device(self, src: np.ndarray, dst: torch.Tensor, select: Any, after: Any) -> Any:
        host = torch.from_numpy(src)
        if not self.cuda:
            dst.copy_(host if select is None else host[select])
            return _DONE
        stream = self._copy_stream()
        with torch.cuda.stream(stream):
            if isinstance(after, _TorchEvent):
                stream.wait_event(after.event)
            if select is None:
                dst.copy_(host, non_blocking=True)
            else:  # the whole chunk up (one contiguous copy), its part placed on the device
                dst.copy_(host.to(self.device, non_blocking=True)[select])
            # blocking: a thread waiting for it sleeps in the driver instead of spinning
            event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            event.record(stream)
        return _TorchEvent(event)

    def read(self, src: torch.Tensor) -> np.ndarray:
        out: np.ndarray = src.cpu().numpy()
        return out

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)


_TORCH_DEVICES: dict[torch.device, TorchDevice] = {}
_TORCH_DEVICES_LOCK = threading.Lock()
#: devices whose "device tensors" are CPU tensors they adopted (pipeline/device.FakeDevice):
#: asked first, for every CPU tensor (a test hook; empty in production)
_HOST_DEVICES: list[Any] = []


def register_host_device(device: Any) -> None:
    """Install a device that owns some CPU tensors (`device.owns(t)`): a test hook."""
    _HOST_DEVICES.append(device)


def unregister_host_device(device: Any) -> None:
    if device in _HOST_DEVICES:
        _HOST_DEVICES.remove(device)


def torch_device(device: torch.device) -> TorchDevice:
    """The seam of one torch device (one per device: its copy stream is shared)."""
    if device.index is None and device.type == "cuda" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    with _TORCH_DEVICES_LOCK:
        found = _TORCH_DEVICES.get(device)
        if found is None:
            found = _TORCH_DEVICES[device] = TorchDevice(device)
        return found


def device_of(t: torch.Tensor) -> Any | None:
    """The device seam of a tensor's memory, or None when it is readable host memory."""
    if t.is_cpu:
        for dev in _HOST_DEVICES:
            if dev.owns(t):
                return dev
        return None
    return torch_device(t.device)


def resolve_device(spec: Any) -> Any | None:
    """The device seam of a `device=` / `map_location=` argument: None or "cpu" (host memory:
    None), a device string or torch.device, or a seam object itself (tests: FakeDevice).
    UnsupportedTypeError if it is none of these, or not available now."""
    if spec is None:
        return None
    if callable(getattr(spec, "to_device", None)) and callable(getattr(spec, "allocate", None)):
        return spec
    if not isinstance(spec, (str, torch.device)):
        raise UnsupportedTypeError(f"device must be a device name such as 'cuda:0' or a "
                                   f"torch.device, got {type(spec).__name__}")
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError) as exc:
        raise UnsupportedTypeError(f"device {spec!r} is not a device: {exc}") from None
    if dev.type == "cpu":
        return None
    if dev.type == "meta":
        raise UnsupportedTypeError("cannot load onto the meta device: it holds no values")
    seam = torch_device(dev)
    why = seam.problem()
    if why is not None:
        raise UnsupportedTypeError(f"cannot load onto {seam.name}: {why}")
    return seam


def host_bytes(nbytes: int) -> torch.Tensor:
    """A new uint8 CPU tensor (FakeDevice's device memory)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def tensors_in(objs: Iterable[Any]) -> Iterator[torch.Tensor]:
    """Every torch tensor in `objs`: tensors (a DTensor's local part), modules' parameters and
    buffers, optimizers' state, nested dicts, lists and tuples."""
    stack = list(objs)
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            local = getattr(obj, "_local_tensor", None)
            yield local if isinstance(local, torch.Tensor) else obj
        elif isinstance(obj, torch.nn.Module):
            stack.extend(obj.parameters())
            stack.extend(obj.buffers())
        elif isinstance(obj, torch.optim.Optimizer):
            stack.extend(obj.state.values())
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)


def _bits(t: torch.Tensor) -> DeviceArray | None:
    """A DeviceArray over the element bits of `t` (detached) if it lives on a device."""
    device = device_of(t)
    if device is None:
        return None
    target = t.detach()
    bits = _device_bits(target, _DTYPES[t.dtype])
    return DeviceArray(bits, device, _numpy_of(bits.dtype), t)


def _device_bits(t: torch.Tensor, info: tuple[dtypes.DType, torch.dtype | None]
                 ) -> torch.Tensor:
    """`t` viewed as the element type its bits are copied as on a device (_DEVICE_BITS for
    types numpy lacks and for unsigned 16/32/64-bit ints; the type itself otherwise)."""
    if info[1] is not None or t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return t.view(_DEVICE_BITS[t.element_size()])
    return t


_NUMPY_OF: dict[torch.dtype, np.dtype] = {}


def _numpy_of(dt: torch.dtype) -> np.dtype:
    """The numpy dtype of a numpy-native torch dtype (native byte order)."""
    found = _NUMPY_OF.get(dt)
    if found is None:
        found = _NUMPY_OF[dt] = torch.empty(0, dtype=dt).numpy().dtype
    return found



def _fill_view(t: torch.Tensor, values: torch.Tensor, key: str) -> None:
    """Write `values` into the strided view `t` of a shared storage. A dimension of stride 0
    (an expanded view: `ids.expand(2, 16)` beside `ids`) holds one memory location for all
    its indexes: it is written once, from index 0, and every index must have read back the
    same values (they were read from that one location when saved)."""
    dst, src = t, values
    for d, (n, stride) in enumerate(zip(t.shape, t.stride())):
        if stride == 0 and n > 1:
            dst, src = dst.narrow(d, 0, 1), src.narrow(d, 0, 1)
    try:
        dst.copy_(src)
    except RuntimeError as exc:  # another kind of self-overlap
        raise FormatError(f"tensor {key!r}: its view of a shared storage cannot be "
                          f"rebuilt ({exc})") from None
    if dst is not t and not torch.equal(t, values):
        raise FormatError(f"tensor {key!r}: the indexes of its expanded dimensions "
                          "hold different values, though they share one memory location")


class TorchMaterializer:
    """Creates torch tensors for one load, rebuilding shared storages (tied weights); with
    `device` (a device seam: resolve_device), on that device."""

    def __init__(self, device: Any = None) -> None:
        self._storages: dict[int, torch.UntypedStorage] = {}
        self.device = device

    def new(self, entry: TensorEntry) -> tuple[Any, np.ndarray, Any]:
        """Return (tensor, flat uint8 buffer to fill, finish callback or None); on a device,
        the buffer is a DeviceArray of the tensor (filled through the device seam)."""
        dt = torch_dtype(entry.dtype.name)
        if self.device is not None:
            return self._new_on_device(entry, dt)
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
                _fill_view(t, tmp, entry.key)
        return self.wrap(t, entry), view, finish

    def _new_on_device(self, entry: TensorEntry, dt: torch.dtype) -> tuple[Any, Any, Any]:
        if entry.storage is not None:
            ref = entry.storage
            storage = self._storages.get(ref.id)
            if storage is None:
                storage = self.device.allocate(ref.nbytes).untyped_storage()
                self._storages[ref.id] = storage
            t = torch.empty(0, dtype=dt, device=storage.device)
            t.set_(storage, ref.offset, entry.shape, ref.stride)
        else:
            t = self.device.allocate(entry.nbytes).view(dt).view(entry.shape)
        target = _bits(t)
        if target is None:  # nothing to fill (a device owns no empty storage)
            assert not t.numel(), "a device's allocate() must return its own memory"
            return self.wrap(t, entry), np.empty(0, np.uint8), None
        return self.wrap(t, entry), cast(np.ndarray, target), None

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
        target = dest.detach() if dest.requires_grad else dest
        on_device = _bits(target)
        if on_device is not None:  # filled through the device seam, no host temp
            return dest, cast(np.ndarray, on_device), None
        view = byte_view(target)
        if view is not None:
            return dest, view, None
        tmp = torch.empty(tuple(target.shape), dtype=torch_dtype(entry.dtype.name))
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
    if dest.is_meta:
        return "destination is on the meta device (it has no memory to fill)"
    device = device_of(dest)
    why = None if device is None else device.problem()
    if device is not None and why is not None:
        return f"destination on {device.name} cannot be written: {why}"
    return None
