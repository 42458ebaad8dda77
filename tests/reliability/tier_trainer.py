"""The trainer of the tier fault campaign (tests/reliability/test_tier_faults.py).

    python -m tests.reliability.tier_trainer NEAR FAR ENDPOINT EVENTS SAVES [--final]

A training loop with `CheckpointManager([NEAR, FAR], keep_last=[2, 5])` and a sync save at
every step: it restores (appending `{"event": "restored", "step"}` to EVENTS), then saves
SAVES more steps, appending `{"event": "ack", "step", "t"}` once each save returned, or
`{"event": "save-failed", "step", "error"}` if one raised (the campaign requires none). With
`--final` it then waits for replication and retention (`mgr.wait()`) and appends `{"event":
"replicated"}` (or `replication-failed`). The far tier is S3 behind the campaign's fault
proxy, which goes down and comes back meanwhile; the campaign SIGKILLs this process at
random moments. Every step holds `state(step)`.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any

import torch

from tests.reliability.common import append_json_line


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(128, 128, generator=g), "frozen": torch.ones(4096)}}


def main(argv: list[str]) -> int:
    import ckptstore
    from ckptstore.tiers.replication import RetryPolicy

    near, far, endpoint, events, saves = argv[:5]
    final = "--final" in argv
    mgr = ckptstore.CheckpointManager(
        [near, far], keep_last=[2, 5], endpoint_url=endpoint, max_attempts=1,
        connect_timeout=1.0, read_timeout=2.0,
        replication_retry=RetryPolicy(attempts=2, first_delay=0.05, max_delay=0.2))
    dest = state(0)
    restored = mgr.restore(dest)
    if restored is not None:
        want = state(restored)
        assert torch.equal(dest["model"]["w"], want["model"]["w"]), "restored other values"
    append_json_line(events, {"event": "restored", "step": restored})
    first = (restored or 0) + 1
    for step in range(first, first + int(saves)):
        try:
            mgr.save(step, state(step))
        except Exception as exc:  # noqa: BLE001 - counted by the campaign
            append_json_line(events, {"event": "save-failed", "step": step,
                                      "error": f"{type(exc).__name__}: {exc}"})
            continue
        append_json_line(events, {"event": "ack", "step": step, "t": time.time()})
        time.sleep(0.02)
    if final:
        try:
            mgr.wait()
            append_json_line(events, {"event": "replicated"})
        except Exception as exc:  # noqa: BLE001 - reported
            append_json_line(events, {"event": "replication-failed",
                                      "error": f"{type(exc).__name__}: {exc}"})
    mgr.close()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(3)
