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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .. import seaweed
from ..support.servers import new_bucket as support_new_bucket
from ..support.servers import running_moto
from .common import QUICK, SOAK, Profile

# Only local servers are ever used; these dummy credentials feed the standard boto3 chain
# (tests/conftest.py sets the same; repeated here so this folder also runs on its own).
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.pop("AWS_PROFILE", None)

SEAWEED_ACCESS_KEY = seaweed.ACCESS_KEY
SEAWEED_SECRET_KEY = seaweed.SECRET_KEY

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
    with running_moto() as endpoint:
        yield endpoint


def new_bucket(endpoint: str, prefix: str = "rel") -> str:
    """Create a fresh bucket at `endpoint` (credentials from the environment); its name."""
    return support_new_bucket(endpoint, prefix)


# -- SeaweedFS ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seaweedfs(seaweedfs_endpoint: str) -> str:
    """A real S3 server: the session's SeaweedFS (tests/seaweed.py, started by the root
    conftest; a test fails, never skips, if it cannot start). Yields the S3 endpoint URL."""
    return seaweedfs_endpoint


@pytest.fixture
def seaweed_env(seaweedfs: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The SeaweedFS endpoint, with its credentials in the environment (the standard boto3
    chain is the only way ckptstore takes credentials)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", SEAWEED_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SEAWEED_SECRET_KEY)
    return seaweedfs
