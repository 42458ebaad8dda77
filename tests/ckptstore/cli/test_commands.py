"""The `ckpt` command line, run as the installed entry point in subprocesses, against local and
moto-S3 repositories, clean and corrupted (docs/cli.md)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptstore import CheckpointStore
from ckptstore.layout import blob_key
from ckptstore.maintenance.checks import MIN_BLOB_AGE

TIMEOUT = 120


def _entry_point() -> list[str]:
    """The installed `ckpt` script of this interpreter (not a pyenv shim, which adds ~0.5 s)."""
    candidate = Path(sysconfig.get_path("scripts")) / "ckpt"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return [str(candidate)]
    found = shutil.which("ckpt")
    if found:
        return [found]
    pytest.fail("the ckpt entry point is not installed (pip install -e .)")


CKPT = _entry_point()


@dataclass
class Result:
    rc: int
    out: str
    err: str

    @property
    def doc(self) -> Any:
        return json.loads(self.out)


ROOT = Path(__file__).resolve().parents[3]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The subprocess environment: dummy AWS credentials for moto, and this checkout first on
    the import path (the installed entry point may point at another copy)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("AWS_PROFILE", None)
    env.pop("CKPT_DEBUG", None)
    env.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    env.update(extra or {})
    return env


def ckpt(*args: str, env: dict[str, str] | None = None, cmd: list[str] | None = None) -> Result:
    """Run the entry point; stdout is a pipe, so output defaults to JSON."""
    proc = subprocess.run([*(cmd or CKPT), *args], capture_output=True, text=True,
                          timeout=TIMEOUT, env=env or _env())
    return Result(proc.returncode, proc.stdout, proc.stderr)


def ckpt_many(*calls: tuple[str, ...]) -> list[Result]:
    """Independent invocations, two at a time (startup is CPU-bound imports)."""
    with cf.ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda a: ckpt(*a), calls))


def one_error_line(r: Result, code: int = 2) -> str:
    assert r.rc == code, (r.rc, r.out, r.err)
    assert "Traceback" not in r.err, r.err
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith("ckpt: ")
    return lines[0]


# ------------------------------------------------------------------------------- fixtures
def _states() -> tuple[dict, dict]:
    rng = np.random.default_rng(0)
    frozen = rng.standard_normal((256, 256), dtype=np.float32)  # 256 KiB: its own blob
    a = {"model": {"frozen": frozen, "w": rng.standard_normal((300, 200), dtype=np.float32),
                   "b": np.zeros(200, np.float32)},
         "step": 100, "lr": 0.5, "tag": "run-a"}
    b = {"model": {"frozen": frozen, "w": a["model"]["w"] + 1, "b": a["model"]["b"],
                   "extra": np.ones(3, np.int64)},
         "step": 200, "lr": 0.5}
    return a, b


def _populate(uri: str, **options: Any) -> None:
    a, b = _states()
    with CheckpointStore(uri, chunk_bytes=64 * 1024, **options) as repo:
        repo.save("step-100", a, {"step": 100})
        repo.save("step-200", b, {"step": 200})


def _blob_of(repo: CheckpointStore, name: str, key: str) -> str:
    entry = next(t for t in repo.manifest(name).tensors if t.key == key)
    return entry.chunks[0].blob


@pytest.fixture
def local_repo(tmp_path: Path) -> str:
    uri = str(tmp_path / "repo")
    _populate(uri)
    return uri


@pytest.fixture
def s3_repo(s3_uri: str, moto_endpoint: str) -> str:
    _populate(s3_uri, endpoint_url=moto_endpoint)
    return s3_uri


def main_inproc(capsys: pytest.CaptureFixture[str], *args: str) -> Result:
    """`ckpt` in this process (for rendering and error paths; no interpreter startup)."""
    from ckptstore.cli import main

    rc = main(list(args))
    captured = capsys.readouterr()
    return Result(rc, captured.out, captured.err)


# ------------------------------------------------------------------------------- read commands
def test_ls_show_du_diff_json_local(local_repo: str) -> None:
    ls, show, du, diff = ckpt_many(
        ("ls", local_repo), ("show", local_repo, "latest", "--keys", "model.*"),
        ("du", local_repo), ("diff", local_repo, "step-100", "step-200"))

    assert ls.rc == 0, ls.err
    rows = ls.doc["checkpoints"]
    assert [r["name"] for r in rows] == ["step-100", "step-200"]  # oldest first
    assert rows[0]["metadata"] == {"step": 100} and rows[1]["parent"] == "step-100"
    assert rows[0]["logical_bytes"] == (256 * 256 + 300 * 200 + 200) * 4
    # step-100 alone holds the old `w` chunks; `frozen` and `b` are shared with step-200
    assert 0 < rows[0]["unique_bytes"] < rows[0]["logical_bytes"]
    assert ls.doc["errors"] == []

    assert show.rc == 0, show.err
    keys = {t["key"]: t for t in show.doc["tensors"]}
    assert set(keys) == {"model.frozen", "model.w", "model.b", "model.extra"}
    assert keys["model.w"]["dtype"] == "float32" and keys["model.w"]["shape"] == [300, 200]
    assert keys["model.frozen"]["chunks"] == 4  # 256 KiB in 64 KiB row blocks
    assert keys["model.extra"]["kind"] == "numpy" and keys["model.extra"]["codec"] is None
    assert show.doc["values"] == []  # `step` and `lr` do not match model.*
    assert show.doc["totals"]["tensors"] == 4

    assert du.rc == 0, du.err
    t = du.doc["totals"]
    assert t["checkpoints"] == 2 and t["missing_blobs"] == 0
    assert t["unreferenced_blobs"] == 0 and t["blob_bytes"] == t["referenced_bytes"]
    assert t["dedup_ratio"] > 1.3  # frozen and b are stored once
    freed = {r["name"]: r["unique_bytes"] for r in du.doc["checkpoints"]}
    assert freed["step-100"] == rows[0]["unique_bytes"]

    assert diff.rc == 1, diff.err  # different, like diff(1)
    d = diff.doc
    assert d["same"] is False
    assert d["added"] == ["model.extra"] and d["removed"] == ["tag"]
    changed = {c["key"]: c["detail"] for c in d["changed"]}
    assert set(changed) == {"model.w", "step"}
    assert "chunk(s) differ" in changed["model.w"]
    assert set(d["unchanged"]) == {"model.frozen", "model.b", "lr"}
    assert d["metadata"] == {"step": {"a": 100, "b": 200}}


def test_s3_ls_show_and_diff_across_uris(s3_repo: str, local_repo: str,
                                         moto_endpoint: str) -> None:
    ep = ("--endpoint-url", moto_endpoint)
    ls, show, across = ckpt_many(("ls", s3_repo, *ep), ("show", s3_repo, "step-100", *ep),
                                 ("diff", local_repo, "step-100", s3_repo, "step-200", *ep))
    assert ls.rc == 0, ls.err
    assert ls.doc["uri"] == s3_repo
    assert [r["name"] for r in ls.doc["checkpoints"]] == ["step-100", "step-200"]
    assert show.rc == 0, show.err
    values = {v["key"]: (v["type"], v["value"]) for v in show.doc["values"]}
    assert values == {"step": ("int", 100), "lr": ("float", 0.5), "tag": ("str", "run-a")}
    assert across.rc == 1, across.err
    assert across.doc["b"]["uri"] == s3_repo and across.doc["added"] == ["model.extra"]


def test_entry_points_and_table_output(local_repo: str) -> None:
    table_ls, version = ckpt_many(("ls", local_repo, "--table"), ("--version",))
    assert table_ls.rc == 0 and "step-100" in table_ls.out and "UNIQUE" in table_ls.out
    assert not table_ls.out.lstrip().startswith("{")
    assert version.rc == 0 and version.out.startswith("ckpt ")
    via_m = ckpt("ls", local_repo, "--json", cmd=[sys.executable, "-m", "ckptstore.cli"])
    assert via_m.rc == 0, via_m.err
    assert [r["name"] for r in via_m.doc["checkpoints"]] == ["step-100", "step-200"]


def test_every_command_draws_tables(local_repo: str, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Rendering paths, in-process: each command with --table prints text, not JSON."""
    copy = str(tmp_path / "copy")
    calls = [
        (("ls", local_repo), 0, "step-200"),
        (("show", local_repo, "step-100"), 0, "run-a"),
        (("show", local_repo, "step-100", "--keys", "model.fr*"), 0, "256x256"),
        (("diff", local_repo, "step-100", "step-200"), 1, "model.extra"),
        (("diff", local_repo, "step-200", "step-200"), 0, "same contents"),
        (("du", local_repo), 0, "dedup ratio"),
        (("verify", local_repo), 0, "OK"),
        (("cp", local_repo, copy, "step-100", "step-200"), 0, "copied step-100, step-200"),
        (("cp", local_repo, copy, "step-100"), 0, "already there (identical): step-100"),
        (("rm", copy, "latest"), 0, "deleted 1 checkpoint(s): step-200"),
        (("gc", copy, "--grace", "0", "--dry-run"), 0, "would delete"),
        (("gc", copy, "--grace", "0"), 0, "deleted"),
        (("ls", str(tmp_path / "empty-but-valid")), 2, ""),
    ]
    CheckpointStore(str(tmp_path / "empty")).close()
    calls.append((("ls", str(tmp_path / "empty")), 0, "no checkpoints"))
    for args, code, text in calls:
        r = main_inproc(capsys, *args, "--table")
        assert r.rc == code, (args, r.err)
        assert text in (r.out if code == 0 or code == 1 else r.err), (args, r.out)
        if code in (0, 1):
            assert not r.out.lstrip().startswith("{"), args


