"""The device seam: what the save and restore pipelines need of an accelerator, and no more.

A tensor on a device (a GPU) cannot be hashed or written where it is: its bytes go through
host memory, and this is the one interface through which they do. It has two
implementations: torch's (`format/torch_types.TorchDevice`, CUDA; that module is the only one
of the core that imports torch) and `FakeDevice` below, an asynchronous device made of host
memory, with which the test suite runs every decision above the seam (pools, ordering,
budget, guards, errors) without a GPU.

    Device        the seam (a Protocol): mark, to_host, to_device (each returns a CopyEvent),
                  pin/unpin, read (a synchronous copy), allocate (device memory), problem
    CopyEvent     done() / wait(): one enqueued copy, or the work issued before a mark
    DeviceBlock   what the pipeline sees of a device tensor (torch_types.DeviceArray)
    Pins          host buffers page-locked once, for as long as their owner keeps them
    DeviceCopyError  a copy to or from a device failed (one error, naming the tensor)
    FakeDevice    the test double (and gpu_check's stand-in on a machine without a GPU)

The rules the pipelines keep (tests/ckptstore/pipeline/test_device_*.py check each through
FakeDevice):

* a device-to-host copy waits for the work the caller issued before the save (its `mark`),
  goes into a page-locked slot of a pool kept by the repository (pinned once, reused by every
  save), and the slot is hashed and written only once the copy's event completed; it goes
  back to the pool only after its bytes were written (writer.py, staging.py);
* a host-to-device copy is issued only from bytes that were read and verified, and its host
  buffer is reused only once the copy's event completed (loading.DeviceReads).

Why one module: the seam, its pools and its test double are one contract; FakeDevice checks
the very rules the pools rely on, so they are read together.
"""

from __future__ import annotations

import contextlib
import mmap
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import numpy as np

from ..errors import DeviceCopyError

Select = tuple[slice, ...]


class CopyEvent(Protocol):
    """One copy enqueued on a device's copy stream (or, from `mark`, the work issued so far
    on the caller's stream)."""

    def done(self) -> bool: ...

    def wait(self) -> None:
        """Return once it completed; raise if the device reported an error."""


class Device(Protocol):
    """The seam. Copies are asynchronous: each returns an event, and the buffers it names
    must stay untouched until that event completed."""

    @property
    def name(self) -> str: ...

    def problem(self) -> str | None:
        """Why tensors on this device cannot be read now (device lost, not visible), or None."""

    def mark(self) -> CopyEvent:
        """An event after the work the caller (this thread) issued so far on this device:
        copies given it as `after` read the values as of now."""

    def pin(self, buffer: np.ndarray) -> None:
        """Page-lock host memory for fast asynchronous copies (once per buffer)."""

    def unpin(self, buffer: np.ndarray) -> None: ...

    def to_host(self, src: Any, dst: np.ndarray, after: CopyEvent | None) -> CopyEvent:
        """Enqueue dst[...] = src (a device tensor, dst a C-contiguous host array of its shape
        and element bits) after `after`."""

    def to_device(self, src: np.ndarray, dst: Any, select: Select | None,
                  after: CopyEvent | None) -> CopyEvent:
        """Enqueue dst[...] = src (or src[select]) after `after`; dst: a device tensor view
        of the element bits, src: a C-contiguous host array."""

    def read(self, src: Any) -> np.ndarray:
        """A host copy of `src`, made now (synchronous, on the caller's stream)."""

    def allocate(self, nbytes: int) -> Any:
        """A new 1-D uint8 tensor of `nbytes` on this device (restores make new tensors)."""


class DeviceBlock(Protocol):
    """A tensor on a device as the save pipeline holds it in `ArrayLeaf.array`
    (format/torch_types.DeviceArray): geometry and slicing; bytes only through `device`."""

    device: Device
    tensor: Any
    dtype: np.dtype
    source: Any

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def nbytes(self) -> int: ...

    def __getitem__(self, index: Any) -> DeviceBlock: ...


def on_device(array: Any) -> bool:
    """True if a leaf's array is a device tensor (a DeviceBlock), not host memory."""
    return not isinstance(array, np.ndarray)


