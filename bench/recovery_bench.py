"""Recovery benchmark for tiered repositories (issue 12, section 7).

    python bench/recovery_bench.py                 # 1 GiB of state, far tier = local rate / 10
    python bench/recovery_bench.py --gib 0.25 --reps 1 --skip-train    # a quick sanity run

One process (one rank) with `--gib` GiB of fp32 state in 64 MiB tensors. The far tier is a
moto S3 server in its own process behind a bandwidth throttle (a token bucket shared by
all connections, applied to request and response bodies in 1 MiB pieces) set to a tenth of
the local restore rate measured at the start (the ratio of node NVMe to per-node S3
bandwidth on real clusters) but at most MAX_FAR_MBPS, so that the throttle and not moto's
own ceiling (about 0.3 GB/s per GET stream here, shared cores) sets the far tier's rate;
`--far-mbps` overrides it. The local rate is a restore of the state just saved, so mostly
from the page cache: the ratio to a cold NVMe read would be smaller. Measured side by side,
alternating the contestants, ratios from this one run:

* save stall, sync (the whole save) and async (until `save_async` returns): tier 0 only,
  tiered (tier 0 + throttled S3), S3 only; and the time until the checkpoint is durable on S3;
* restore: after a process crash (tier 0 intact), after the loss of the node's tier 0 (from
  the far tier), from S3 only;
* with `--peers` (2 ranks on gloo, `--gib` each, one folder per rank standing for a node,
  peer_replicas=1): restore after a crash and after the loss of rank 1's folder (from its
  peer), alternated `--reps` times, then after the loss of every folder (from the throttled
  far tier); the slowest rank counts;
* end to end, `examples/train.py` (unless --skip-train): from restart to its first training
  step after a crash, after the loss of its tier-0 folder, and with an S3-only repository.

Prints one JSON document (and a table on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB = 1 << 20
TENSOR_BYTES = 64 * MiB
MAX_FAR_MBPS = 150.0

_SERVER = r"""
import io, sys, threading, time
from moto.server import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import make_server

RATE = float(sys.argv[1])  # bytes per second, all connections together
PIECE = 1 << 20


class Bucket:
    def __init__(self, rate):
        self.rate, self.next_free, self.lock = rate, time.monotonic(), threading.Lock()

    def spend(self, n):
        with self.lock:
            start = max(time.monotonic(), self.next_free)
            self.next_free = start + n / self.rate
            end = self.next_free
        delay = end - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class Throttle:
    def __init__(self, app, bucket):
        self.app, self.bucket = app, bucket

    def __call__(self, environ, start_response):
        length = int(environ.get("CONTENT_LENGTH") or 0)
        if length:
            body, left = bytearray(), length
            while left:
                piece = environ["wsgi.input"].read(min(PIECE, left))
                if not piece:
                    break
                self.bucket.spend(len(piece))
                body += piece
                left -= len(piece)
            environ["wsgi.input"] = io.BytesIO(bytes(body))
        result = self.app(environ, start_response)
        return self._paced(result)

    def _paced(self, result):
        try:
            for data in result:
                for i in range(0, len(data), PIECE):
                    piece = data[i:i + PIECE]
                    self.bucket.spend(len(piece))
                    yield piece
        finally:
            getattr(result, "close", lambda: None)()


