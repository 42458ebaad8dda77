"""Profile target for py-spy or cProfile: one ckptstore save, then the steps asked for
(default: restore into=, restore new; also `inc`: an incremental save, 10% changed).

    py-spy record --idle --threads --format raw -o /tmp/ckpt.folded -- \
        python bench/ckpt/profile_ckpt.py 1g /tmp/ckpt-prof
    python -m cProfile -s cumtime bench/ckpt/profile_ckpt.py small20k /tmp/p save,inc

Prints the wall time and SaveInfo.stage_seconds of each step (no page-cache dropping: the
profile is about CPU and lock time, not the disk)."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ckptstore  # noqa: E402
from ckpt import states as S  # noqa: E402


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "1g"
    folder = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/ckpt-prof")
    steps = sys.argv[3].split(",") if len(sys.argv) > 3 else ["save", "into", "new"]
    spec = S.specs(False)[name]
    state = S.build(spec)
    shutil.rmtree(folder, ignore_errors=True)
    repo = ckptstore.CheckpointStore(str(folder))
    t = time.perf_counter()
    info = repo.save("p", state)
    print(f"save {time.perf_counter() - t:.2f}s stages={info.stage_seconds}", flush=True)
    dest = {k: v.clone() for k, v in state.items()} if "into" in steps else None
    for step in steps[1:]:
        t = time.perf_counter()
        if step == "into":
            ckptstore.CheckpointStore(str(folder)).load("p", into=dest)
        elif step == "new":
            ckptstore.CheckpointStore(str(folder)).load("p")
        elif step == "inc":  # 10% of the bytes changed, a fresh object (knows the parent only)
            S.touch(state, S.changed_subset(state, 0.10))
            info = ckptstore.CheckpointStore(str(folder)).save("inc", state)
            print(
                f"  written {info.written_bytes / info.logical_bytes:.3f} "
                f"stages={info.stage_seconds}"
            )
        print(f"{step} {time.perf_counter() - t:.2f}s", flush=True)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
