"""What the hardware allows, for the conversion benchmark: raw disk writes (files of 16 MiB,
each fsynced, 1 and 2 threads) and raw parallel puts of 16 MiB objects to an S3 endpoint."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

OBJ = 16 << 20


def disk_write_mb_s(folder: Path, nbytes: int, threads: int) -> float:
    folder.mkdir(parents=True, exist_ok=True)
    buf = os.urandom(OBJ)
    count = max(1, nbytes // OBJ)

    def one(i: int) -> None:
        path = folder / f"raw-{i}"
        with open(path, "wb") as f:
            f.write(buf)
            f.flush()
            os.fsync(f.fileno())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(count)))
    dt = time.perf_counter() - t0
    for i in range(count):
        (folder / f"raw-{i}").unlink()
    return count * OBJ / dt / 1e6


def s3_put_mb_s(endpoint: str, bucket: str, nbytes: int, threads: int) -> float:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)
    buf = os.urandom(OBJ)
    count = max(1, nbytes // OBJ)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: s3.put_object(Bucket=bucket, Key=f"raw/{i}", Body=buf),
                      range(count)))
    dt = time.perf_counter() - t0
    for i in range(count):
        s3.delete_object(Bucket=bucket, Key=f"raw/{i}")
    return count * OBJ / dt / 1e6
