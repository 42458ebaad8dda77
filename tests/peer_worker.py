"""One rank of a peer-replica job, run as its own process (`python -m tests.peer_worker
RANK WORLD INIT ROOT OUT SPEC`) so that tests can kill it, restart a job on another number
of ranks, and bound how long the others wait. Tiers: `ROOT/node<rank>` (a node's disk) and
`ROOT/far/<rank>` (the far tier, a local folder here). SPEC is JSON:

    {"save": [steps]}                    save each step (sync), then close
    {"restore": {...}, "save": [...]}    restore (kwargs), then save those steps
    {"die_when_sending": true}           SIGKILL this rank when it starts sending peer blobs
    {"die_after": seconds}               SIGKILL this rank that long after it joined the group
    {"peer_timeout": seconds}

The result is OUT/rank-<rank>.json: {"restored": step | null, "error": [type, message] |
null, "warnings": [...], "names": tier-0 names at the end}.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


class RankCrashed(AssertionError):
    """A rank raised something the job did not expect (its traceback is the message)."""


def run_job(world: int, root: Path, spec: dict[str, Any] | list[dict[str, Any]],
            timeout: float = 120.0) -> list[dict[str, Any] | None]:
    """Run one job of `world` ranks of this module (one spec per rank, or one for all) to
    its end; each rank's result, None for a rank that died. AssertionError if a rank is still
    running at `timeout` (it waited on a peer) or crashed."""
    specs = spec if isinstance(spec, list) else [spec] * world
    out = root / f"out-{uuid.uuid4().hex[:8]}"
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), LOCAL_WORLD_SIZE="1")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.peer_worker", str(r), str(world),
                               str(out / "pg"), str(root), str(out), json.dumps(specs[r])],
                              cwd=ROOT, env=env) for r in range(world)]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"a rank was still running after {timeout}s (it waited on a "
                             "peer)") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results: list[dict[str, Any] | None] = []
    for r in range(world):
        f = out / f"rank-{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
        error = results[-1]["error"] if results[-1] is not None else None
        if error and error[0] == "crash":
            raise RankCrashed(f"rank {r} crashed:\n{error[1]}")
    return results


def truth(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"w": torch.randn(64, 128, generator=g), "b": torch.randn(32, generator=g)}


def main(rank: int, world: int, init: str, root: str, out: str, spec: dict[str, Any]) -> None:
    import ckptstore
    from ckptstore.training.peers import PeerReplicas

    result: dict[str, Any] = {"restored": None, "error": None, "warnings": [], "names": []}
    if spec.get("die_when_sending"):
        post = PeerReplicas._post

        def dying_post(self: Any, plan: Any, src_of: Any, dst_of: Any) -> Any:
            if any(s == self.rank and r != self.rank for s, r, _d, _n in plan):
                os.kill(os.getpid(), signal.SIGKILL)
            return post(self, plan, src_of, dst_of)

        PeerReplicas._post = dying_post  # type: ignore[method-assign]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    if "die_after" in spec:
        killer = threading.Timer(float(spec["die_after"]), os.kill,
                                 (os.getpid(), signal.SIGKILL))
        killer.daemon = True
        killer.start()
    mgr = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr = ckptstore.CheckpointManager(
                [f"{root}/node{rank}", f"{root}/far/{rank}"], peer_replicas=1,
                keep_last=[2, 5], peer_timeout=float(spec.get("peer_timeout", 20)))
            if "restore" in spec:
                dest = {"model": {k: torch.zeros_like(v) for k, v in truth(rank, 0).items()}}
                try:
                    step = mgr.restore(dest, **spec["restore"])
                except ckptstore.CkptStoreError as exc:
                    result["error"] = [type(exc).__name__, str(exc)]
                    step = None
                result["restored"] = step
                if step is not None:
                    for k, v in truth(rank, step).items():
                        assert torch.equal(dest["model"][k], v), f"step {step}: {k} differs"
            if result["error"] is None:
                try:
                    for step in spec.get("save", []):
                        mgr.save(step, {"model": truth(rank, step)})
                    mgr.wait()
                except ckptstore.CkptStoreError as exc:  # a peer left: bounded, reported
                    result["error"] = [type(exc).__name__, str(exc)]
                result["names"] = sorted(mgr.repo.tiers[0].names())
        result["warnings"] = [str(w.message) for w in caught]
    except BaseException:
        result["error"] = ["crash", traceback.format_exc()]
    finally:
        Path(out, f"rank-{rank}.json").write_text(json.dumps(result))
        if mgr is not None and result["error"] is None:
            mgr.close()
        if result["error"] is None:
            dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5],
         json.loads(sys.argv[6]))