def block_of(array: Any) -> DeviceBlock:
    """`array` (on_device) as the DeviceBlock it is."""
    assert on_device(array)
    block: DeviceBlock = array
    return block


def devices_of(arrays: Iterable[Any]) -> dict[str, Device]:
    """The devices holding any of `arrays`, by name."""
    out: dict[str, Device] = {}
    for a in arrays:
        if on_device(a):
            dev = block_of(a).device
            out.setdefault(dev.name, dev)
    return out


def marks_for(arrays: Iterable[Any]) -> dict[str, CopyEvent]:
    """One mark per device holding any of `arrays` (call in the caller's thread, when the
    values to save are those of now)."""
    return {name: dev.mark() for name, dev in devices_of(arrays).items()}


def issue(start: Callable[[], CopyEvent], what: str) -> CopyEvent:
    """Enqueue a copy; a device error at enqueue time becomes a DeviceCopyError."""
    try:
        return start()
    except DeviceCopyError:
        raise
    except Exception as exc:
        raise DeviceCopyError(f"{what} failed: {type(exc).__name__}: {exc}") from exc


def copy_to_host(block: DeviceBlock, dst: np.ndarray, after: CopyEvent | None,
                 what: str) -> CopyEvent:
    """Enqueue the copy of a device block into host buffer `dst` (see `issue`)."""
    return issue(lambda: block.device.to_host(block.tensor, dst, after), what)


def copy_to_device(device: Device, src: np.ndarray, dst: Any, select: Select | None,
                   after: CopyEvent | None, what: str) -> CopyEvent:
    """Enqueue the copy of host bytes `src` (or its part `select`) into device tensor `dst`
    (see `issue`)."""
    return issue(lambda: device.to_device(src, dst, select, after), what)


def wait_copy(event: CopyEvent, what: str) -> None:
    """Wait for one copy; a device error becomes a DeviceCopyError saying `what` failed."""
    try:
        event.wait()
    except DeviceCopyError:
        raise
    except Exception as exc:
        raise DeviceCopyError(f"{what} failed: {type(exc).__name__}: {exc}") from exc


def wait_all(events: Iterable[tuple[CopyEvent, str]]) -> None:
    """Wait for every event, then raise the first failure (so that no buffer is given back
    while a copy into or out of it may still run)."""
    first: BaseException | None = None
    for event, what in events:
        try:
            wait_copy(event, what)
        except DeviceCopyError as exc:
            first = first or exc
    if first is not None:
        raise first


def settle(events: Iterable[tuple[CopyEvent, str]]) -> None:
    """Wait for every event, ignoring failures (an error is already on its way)."""
    with contextlib.suppress(DeviceCopyError):
        wait_all(events)


def host_buffer(nbytes: int) -> np.ndarray:
    """A flat uint8 host buffer of its own pages (page-aligned, anonymous memory committed as
    it is written): what Pins page-locks."""
    if not nbytes:
        return np.empty(0, np.uint8)
    return np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)


class Pins:
    """Host buffers page-locked for devices: each buffer once per device, for as long as the
    owner keeps it (`release` unpins them all; call it before the buffers are dropped). A
    buffer the device refuses to pin is used unpinned (its copies are synchronous, still
    correct), with one RuntimeWarning."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pinned: dict[tuple[int, str], tuple[np.ndarray, Device] | None] = {}
        self.bytes = 0  # page-locked bytes held now (counted per device)
        self.calls = 0  # buffers pinned so far (a pool that is reused pins each slot once)
        self._warned = False

    def ensure(self, buffer: np.ndarray, devices: Iterable[Device]) -> None:
        """Pin `buffer` for each of `devices` unless it already is."""
        if not buffer.nbytes:
            return
        address = int(buffer.ctypes.data)
        for dev in devices:
            key = (address, dev.name)
            with self._lock:
                if key in self._pinned:
                    continue
                try:
                    dev.pin(buffer)
                except Exception as exc:
                    self._pinned[key] = None  # not again: used unpinned
                    if not self._warned:
                        self._warned = True
                        warnings.warn(f"page-locking {buffer.nbytes} bytes of host memory for "
                                      f"{dev.name} failed ({type(exc).__name__}: {exc}); its "
                                      "copies run unpinned (synchronous, slower)",
                                      RuntimeWarning, stacklevel=3)
                    continue
                self._pinned[key] = (buffer, dev)
                self.bytes += buffer.nbytes
                self.calls += 1

    def release(self) -> None:
        with self._lock:
            pinned, self._pinned = list(self._pinned.values()), {}
            self.bytes = 0
        for item in pinned:
            if item is not None:
                with contextlib.suppress(Exception):  # at exit the device may be gone
                    item[1].unpin(item[0])


# ------------------------------------------------------------------------------ test double
class FakeDeviceError(RuntimeError):
    """An injected device failure (FakeDevice.fail)."""


def _address(buffer: Any) -> tuple[int, int]:
    """(address, size) of a buffer's memory (0, 0 for an empty one)."""
    arr = buffer if isinstance(buffer, np.ndarray) else np.frombuffer(buffer, np.uint8)
    return (int(arr.ctypes.data), int(arr.nbytes)) if arr.nbytes else (0, 0)


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[1] > 0 and b[1] > 0 and a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


