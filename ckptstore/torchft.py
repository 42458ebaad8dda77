"""Live healing for torchft: `Transport` is a torchft `CheckpointTransport` that moves a
healthy replica's state to a replacement chunk by chunk, without pickle, verifying every
byte against its digest, and sending only what the replacement does not already hold.

```python
from datetime import timedelta
from ckptstore.torchft import Transport

transport = Transport(timeout=timedelta(seconds=60),
                      destinations=lambda: {"user": {"default": state_dict()}},  # optional
                      local="/nvme/ckpt/run7/rank0")                            # optional
manager = torchft.Manager(..., state_dict=state_dict, load_state_dict=load_state_dict,
                          checkpoint_transport=transport)
```

* The sender publishes the step's state in ckptstore's checkpoint encoding (docs/format.md:
  the tree as canonical JSON, tensors as raw row-block chunks and packs named by digest) and
  serves it from the state's memory over a small threaded HTTP server (`host`, default
  127.0.0.1; set the node's address on a cluster). `disallow_checkpoint` waits until the
  receivers that started have finished (or their timeout passed, then their connections are
  closed); once it returns nothing more is read from the state. A request for another step
  than the one served fails at once; a snapshot's chunks are only served under its token.
* The receiver fetches the index, then every chunk it does not hold already: chunks equal
  to what `destinations()` holds are left where they are (frozen weights the replacement
  loaded itself), chunks in `local` (a CheckpointStore or path: its near tier's latest
  checkpoint) are read from there, the rest come from the sender over `workers` parallel
  connections. Every chunk is verified before it lands in a tensor the caller holds.
* torchft's `recv_checkpoint` has no destination argument; `destinations` is the callable
  that provides them, laid out as the state the sender sends (for a Manager:
  `{"user": {key: state_dict()}}` for each registered key). Tensors found there by dotted
  key are filled in place and returned as the same objects, so the Manager's
  `load_state_dict` copies nothing new; the rest are new tensors.

See docs/recovery.md, "Live healing (torchft)".
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .errors import MissingDependencyError

try:
    from torchft.checkpointing.transport import CheckpointTransport
except ModuleNotFoundError:
    raise MissingDependencyError("torchft is not installed (needed for ckptstore.torchft): "
                                 "pip install torchft") from None

from .format.hashing import hash_algorithm
from .healing.client import parse_address
from .healing.errors import HealError, HealTimeoutError
from .healing.receive import LocalChunks, Receive, ReceiveInfo, default_workers, open_local
from .healing.server import HealServer, ServeHook
from .healing.snapshot import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_DEVICE_SLOTS,
    PACK_THRESHOLD,
    build_snapshot,
)
from .healing.staging import Staging

__all__ = ["HealError", "HealTimeoutError", "ReceiveInfo", "SendInfo", "Transport"]

log = logging.getLogger("ckptstore.healing")


@dataclass(frozen=True)
class SendInfo:
    """What one `send_checkpoint` published: the step, its tensor bytes and the seconds it
    took to describe and hash them (the call's whole cost; serving runs in the background)."""

    step: int
    logical_bytes: int
    chunks: int
    seconds: float
    device_bytes: int = 0  # of logical_bytes, those of tensors on a device (staged, not copied)


def _seconds(timeout: timedelta, what: str) -> float:
    if not isinstance(timeout, timedelta):
        raise TypeError(f"{what} must be a datetime.timedelta, got {type(timeout).__name__}")
    seconds = timeout.total_seconds()
    if seconds <= 0:
        raise ValueError(f"{what} must be positive, got {timeout}")
    return seconds


class Transport(CheckpointTransport[dict[str, Any]]):  # type: ignore[misc]
    """A torchft CheckpointTransport over ckptstore's chunked, digest-named state encoding
    (module docstring). Every argument but `timeout` is optional:

    * `destinations`: a callable returning the state to receive into (see above);
    * `local`: a CheckpointStore or repository path whose near tier's latest checkpoint
      supplies chunks by digest;
    * `host`, `port`: where the sender's server listens and what its metadata advertises;
    * `workers`: parallel connections of a receive (default one per core, 2 to 8);
    * `chunk_bytes`: row-block size of a published step (CheckpointStore's default, so its
      saves share digests with the published chunks); `hash`: "xxh3-128" or "sha256-128";
    * `retries`: how often a chunk that fails its digest is fetched again;
    * `huge_pages`: back the tensors a receive creates with transparent huge pages (one page
      fault per 2 MiB instead of 512; healing/memory.py says when that pays);
    * `serve_hook`: called for every blob body the server sends (tests: corruption, delays);
    * `device_host_bytes`: the most host memory a sender's device tensors (CUDA) take at
      once, in page-locked slots of `chunk_bytes` (default 4 slots: 64 MiB); they are hashed
      and served through it, never copied to the host whole (docs/recovery.md, "Live
      healing on GPUs");
    * `device`: where a receive makes the tensors `destinations` lack ("cuda:0", a
      torch.device; default: the device holding the destinations' tensors when they are all
      on one, else host memory). Chunks reach device tensors verified, through page-locked
      slots.
    """

    def __init__(self, timeout: timedelta, *, destinations: Callable[[], Any] | None = None,
                 local: Any = None, host: str = "127.0.0.1", port: int = 0,
                 workers: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 hash: str = "xxh3-128", retries: int = 2, hash_workers: int = 2,
                 huge_pages: bool = False, serve_hook: ServeHook | None = None,
                 device_host_bytes: int | None = None, device: Any = None) -> None:
        self._timeout = _seconds(timeout, "timeout")
        if destinations is not None and not callable(destinations):
            raise TypeError("destinations must be a callable returning the state to receive "
                            f"into, got {type(destinations).__name__}")
        if local is not None and not isinstance(local, (str, os.PathLike)):
            from . import CheckpointStore

            if not isinstance(local, CheckpointStore):
                raise TypeError("local must be a CheckpointStore or a repository path, got "
                                f"{type(local).__name__}")
        if type(chunk_bytes) is not int or chunk_bytes < PACK_THRESHOLD:
            raise ValueError(f"chunk_bytes must be an int >= {PACK_THRESHOLD}, got "
                             f"{chunk_bytes!r}")
        if workers is not None and (type(workers) is not int or workers < 1):
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        if type(retries) is not int or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        if type(hash_workers) is not int or hash_workers < 1:
            raise ValueError(f"hash_workers must be a positive int, got {hash_workers!r}")
        if device_host_bytes is not None and (type(device_host_bytes) is not int
                                              or device_host_bytes < chunk_bytes):
            raise ValueError(f"device_host_bytes must be an int >= chunk_bytes ({chunk_bytes}), "
                             f"got {device_host_bytes!r}")
        if device is not None:
            from .format.torch_types import resolve_device

            device = resolve_device(device)
        self._device = device
        #: the page-locked slots of device tensors: those the sender hashes and serves
        #: through (bounded by device_host_bytes) and those a receive copies up from
        self._send_staging = Staging(chunk_bytes, device_host_bytes
                                     or DEFAULT_DEVICE_SLOTS * chunk_bytes)
        self._recv_staging = Staging(chunk_bytes)
        self._algorithm = hash_algorithm(hash)
        self._destinations = destinations
        self._local = local
        self._local_repo: Any = None
        self._workers = workers or default_workers()
        self._chunk_bytes = chunk_bytes
        self._retries = retries
        self._hash_workers = hash_workers
        self._huge_pages = bool(huge_pages)
        self._send_lock = threading.Lock()
        #: receives in progress (shutdown unpins the receive slots once none is)
        self._receiving = 0
        self._recv_done = threading.Condition()
        self._server = HealServer(host, port, self._timeout, serve_hook)
        self._closed = False
        #: the last receive's figures (None before the first)
        self.last_receive: ReceiveInfo | None = None
        #: the last step published (None before the first)
        self.last_send: SendInfo | None = None

    # ------------------------------------------------------------------ torchft's API
    def metadata(self) -> str:
        """Where this transport serves: `http://HOST:PORT/<secret>/` (the receiver's key)."""
        return self._server.address

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict[str, Any],
                        timeout: timedelta) -> None:
        """Publish `state_dict` as step `step` and return: it is served in the background
        until `disallow_checkpoint`. Describing and hashing the state is this call's cost
        (about 50 ms per GiB per hash worker on a CPU core here). A state that cannot be
        sent raises UnsupportedTypeError naming the key, and receivers asking for that step
        get the same message at once."""
        if self._closed:
            raise HealError("this transport was shut down")
        with self._send_lock:
            self._server.state.withdraw(self._timeout)  # the previous step, if still served
            try:
                snap = build_snapshot(state_dict, int(step), chunk_bytes=self._chunk_bytes,
                                      algorithm=self._algorithm, workers=self._hash_workers,
                                      staging=self._send_staging)
            except Exception as exc:
                self._server.state.publish_failure(int(step), f"{type(exc).__name__}: {exc}")
                raise
            self._server.state.publish(snap)
            self.last_send = SendInfo(snap.step, snap.logical_bytes, len(snap.blobs),
                                      snap.seconds, snap.device_bytes)
        log.info("live heal: serving step %d (%d bytes, %d blobs) to ranks %s at %s",
                 step, snap.logical_bytes, len(snap.blobs), list(dst_ranks), self.metadata())

    def disallow_checkpoint(self) -> None:
        """Stop serving: returns once no request reads the state and none will (receivers
        that started are waited for, up to the timeout; then their connections close)."""
        self._server.state.withdraw(self._timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta) -> dict[str, Any]:
        """Fetch step `step` from the transport whose `metadata()` is `metadata`, within
        `timeout`. Raises HealTimeoutError when the sender does not serve it in time,
        HealError when it dies, stops or refuses mid-transfer, IntegrityError when a chunk
        keeps failing its digest, KeyMismatchError when `destinations` do not fit; nothing
        partial is returned."""
        seconds = _seconds(timeout, "timeout")
        address = parse_address(metadata)
        with self._recv_done:
            if self._closed:
                raise HealError("this transport was shut down")
            self._receiving += 1
        try:
            return self._receive(src_rank, address, step, seconds)
        finally:
            with self._recv_done:
                self._receiving -= 1
                self._recv_done.notify_all()

    def _receive(self, src_rank: int, address: Any, step: int, seconds: float
                 ) -> dict[str, Any]:
        receive = Receive(address, int(step), seconds, algorithm=self._algorithm,
                          destinations=self._destinations, local=self._local_chunks(),
                          workers=self._workers, retries=self._retries,
                          huge_pages=self._huge_pages, staging=self._recv_staging,
                          device=self._device)
        state, info = receive.run()
        self.last_receive = info
        log.info("live heal: step %d from rank %d in %.2f s: %d bytes from the sender, %d in "
                 "place, %d from the local repository", step, src_rank, info.seconds,
                 info.network_bytes, info.in_place_bytes, info.local_bytes)
        result: dict[str, Any] = state
        return result

    def shutdown(self, wait: bool = True) -> None:
        """Stop serving and close the server (with `wait`, after the running transfers), then
        unpin the page-locked slots of device tensors once no transfer uses them (without
        `wait`, in the background). Later sends and receives raise HealError."""
        with self._recv_done:
            if self._closed:
                return
            self._closed = True
        if wait:
            self._server.state.withdraw(self._timeout)
            self._server.close(wait)
            self._unpin()
        else:
            self._server.close(wait)
            threading.Thread(target=self._unpin, name="ckpt-heal-unpin", daemon=True).start()

    def _unpin(self) -> None:
        """Unpin both stagings' slots once nothing copies through them: the server is closed
        (no request reads a send slot), and a receive in progress has ended."""
        self._server.state.withdraw(self._timeout)
        with self._send_lock:
            self._send_staging.release()
        with self._recv_done:
            self._recv_done.wait_for(lambda: self._receiving == 0)
            self._recv_staging.release()

    # ------------------------------------------------------------------ extras
    @property
    def device_host_peak(self) -> int:
        """Most host bytes the sender's device tensors have taken at once (staging.py)."""
        return self._send_staging.peak_bytes

    @property
    def bytes_served(self) -> int:
        """Index and chunk bytes this transport's server has sent, since it started."""
        return self._server.state.bytes_sent

    def _local_chunks(self) -> LocalChunks | None:
        if self._local is None:
            return None
        if self._local_repo is None:
            if isinstance(self._local, (str, os.PathLike)):
                from . import CheckpointStore

                self._local_repo = CheckpointStore(os.fspath(self._local), create=False)
            else:
                self._local_repo = self._local
        return open_local(self._local_repo, self._algorithm)