# ------------------------------------------------------------------------------- corruption
def test_verify_names_bad_blobs_checkpoints_and_keys(local_repo: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with CheckpointStore(local_repo, create=False) as repo:
        w_blob = _blob_of(repo, "step-200", "model.w")  # used by step-200 only
        frozen_blob = _blob_of(repo, "step-100", "model.frozen")  # used by both
    root = Path(local_repo)
    path = root / blob_key(w_blob)
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01  # flip one bit
    path.write_bytes(bytes(data))
    (root / blob_key(frozen_blob)).unlink()

    bad, sampled = ckpt_many(("verify", local_repo), ("verify", local_repo, "--sample", "0.5"))
    assert bad.rc == 1, bad.err
    problems = {p["blob"]: p for p in bad.doc["problems"]}
    assert problems[w_blob]["problem"] == "corrupt"
    assert problems[w_blob]["checkpoints"] == ["step-200"]
    assert problems[w_blob]["keys"] == ["model.w"]
    assert problems[frozen_blob]["problem"] == "missing"
    assert problems[frozen_blob]["checkpoints"] == ["step-100", "step-200"]
    assert problems[frozen_blob]["keys"] == ["model.frozen"]
    assert bad.doc["ok"] is False and "verify found problems" in bad.err
    assert sampled.rc in (0, 1) and 0 < sampled.doc["blobs_checked"] < bad.doc["blobs_checked"]
    table_out = main_inproc(capsys, "verify", local_repo, "--table")
    assert table_out.rc == 1 and "missing" in table_out.out and "corrupt" in table_out.out

    # a truncated manifest: ls lists it as unreadable, verify reports it, show/gc fail clearly
    man = root / "checkpoints" / "step-100.json"
    man.write_bytes(man.read_bytes()[:50])
    ls, show, gc = ckpt_many(("ls", local_repo), ("show", local_repo, "step-100"),
                             ("gc", local_repo, "--grace", "0"))
    assert ls.rc == 1 and [r["name"] for r in ls.doc["checkpoints"]] == ["step-200"]
    assert ls.doc["errors"][0]["name"] == "step-100" and "step-100" in ls.err
    assert "not valid JSON" in one_error_line(show)
    assert "nothing deleted" in one_error_line(gc)  # unknown references: gc must not guess
    ver = main_inproc(capsys, "verify", local_repo, "step-100", "--json")
    assert ver.rc == 1 and json.loads(ver.out)["manifest_problems"][0]["name"] == "step-100"
    rm = main_inproc(capsys, "rm", local_repo, "step-100", "--json")  # a corrupt one can go
    assert rm.rc == 0 and json.loads(rm.out)["deleted"] == ["step-100"]


def test_verify_on_s3_with_flipped_and_deleted_blobs(s3_repo: str, moto_endpoint: str) -> None:
    import boto3

    with CheckpointStore(s3_repo, create=False, endpoint_url=moto_endpoint) as repo:
        w_blob = _blob_of(repo, "step-100", "model.w")
        frozen_blob = _blob_of(repo, "step-100", "model.frozen")
    bucket, prefix = s3_repo[len("s3://"):].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    key = f"{prefix}/{blob_key(w_blob)}"
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[0] ^= 0x80
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    s3.delete_object(Bucket=bucket, Key=f"{prefix}/{blob_key(frozen_blob)}")
    man = f"{prefix}/checkpoints/step-200.json"
    s3.put_object(Bucket=bucket, Key=man,
                  Body=s3.get_object(Bucket=bucket, Key=man)["Body"].read()[:-7])
    r = ckpt("verify", s3_repo, "--endpoint-url", moto_endpoint)
    assert r.rc == 1, r.err
    got = {p["blob"]: (p["problem"], p["checkpoints"], p["keys"]) for p in r.doc["problems"]}
    assert got == {w_blob: ("corrupt", ["step-100"], ["model.w"]),
                   frozen_blob: ("missing", ["step-100"], ["model.frozen"])}
    assert [m["name"] for m in r.doc["manifest_problems"]] == ["step-200"]


# ------------------------------------------------------------------------------- rm, gc
def age_blobs(repo: str) -> None:
    """Make every blob older than gc's floor (MIN_BLOB_AGE) on the store's clock: file mtimes."""
    old = time.time() - MIN_BLOB_AGE - 60
    for path in Path(repo, "blobs").rglob("*"):
        if path.is_file():
            os.utime(path, (old, old))


def test_rm_then_gc_dry_run_grace_and_delete(local_repo: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    r = ckpt("rm", local_repo, "step-100")
    assert r.rc == 0 and r.doc["deleted"] == ["step-100"]
    fresh = ckpt("gc", local_repo, "--grace", "0", "--dry-run")  # young: kept whatever grace
    assert fresh.rc == 0 and fresh.doc["deleted_blobs"] == 0 and fresh.doc["kept_young_blobs"]
    age_blobs(local_repo)
    dry, young = ckpt_many(("gc", local_repo, "--grace", "0", "--dry-run"),
                           ("gc", local_repo, "--grace", "1h"))
    assert dry.rc == 0 and dry.doc["dry_run"] is True and dry.doc["deleted_blobs"] > 0
    assert young.rc == 0 and young.doc["deleted_blobs"] == 0
    assert young.doc["kept_young_blobs"] == dry.doc["deleted_blobs"]
    gone = ckpt("gc", local_repo, "--grace", "0")
    assert gone.rc == 0 and gone.doc["deleted_blobs"] == dry.doc["deleted_blobs"]
    assert gone.doc["freed_bytes"] == dry.doc["freed_bytes"] > 0
    after = json.loads(main_inproc(capsys, "du", local_repo, "--json").out)
    assert after["totals"]["unreferenced_blobs"] == 0
    ver = main_inproc(capsys, "verify", local_repo, "--json")
    assert ver.rc == 0 and json.loads(ver.out)["ok"] is True  # step-200 kept all it needs
    rm_missing = main_inproc(capsys, "rm", local_repo, "step-100")
    assert "no checkpoint 'step-100'" in one_error_line(rm_missing)


def test_rm_and_gc_on_s3(s3_repo: str, moto_endpoint: str) -> None:
    ep = ("--endpoint-url", moto_endpoint)
    assert ckpt("rm", s3_repo, "step-200", *ep).rc == 0
    gc = ckpt("gc", s3_repo, "--grace", "0", *ep)  # the blobs are seconds old on S3's clock
    assert gc.rc == 0 and gc.doc["deleted_blobs"] == 0 and gc.doc["kept_young_blobs"] > 0, gc.err
    with CheckpointStore(s3_repo, create=False, endpoint_url=moto_endpoint) as repo:
        assert repo.names() == ["step-100"] and repo.verify("step-100").ok


SAVER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from ckptstore import CheckpointStore
    from ckptstore.maintenance.leases import save_lease

    uri, flag = sys.argv[1], sys.argv[2]
    repo = CheckpointStore(uri, chunk_bytes=256 * 1024, workers=2)
    put = repo.store.put
    def slow_put(key, data):  # a slow link: the save stays in flight for seconds
        put(key, data)
        if key.startswith("blobs/"):
            open(flag, "a").close()
            while not os.path.exists(flag + ".go"):  # the test's first gc runs in here
                time.sleep(0.01)
            time.sleep(0.03)
    repo.store.put = slow_put
    rng = np.random.default_rng(7)
    base = repo.load("base")
    state = {"base": base, "new": rng.standard_normal((64, 131072), dtype=np.float32)}
    with save_lease(repo.store):
        info = repo.save("big", state)
    np.save(flag + ".npy", state["new"])
    print(info.chunks_written, info.chunks_reused)
""")


def test_gc_grace_zero_during_a_save_in_another_process(tmp_path: Path) -> None:
    """A save runs in another process (32 MiB over a slow link, holding a save lease) while
    `ckpt gc --grace 0` runs again and again; afterwards the checkpoint loads whole."""
    uri = str(tmp_path / "repo")
    rng = np.random.default_rng(1)
    base = {"frozen": rng.standard_normal((512, 1024), dtype=np.float32)}
    with CheckpointStore(uri, chunk_bytes=256 * 1024) as repo:
        repo.save("base", base)
        repo.save("garbage", {"x": rng.standard_normal(300_000).astype(np.float32)})
        repo.delete("garbage")  # unreferenced blobs for gc to find
    flag = tmp_path / "started"
    saver = subprocess.Popen([sys.executable, "-c", SAVER, uri, str(flag)], env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not flag.exists():
            assert saver.poll() is None, saver.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        runs = [ckpt("gc", uri, "--grace", "0")]  # the save is held mid-flight: must refuse
        Path(f"{flag}.go").touch()
        while saver.poll() is None:  # and again while the blobs keep coming
            runs.append(ckpt("gc", uri, "--grace", "0"))
        out, err = saver.communicate(timeout=TIMEOUT)
    finally:
        if saver.poll() is None:
            saver.kill()
    assert saver.returncode == 0, err
    assert runs, "gc never ran during the save"
    for r in runs:
        assert r.rc in (0, 75), r.err
        if r.rc == 75:
            assert "save(s) in progress" in one_error_line(r, 75)
    assert runs[0].rc == 75, "the gc during the held save did not refuse"
    age_blobs(uri)
    final = ckpt("gc", uri, "--grace", "0")
    assert final.rc == 0, final.err
    assert final.doc["deleted_blobs"] + sum(
        r.doc["deleted_blobs"] for r in runs if r.rc == 0) >= 1  # the garbage went
    with CheckpointStore(uri, create=False) as repo:
        loaded = repo.load("big")
        assert np.array_equal(loaded["base"]["frozen"], base["frozen"])
        assert np.array_equal(loaded["new"], np.load(str(flag) + ".npy"))
        assert repo.verify("big").ok
        assert repo.verify("base").ok


# ------------------------------------------------------------------------------- cp
def test_cp_local_to_s3_and_back_sends_only_missing_blobs(local_repo: str, s3_uri: str,
                                                           moto_endpoint: str,
                                                           tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    ep = ("--endpoint-url", moto_endpoint)
    first = ckpt("cp", local_repo, s3_uri, "step-100", *ep)
    assert first.rc == 0, first.err
    assert first.doc["copied"] == ["step-100"] and first.doc["blobs_present"] == 0
    second = ckpt("cp", local_repo, s3_uri, "step-100", "step-200", "--verify", *ep)
    assert second.rc == 0, second.err
    assert second.doc["copied"] == ["step-200"] and second.doc["skipped"] == ["step-100"]
    assert second.doc["blobs_present"] > 0  # frozen and b were not sent again
    assert second.doc["blobs_sent"] == second.doc["blobs_needed"] - second.doc["blobs_present"]
    assert second.doc["verified"] is True
    back = str(tmp_path / "back")
    r = ckpt("cp", s3_uri, back, "latest", *ep)
    assert r.rc == 0 and r.doc["copied"] == ["step-200"], r.err
    d = main_inproc(capsys, "diff", local_repo, "step-200", back, "step-200", "--json")
    assert d.rc == 0 and json.loads(d.out)["same"] is True


def test_cp_refuses_a_corrupt_source_and_commits_nothing(local_repo: str, tmp_path: Path) -> None:
    with CheckpointStore(local_repo, create=False) as repo:
        blob = _blob_of(repo, "step-200", "model.w")
    path = Path(local_repo) / blob_key(blob)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    dst = str(tmp_path / "dst")
    r = ckpt("cp", local_repo, dst, "step-200")
    line = one_error_line(r)
    assert blob in line and "corrupt" in line
    assert not list((Path(dst) / "checkpoints").glob("*.json"))


# ------------------------------------------------------------------------------- errors
def test_store_errors_are_one_line_and_exit_2(tmp_path: Path, moto_endpoint: str) -> None:
    missing = tmp_path / "no-such-repo"
    bad_marker = tmp_path / "bad"
    bad_marker.mkdir()
    (bad_marker / "ckptstore.json").write_text("{not json")
    cases = [
        (("ls", str(missing)), "no ckptstore repository"),
        (("ls", "ftp://host/x"), "unknown store scheme"),
        (("ls", str(bad_marker)), "not valid JSON"),
        (("ls", "s3://missing-bucket-x/p", "--endpoint-url", moto_endpoint), "does not exist"),
        (("ls", "s3://some-bucket/p", "--endpoint-url", "http://127.0.0.1:1",
          "--max-attempts", "1"), "cannot reach S3 endpoint"),
    ]
    results = ckpt_many(*(args for args, _ in cases))
    for (args, expected), r in zip(cases, results):
        assert expected in one_error_line(r), (args, r.err)
    no_creds = _env({"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "x"),
                     "AWS_CONFIG_FILE": str(tmp_path / "x")})
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        no_creds.pop(var, None)
    creds = ckpt("ls", "s3://some-bucket/p", "--endpoint-url", moto_endpoint, env=no_creds)
    assert "no usable AWS credentials" in one_error_line(creds)
    assert not missing.exists()  # a read command never creates a folder


def test_argument_and_lookup_errors_are_one_line(local_repo: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (("show", local_repo, "nope"), "no checkpoint 'nope'"),
        (("show", local_repo, "../etc"), "invalid checkpoint name"),
        (("show", local_repo, "step-100", "--keys", "zzz*"), "no keys matching"),
        (("gc", local_repo, "--grace", "soon"), "invalid duration"),
        (("verify", local_repo, "--sample", "0"), "fraction"),
        (("frobnicate",), "invalid choice"),
        (("diff", local_repo, "step-100"), "diff takes"),
        ((), "choose a command"),
        (("import", local_repo, "x", str(tmp_path / "none.safetensors")), "no such file"),
        (("import", local_repo, "x", str(tmp_path), "--metadata", "[1]"), "JSON object"),
        (("export", local_repo, "step-100", str(tmp_path / "out.txt")), "cannot tell the format"),
        (("cp", local_repo, str(tmp_path / "d"), "step-100", "nope"), "no checkpoint 'nope'"),
    ]
    for args, expected in cases:
        r = main_inproc(capsys, *args)
        assert expected in one_error_line(r), (args, r.err)
    assert not (tmp_path / "d" / "checkpoints").exists() or not list(
        (tmp_path / "d" / "checkpoints").iterdir())


# ------------------------------------------------------------------------------- export / import
def test_export_import_roundtrip_through_the_cli(local_repo: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "w.safetensors"
    exp = ckpt("export", local_repo, "step-200", str(out))
    assert exp.rc == 0, exp.err
    assert exp.doc["tensors"] == 4 and set(exp.doc["skipped"]) == {"step", "lr"}
    assert "left out" in exp.err
    imp = ckpt("import", local_repo, "reimported", str(out))
    assert imp.rc == 0, imp.err
    assert imp.doc["format"] == "safetensors" and imp.doc["tensors"] == 4
    d = json.loads(main_inproc(capsys, "diff", local_repo, "step-200", "reimported").out)
    # numpy arrays come back as torch tensors; plain values are not in safetensors
    assert set(d["removed"]) == {"step", "lr"} and not d["added"]
    assert {c["detail"] for c in d["changed"]} == {"kind numpy -> torch"}
    show = json.loads(main_inproc(capsys, "show", local_repo, "reimported").out)
    assert show["metadata"]["step"] == 200  # user metadata travels in __metadata__
    again = main_inproc(capsys, "export", local_repo, "step-200", str(out))
    assert "exists" in one_error_line(again)


def test_dcp_import_requires_trust(tmp_path: Path) -> None:
    dcp_dir = tmp_path / "dcp"
    dcp_dir.mkdir()
    (dcp_dir / ".metadata").write_bytes(b"not even a pickle")
    r = ckpt("import", str(tmp_path / "repo"), "x", str(dcp_dir))
    assert "pickle" in one_error_line(r) and "--trust-pickle" in r.err
    assert not (tmp_path / "repo").exists()  # refused before touching the destination
