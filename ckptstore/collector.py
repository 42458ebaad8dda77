"""Keeping Python's cyclic garbage collector from costing a save or load a third of its time,
without taking it away from the host for long.

A save or load of 20,000 small tensors allocates hundreds of thousands of acyclic objects, and
every full collection they trigger walks every object in the process: 25-30% of the time. Two
tools, both counted across threads and nestable:

* `quiet_collector()` spans a whole save or load (seconds, I/O included). The collector keeps
  running for everyone; the objects that existed when the block began are frozen
  (`gc.freeze`), so its collections do not walk them again and again, and are given back
  (`gc.unfreeze`) when the last such block ends. If the host had frozen objects of its own
  (`gc.get_freeze_count() > 0`), nothing is frozen: unfreezing would undo the host's freeze.
* `paused_collector()` spans one short CPU-bound step without I/O (encoding the state tree,
  serializing or parsing a manifest, allocating the tensors of a load: fractions of a second,
  bounded by the number of tensors), and a synchronous save, whose caller waits for the whole
  call anyway (never a background write). The collector is disabled during the step; inside
  a quiet block, what the step allocated is frozen at its end too, so later collections skip
  it.

Reference counting frees acyclic garbage as always; only cycles made by the host during a
quiet block that were frozen with it wait until the block ends. A host that calls
`gc.freeze()` itself *while* a save or load runs has those objects unfrozen when it ends
(`gc.unfreeze` cannot tell them apart): freeze before saving, as fork-based servers do.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_paused = 0  # paused_collector() blocks running now, in any thread
_was_enabled = False
_quiet = 0  # quiet_collector() blocks running now
_froze = False  # the outermost quiet block froze objects (and so must unfreeze them)


@contextmanager
def quiet_collector() -> Iterator[None]:
    """Freeze the objects that exist now until the block ends (see the module docstring)."""
    global _quiet, _froze
    with _lock:
        if _quiet == 0:
            _froze = gc.get_freeze_count() == 0
        if _froze:
            gc.freeze()
        _quiet += 1
    try:
        yield
    finally:
        with _lock:
            _quiet -= 1
            if _quiet == 0 and _froze:
                gc.unfreeze()
                _froze = False


@contextmanager
def paused_collector() -> Iterator[None]:
    """Disable the collector for one short CPU-bound step; re-enabled (if it was enabled) when
    the last concurrent step ends."""
    global _paused, _was_enabled
    with _lock:
        if _paused == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _paused += 1
    try:
        yield
    finally:
        with _lock:
            _paused -= 1
            if _quiet and _froze:
                gc.freeze()  # what the step allocated: not walked again by later collections
            if _paused == 0 and _was_enabled:
                gc.enable()