app = Throttle(DomainDispatcherApplication(create_backend_app), Bucket(RATE))
server = make_server("127.0.0.1", 0, app, threaded=True)
print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
sys.stdin.read()
"""


class ThrottledS3:
    """moto behind a bandwidth throttle, in its own process."""

    def __init__(self, rate: float) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(rate)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        self.endpoint = self.proc.stdout.readline().strip()
        if not self.endpoint.startswith("http://"):
            self.stop()
            raise RuntimeError("throttled moto server did not start")

    def bucket(self) -> str:
        import boto3

        name = f"bench-{uuid.uuid4().hex[:10]}"
        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=name)
        return f"s3://{name}/run"

    def reset(self) -> None:
        import urllib.request

        req = urllib.request.Request(self.endpoint + "/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=120).read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def make_state(gib: float) -> dict[str, Any]:
    import torch

    n = max(1, int(gib * (1 << 30)) // TENSOR_BYTES)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}": torch.rand(TENSOR_BYTES // 4, generator=g) for i in range(n)}


def touch(state: dict[str, Any]) -> None:
    """Change every chunk, as a training step does."""
    for t in state.values():
        t.add_(1.0)


def open_repo(kind: str, tmp: Path, s3: ThrottledS3) -> Any:
    import ckptstore

    near = str(tmp / f"near-{uuid.uuid4().hex[:6]}")
    if kind == "tier0":
        return ckptstore.CheckpointStore(near)
    if kind == "s3":
        return ckptstore.CheckpointStore(s3.bucket(), endpoint_url=s3.endpoint)
    return ckptstore.CheckpointStore([near, s3.bucket()], endpoint_url=s3.endpoint)


def measure_saves(state: dict[str, Any], tmp: Path, s3: ThrottledS3, reps: int
                  ) -> dict[str, Any]:
    out: dict[str, dict[str, list[float]]] = {}
    order = ["tier0", "tiered", "s3"]
    for rep in range(reps):
        for kind in (order if rep % 2 == 0 else order[::-1]):
            for mode in ("sync", "async"):
                repo = open_repo(kind, tmp, s3)
                touch(state)
                t0 = time.perf_counter()
                if mode == "sync":
                    repo.save("a", state)
                    stall = time.perf_counter() - t0
                else:
                    handle = repo.save_async("a", state)
                    stall = time.perf_counter() - t0
                    handle.wait()
                done = time.perf_counter() - t0
                repo.wait_replicated()
                durable_far = time.perf_counter() - t0
                rec = out.setdefault(f"{kind}/{mode}", {"stall": [], "committed": [],
                                                         "durable_on_s3": []})
                rec["stall"].append(stall)
                rec["committed"].append(done)
                if kind != "tier0":
                    rec["durable_on_s3"].append(durable_far)
                repo.close()
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True, exist_ok=True)
                s3.reset()
    return {k: {m: round(statistics.median(v), 3) for m, v in rec.items() if v}
            for k, rec in out.items()}


def measure_restores(state: dict[str, Any], tmp: Path, s3: ThrottledS3, reps: int
                     ) -> dict[str, Any]:
    import ckptstore

    results: dict[str, list[float]] = {}
    served: dict[str, dict[str, int]] = {}
    for _rep in range(reps):
        near = tmp / "near"
        far = s3.bucket()
        with ckptstore.CheckpointStore([str(near), far], endpoint_url=s3.endpoint) as repo:
            repo.save("a", state)
            repo.wait_replicated()
        into = {k: v.clone().zero_() for k, v in state.items()}
        cases = [("crash: tier 0 intact", lambda: None),
                 ("node lost: from far tier", lambda near=near: shutil.rmtree(near)),
                 ("S3 only", lambda: None)]
        for label, before in cases:
            before()
            if label == "S3 only":
                repo = ckptstore.CheckpointStore(far, endpoint_url=s3.endpoint, create=False)
            else:
                repo = ckptstore.CheckpointStore([str(near), far], endpoint_url=s3.endpoint)
            t0 = time.perf_counter()
            repo.load("a", into=into)
            results.setdefault(label, []).append(time.perf_counter() - t0)
            if repo.last_load is not None:
                served[label] = repo.last_load.bytes_by_tier
            repo.close()
            if label == "node lost: from far tier":
                shutil.rmtree(near, ignore_errors=True)  # the open recreated an empty tier 0
        for k in state:
            assert into[k].equal(state[k]), k
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
        s3.reset()
    return {"seconds": {k: round(statistics.median(v), 3) for k, v in results.items()},
            "bytes_by_tier": served}


def first_step_after(args: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Seconds from launching examples/train.py to its first `step` line, and its
    `restored from` line if any (the process is then killed)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "train.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env)
    restored = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("restored from"):
            restored = line.strip()
        if line.startswith("step "):
            break
    elapsed = time.perf_counter() - t0
    proc.kill()
    proc.wait()
    return elapsed, restored


def measure_train(tmp: Path, s3: ThrottledS3, extra_rows: int) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    data = str(tmp / "data")
    near = tmp / "node0"
    far = s3.bucket()
    common = ["--data", data, "--steps", "8", "--every", "4", "--sync", "--batch", "8",
              "--extra-rows", str(extra_rows)]
    tiers = ["--far", far, "--endpoint-url", s3.endpoint]
    # a run that saves steps 4 and 8 on both tiers and finishes
    subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "--run", str(near),
                    *tiers, *common], env=env, check=True, stdout=subprocess.DEVNULL)
    s3only = s3.bucket()
    subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "--run", s3only,
                    "--endpoint-url", s3.endpoint, *common], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    resume = [*common[:2], "--steps", "12", *common[4:]]
    out = {}
    out["crash: tier 0 intact"] = first_step_after(["--run", str(near), *tiers, *resume], env)
    shutil.rmtree(near)
    out["node lost: from far tier"] = first_step_after(["--run", str(near), *tiers, *resume],
                                                       env)
    out["S3 only"] = first_step_after(["--run", s3only, "--endpoint-url", s3.endpoint,
                                       *resume], env)
    return {k: {"seconds": round(v[0], 3), "restored": v[1]} for k, v in out.items()}


def _peer_worker(rank: int, world: int, init: str, root: str, far: str, endpoint: str,
                 gib: float, phase: str, out: str) -> None:
    import torch.distributed as dist

    import ckptstore

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                            world_size=world)
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    mgr = ckptstore.CheckpointManager([f"{root}/node{{rank}}", f"{far}/{{rank}}"],
                                      peer_replicas=1, endpoint_url=endpoint)
    state = make_state(gib)
    for t in state.values():
        t.add_(rank)
    if phase == "save":
        mgr.save(1, {"model": state})
        mgr.wait()
        result = 0.0
    else:
        into = {"model": {k: v.clone().zero_() for k, v in state.items()}}
        dist.barrier()
        t0 = time.perf_counter()
        assert mgr.restore(into) == 1
        result = time.perf_counter() - t0
        assert all(into["model"][k].equal(v) for k, v in state.items())
    mgr.close()
    Path(out, f"{phase}-{rank}").write_text(str(result))
    dist.destroy_process_group()


def measure_peers(tmp: Path, s3: ThrottledS3, gib: float, reps: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    far = s3.bucket()
    tmp.mkdir(parents=True, exist_ok=True)
    nodes = tmp / "nodes"

    def phase(name: str) -> float:
        out = tmp / f"out-{name}"
        out.mkdir()
        mp.start_processes(_peer_worker, args=(2, str(tmp / f"pg-{name}"), str(nodes), far,
                                               s3.endpoint, gib, name, str(out)),
                           nprocs=2, join=True, start_method="spawn")
        return max(float((out / f"{name}-{r}").read_text()) for r in range(2))

    phase("save")
    runs: dict[str, list[float]] = {"crash: both folders intact": [],
                                    "node 1 lost: from its peer": []}
    for rep in range(reps):  # alternated; the peer restore makes node 1's folder whole again
        runs["crash: both folders intact"].append(phase(f"crash{rep}"))
        shutil.rmtree(nodes / "node1")
        runs["node 1 lost: from its peer"].append(phase(f"peer{rep}"))
    shutil.rmtree(nodes)
    runs["every folder lost: from far tier"] = [phase("far")]
    return {k: {"median": round(statistics.median(v), 3), "runs": [round(x, 3) for x in v]}
            for k, v in runs.items()}


def local_read_rate(state: dict[str, Any], tmp: Path) -> float:
    import ckptstore

    repo = ckptstore.CheckpointStore(str(tmp / "probe"))
    repo.save("a", state)
    into = {k: v.clone() for k, v in state.items()}
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        repo.load("a", into=into)
        times.append(time.perf_counter() - t0)
    repo.close()
    shutil.rmtree(tmp / "probe")
    return sum(t.nbytes for t in state.values()) / min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="state size (GiB)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--far-mbps", type=float, default=None,
                   help="far tier bandwidth in MB/s (default: local restore rate / 10)")
    p.add_argument("--extra-rows", type=int, default=200_000,
                   help="examples/train.py state size knob (200000 rows: about 0.3 GiB)")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--peers", action="store_true", help="also the 2-rank peer-replica restores")
    p.add_argument("--peers-only", action="store_true", help="only the peer-replica restores")
    args = p.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    tmp = Path(tempfile.mkdtemp(prefix="recovery-bench-"))
    state = make_state(args.gib)
    nbytes = sum(t.nbytes for t in state.values())
    local = local_read_rate(state, tmp)
    rate = args.far_mbps * 1e6 if args.far_mbps else min(local / 10, MAX_FAR_MBPS * 1e6)
    s3 = ThrottledS3(rate)
    try:
        doc: dict[str, Any] = {
            "state_bytes": nbytes, "local_restore_bytes_per_s": round(local),
            "far_throttle_bytes_per_s": round(rate), "reps": args.reps}
        if args.peers or args.peers_only:
            del state  # each rank builds its own
            doc["peer_restores_2_ranks"] = measure_peers(tmp / "peers", s3, args.gib,
                                                         args.reps)
        if args.peers_only:
            print(json.dumps(doc, indent=2))
            return
        state = make_state(args.gib)
        doc["saves"] = measure_saves(state, tmp / "saves", s3, args.reps)
        doc["restores"] = measure_restores(state, tmp / "restores", s3, args.reps)
        if not args.skip_train:
            doc["train_restart_to_first_step"] = measure_train(tmp / "train", s3,
                                                               args.extra_rows)
        saves, rest = doc["saves"], doc["restores"]["seconds"]
        doc["ratios"] = {
            "sync stall tiered / tier0": round(saves["tiered/sync"]["stall"]
                                               / saves["tier0/sync"]["stall"], 2),
            "async stall tiered / tier0": round(saves["tiered/async"]["stall"]
                                                / saves["tier0/async"]["stall"], 2),
            "sync stall s3 / tier0": round(saves["s3/sync"]["stall"]
                                           / saves["tier0/sync"]["stall"], 2),
            "restore node lost / crash": round(rest["node lost: from far tier"]
                                               / rest["crash: tier 0 intact"], 2),
            "restore S3 only / crash": round(rest["S3 only"] / rest["crash: tier 0 intact"], 2),
        }
        print(json.dumps(doc, indent=2))
    finally:
        s3.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
