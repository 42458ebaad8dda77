#!/usr/bin/env python
"""Why an unguarded tensor changed after the call fails an overlapped save (docs/design-notes.md).

    python bench/unguarded_change_probe.py --saves 300

Each round saves a few tensors with staging="overlap" and changes every one of them in place
(`add_`) right after the call, without a guard, as a trainer that forgot `guard()` would.
Two rules are compared on the same rounds:

* strict (ckptstore's): a tensor no guard covers must keep its version counter until the
  commit; any change by then fails the save, and nothing is committed.
* relaxed: only each block's copy is bracketed by version checks; a change seen after a
  block's copy is taken as "after the copy" and the save commits.

For each rule: how many saves committed, and how many of those hold a value from after the
call (a block copied while the `add_` ran, whose version bump came after the check).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from ckptstore import CheckpointStore, SourceChangedError
from ckptstore.pipeline import overlap


def run(rounds: int, relaxed: bool, folder: Path) -> tuple[int, int, int]:
    """(saves, committed, committed with a value from after the call)."""
    repo = CheckpointStore(folder, chunk_bytes=128 * 1024)
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(256, 512) for i in range(6)}  # 512 KiB each, 4 blocks
    original = overlap.Overlap.confirm
    if relaxed:
        overlap.Overlap.confirm = lambda self: None  # type: ignore[method-assign]
    committed = wrong = 0
    try:
        for i in range(rounds):
            old = {k: v.clone() for k, v in state.items()}
            handle = repo.save_async(f"s{i}", state, staging="overlap", max_host_bytes=1 << 20)
            for t in state.values():
                t.add_(1.0)
            try:
                handle.wait()
            except SourceChangedError:
                continue
            committed += 1
            loaded = repo.load(f"s{i}")
            wrong += any(not torch.equal(loaded[k], v) for k, v in old.items())
    finally:
        overlap.Overlap.confirm = original  # type: ignore[method-assign]
        repo.close()
    return rounds, committed, wrong


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--saves", type=int, default=300)
    args = ap.parse_args()
    print("| rule | saves | committed | committed with a value from after the call |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for relaxed in (False, True):
            n, ok, bad = run(args.saves, relaxed, Path(tmp) / ("relaxed" if relaxed else
                                                               "strict"))
            print(f"| {'relaxed' if relaxed else 'strict'} | {n} | {ok} | {bad} |")


if __name__ == "__main__":
    main()
