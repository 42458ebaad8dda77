"""Worker subprocess: build one state, run one contestant on it, write its JSON result.

Run by bench/ckpt_bench.py as `python bench/ckpt_bench.py --worker '<json>'`; a fresh process
per contestant keeps RSS measurements clean and hands all memory back afterwards."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from . import states as S
from .common import GiB, fresh_dir, rmtree, rss
from .contestants import CONTESTANTS, EMPTY_STATE, NO_STATE, Ctx


def run(job: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    import torch  # noqa: F401  (imported before the baseline so it is not counted)

    import ckptstore  # noqa: F401

    spec = S.specs(job["quick"])[job["state"]]
    t0 = time.perf_counter()
    if job["contestant"] in NO_STATE:
        state: dict = {}
    else:
        state = S.build(spec, job["quick"], empty=job["contestant"] in EMPTY_STATE)
    build_s = time.perf_counter() - t0
    workdir = fresh_dir(Path(job["tmp"]), f"{job['state']}-{job['contestant']}")
    ctx = Ctx(spec, state, workdir, job["opts"])
    base = rss()
    t0 = time.perf_counter()
    try:
        result = CONTESTANTS[job["contestant"]](ctx)
        ok, error = True, None
    except Exception as exc:  # reported, not fatal to the whole run
        result, ok = {}, False
        error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        rmtree(workdir)
    return {
        "ok": ok,
        "error": error,
        "result": result,
        "state_build_s": build_s,
        "run_s": time.perf_counter() - t0,
        "rss_after_build_GiB": base / GiB,
        "state": S.describe(spec, state) if state else None,
    }


def main(arg: str) -> None:
    job = json.loads(arg)
    out = run(job)
    Path(job["result_path"]).write_text(json.dumps(out, default=str))
    sys.exit(0 if out["ok"] else 1)