class _FakeEvent:
    def __init__(self) -> None:
        self._set = threading.Event()
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._set.is_set()

    def wait(self) -> None:
        self._set.wait()
        if self.error is not None:
            raise self.error

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._set.set()


_DONE = _FakeEvent()
_DONE.finish()


class FakeDevice:
    """An asynchronous device for tests: its "device tensors" are CPU tensors given to it
    with `adopt` (or made by `allocate`), which the save and load paths then treat exactly as
    they treat CUDA tensors (format/torch_types.device_of asks installed devices first).

    Copies run later, on the device's own threads, `latency` seconds after they were issued
    (each independently: a slow or held copy does not hold up the others); `hold(tensor)`
    parks the copies of a tensor until `release`; `fail(...)` makes chosen copies fail (with
    `sticky`, every later one too, as a CUDA error does). At enqueue the destination of a copy
    to the host is filled with 0xA5 bytes, so bytes used before the copy's event would be
    garbage. It records what a test checks:

    * `violations`: a host buffer reused (copied into) while a copy into it was pending or
      while it was being hashed or written (`using`); bytes hashed or written (`using`)
      while a copy into them was pending; a host buffer that changed before the copy to the
      device that reads it ran;
    * `unpinned`: copies whose host side was not page-locked by `pin`; `pins` (calls) and
      `pinned_bytes` (now); `max_pending_bytes`: most host bytes with a copy in flight;
    * `issued`: (kind, tensor storage address, nbytes) of every copy in issue order, and
      `to_device_digests`: the xxh3 digest of every host buffer a copy to the device read.
    """

    def __init__(self, name: str = "fake:0", latency: float = 0.0, threads: int = 2) -> None:
        self._name = name
        self.latency = latency
        self.lost = False
        self.violations: list[str] = []
        self.unpinned = 0
        self.pins = 0
        self.sync_reads = 0
        self.issued: list[tuple[str, int, int]] = []
        self.to_device_digests: list[str] = []
        self.max_pending_bytes = 0
        self._lock = threading.Lock()
        self._storages: dict[int, Any] = {}  # adopted storages, kept alive (addresses stay theirs)
        self._pinned: dict[int, int] = {}  # address -> bytes
        self._pending: dict[int, tuple[str, tuple[int, int]]] = {}  # id -> (kind, host range)
        self._busy: dict[int, tuple[int, int]] = {}  # id -> host range being hashed/written
        self._held: dict[int, list[tuple[_FakeEvent, Callable[[], None], int]]] = {}
        self._paused: list[tuple[_FakeEvent, Callable[[], None], int]] | None = None
        self._fail: Callable[[str, int], bool] | None = None
        self._sticky = False
        self._broken: BaseException | None = None
        self._counts = {"to_host": 0, "to_device": 0}
        self._queue: queue.Queue[tuple[_FakeEvent, Callable[[], None], int] | None] = (
            queue.Queue())
        self._threads = [threading.Thread(target=self._run, name=f"{name}-copy-{i}",
                                          daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()
        self._installed = False
        self._closed = False

    # ------------------------------------------------------------------ set-up
    @property
    def name(self) -> str:
        return self._name

    def __enter__(self) -> FakeDevice:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def install(self) -> None:
        """Make the save and load paths see adopted tensors as this device's."""
        from ..format import torch_types

        torch_types.register_host_device(self)
        self._installed = True

    def close(self) -> None:
        """Uninstall, let every parked copy run, stop the copy threads (copies issued later
        run at once, so that a save still in flight ends)."""
        self._closed = True
        if self._installed:
            from ..format import torch_types

            torch_types.unregister_host_device(self)
            self._installed = False
        self.resume()
        for key in list(self._held):
            self._release_key(key)
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=10)

    def adopt(self, *objs: Any) -> None:
        """Make the tensors of `objs` (tensors, DTensors, modules, optimizers, nested dicts,
        lists and tuples of them) this device's tensors."""
        from ..format import torch_types

        for t in torch_types.tensors_in(objs):
            storage = t.untyped_storage()
            if storage.nbytes():
                with self._lock:
                    self._storages[storage.data_ptr()] = storage

    def owns(self, tensor: Any) -> bool:
        """Whether `tensor` (a CPU tensor) is one of this device's."""
        if not self._storages:
            return False
        storage = tensor.untyped_storage()
        return storage.nbytes() > 0 and storage.data_ptr() in self._storages

    # ------------------------------------------------------------------ test controls
    def hold(self, tensor: Any) -> None:
        """Park every copy reading or writing `tensor`'s storage until `release(tensor)`."""
        with self._lock:
            self._held.setdefault(tensor.untyped_storage().data_ptr(), [])

    def release(self, tensor: Any) -> None:
        self._release_key(tensor.untyped_storage().data_ptr())

    def _release_key(self, key: int) -> None:
        with self._lock:
            parked = self._held.pop(key, [])
        for job in parked:
            self._queue.put(job)

    def pause(self) -> None:
        """Park every copy issued from now on until `resume()`."""
        with self._lock:
            if self._paused is None:
                self._paused = []

    def resume(self) -> None:
        with self._lock:
            parked, self._paused = self._paused or [], None
        for job in parked:
            self._queue.put(job)

    def fail(self, kind: str = "to_host", after: int = 0, count: int = 1,
             sticky: bool = False) -> None:
        """Make copies number after+1 .. after+count of `kind` ("to_host" or "to_device",
        counted from now) fail; with `sticky`, every copy after the first failure fails."""
        start = self._counts[kind] + after

        def chosen(k: str, number: int) -> bool:
            return k == kind and start < number <= start + count

        self._fail = chosen
        self._sticky = sticky

    def heal(self) -> None:
        """No more injected failures (a sticky one included)."""
        self._fail = None
        self._sticky = False
        self._broken = None

    def drain(self, timeout: float = 10.0) -> None:
        """Wait until no issued copy is pending (parked ones excepted)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                parked = sum(len(v) for v in self._held.values()) + len(self._paused or [])
                if len(self._pending) <= parked:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("copies still pending")
            time.sleep(0.002)

    @property
    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(self._pinned.values())

    def pending_copies(self, kind: str | None = None) -> int:
        with self._lock:
            return sum(1 for k, _r in self._pending.values() if kind is None or k == kind)

    @contextlib.contextmanager
    def using(self, buffer: Any, what: str) -> Iterator[None]:
        """Mark `buffer` as being hashed or written (`what`) while the block runs: a copy into
        it meanwhile, or a copy into it still pending now, is a violation."""
        rng = _address(buffer)
        token = object()
        with self._lock:
            for kind, pending in self._pending.values():
                if kind == "to_host" and _overlaps(rng, pending):
                    self.violations.append(f"{what} of bytes whose copy to the host is pending")
            self._busy[id(token)] = rng
        try:
            yield
        finally:
            with self._lock:
                del self._busy[id(token)]

    # ------------------------------------------------------------------ the seam
    def problem(self) -> str | None:
        return "the fake device was lost (test)" if self.lost else None

    def mark(self) -> _FakeEvent:
        return _DONE

    def pin(self, buffer: np.ndarray) -> None:
        address, nbytes = _address(buffer)
        with self._lock:
            if address in self._pinned:
                raise FakeDeviceError("buffer pinned twice")  # as cudaHostRegister refuses
            self._pinned[address] = nbytes
            self.pins += 1

    def unpin(self, buffer: np.ndarray) -> None:
        with self._lock:
            self._pinned.pop(_address(buffer)[0], None)

    def _is_pinned(self, rng: tuple[int, int]) -> bool:
        return any(a <= rng[0] and rng[0] + rng[1] <= a + n for a, n in self._pinned.items())

    def to_host(self, src: Any, dst: np.ndarray, after: Any) -> _FakeEvent:
        rng = _address(dst)
        key = src.untyped_storage().data_ptr()
        with self._lock:
            for kind, pending in self._pending.values():
                if _overlaps(rng, pending):
                    self.violations.append(f"host buffer reused by a copy while a {kind} "
                                           "copy of it was pending")
            if any(_overlaps(rng, busy) for busy in self._busy.values()):
                self.violations.append("host buffer reused by a copy while its bytes were "
                                       "being hashed or written")
            if not self._is_pinned(rng):
                self.unpinned += 1
            self.issued.append(("to_host", key, rng[1]))
        if dst.flags.c_contiguous and dst.nbytes:
            dst.reshape(-1).view(np.uint8).fill(0xA5)  # garbage until the copy has run

        def run() -> None:
            np.copyto(dst, src.numpy())

        return self._enqueue("to_host", rng, key, run)

    def to_device(self, src: np.ndarray, dst: Any, select: Select | None,
                  after: Any) -> _FakeEvent:
        from ..format.hashing import digest

        rng = _address(src)
        key = dst.untyped_storage().data_ptr()
        flat = src.reshape(-1).view(np.uint8)
        seen = digest(flat.data)
        with self._lock:
            if not self._is_pinned(rng):
                self.unpinned += 1
            self.issued.append(("to_device", key, rng[1]))
            self.to_device_digests.append(seen)

        def run() -> None:
            if digest(flat.data) != seen:
                with self._lock:
                    self.violations.append("host buffer changed before the copy to the "
                                           "device that reads it ran")
            np.copyto(dst.numpy(), src if select is None else src[select])

        return self._enqueue("to_device", rng, key, run)

    def read(self, src: Any) -> np.ndarray:
        with self._lock:
            self.sync_reads += 1
        out: np.ndarray = src.numpy().copy()
        return out

    def allocate(self, nbytes: int) -> Any:
        from ..format import torch_types

        t = torch_types.host_bytes(nbytes)
        self.adopt(t)
        return t

    # ------------------------------------------------------------------ the copy engine
    def _enqueue(self, kind: str, rng: tuple[int, int], key: int,
                 run: Callable[[], None]) -> _FakeEvent:
        event = _FakeEvent()
        with self._lock:
            self._counts[kind] += 1
            number = self._counts[kind]
            failing = self._broken is not None or (
                self._fail is not None and self._fail(kind, number))
            self._pending[id(event)] = (kind, rng)
            pending = sum(r[1] for _k, r in self._pending.values())
            self.max_pending_bytes = max(self.max_pending_bytes, pending)

        def job() -> None:
            if failing:
                error = self._broken or FakeDeviceError(f"injected failure of {kind} copy "
                                                        f"{number} on {self._name}")
                if self._sticky:
                    self._broken = error
                raise error
            run()

        item = (event, job, id(event))
        if self._closed:
            self._execute(item)
            return event
        with self._lock:
            if self._paused is not None:
                self._paused.append(item)
                return event
            if key in self._held:
                self._held[key].append(item)
                return event
        self._queue.put(item)
        return event

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.latency:
                time.sleep(self.latency)
            self._execute(item)

    def _execute(self, item: tuple[_FakeEvent, Callable[[], None], int]) -> None:
        event, job, ident = item
        error: BaseException | None = None
        try:
            job()
        except BaseException as exc:  # reported through the event, as a device would
            error = exc
        with self._lock:
            self._pending.pop(ident, None)
        event.finish(error)

