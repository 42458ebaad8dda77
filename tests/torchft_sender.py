"""A live-heal sender in its own process, so that a test can SIGKILL it mid-transfer:
`python -m tests.torchft_sender SPEC`, SPEC = {"mib": 48, "delay": 0.1, "step": 5}.

It publishes `mib` MiB of float32 tensors (4 MiB each: one chunk, sent in one piece) as step
`step` through `ckptstore.torchft.Transport`, sleeping `delay` seconds before each piece it
sends (a slow link), prints `READY <metadata>` and serves until it is killed (at most 120 s).
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch

from ckptstore.torchft import Transport


def main(spec: dict[str, float]) -> None:
    g = torch.Generator().manual_seed(3)
    state = {"w": [torch.rand(1 << 20, generator=g) for _ in range(int(spec["mib"]) // 4)]}

    def slow(digest: str, offset: int, data: memoryview) -> None:
        time.sleep(spec["delay"])

    transport = Transport(timedelta(seconds=60), serve_hook=slow)
    transport.send_checkpoint([1], int(spec["step"]), state, timedelta(seconds=60))
    print(f"READY {transport.metadata()}", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
