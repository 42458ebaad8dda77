"""Installs that fit users' environments: a missing optional dependency is one line naming the
extra to install, in the API and in the CLI; `python -m ckptstore` is the CLI; the package
declares ranges, and the exact torch pin lives only in the CI constraints."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs `code` with the modules in argv[1] (comma-separated) made unimportable, as if not
# installed: a meta-path finder raises ModuleNotFoundError for them and their submodules.
HIDE = textwrap.dedent("""
    import sys
    hidden = set(sys.argv[1].split(","))

    class Hide:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in hidden:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Hide())
    sys.argv = [sys.argv[0], *sys.argv[2:]]
""")


def run_without(modules: str, code: str, *args: str, cwd: Path | None = None
                ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", HIDE + textwrap.dedent(code), modules, *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                               "AWS_ACCESS_KEY_ID": "testing",
                               "AWS_SECRET_ACCESS_KEY": "testing"})


def _cli_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "internal error" not in lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from ckptstore import CheckpointStore

    root = tmp_path_factory.mktemp("installs") / "repo"
    with CheckpointStore(root) as repo:
        repo.save("s1", {"w": torch.ones(4), "n": 1})
    return root


def test_cli_without_torch_names_the_extra(saved: Path, tmp_path: Path) -> None:
    cli = "from ckptstore.cli import main; raise SystemExit(main(sys.argv[1:]))"
    ls = run_without("torch", cli, "ls", str(saved))  # reading needs no torch
    assert ls.returncode == 0, ls.stderr
    line = _cli_error(run_without("torch,safetensors", cli, "export", str(saved), "s1",
                                  str(tmp_path / "m.safetensors")))
    assert "pip install 'ckptstore[torch]'" in line, line
    line = _cli_error(run_without("boto3,botocore", cli, "ls", "s3://bucket/x",
                                  "--endpoint-url", "http://127.0.0.1:1"))
    assert "pip install 'ckptstore[s3]'" in line, line


def test_api_without_optional_packages_raises_one_clear_error(saved: Path) -> None:
    code = """
        import ckptstore
        try:
            {call}
        except ckptstore.MissingDependencyError as exc:
            assert isinstance(exc, ImportError) and isinstance(exc, ckptstore.CkptStoreError)
            print(exc)
        else:
            raise SystemExit("no error")
    """
    cases = {
        "boto3,botocore": ("ckptstore.CheckpointStore('s3://bucket/x', "
                           "endpoint_url='http://127.0.0.1:1')", "ckptstore[s3]"),
        "torch": ("ckptstore.CheckpointManager('runs/x')", "ckptstore[torch]"),
        "lightning": ("import ckptstore.lightning", "ckptstore[lightning]"),
        "ray": ("import dataloader.write.ray_datasink", "ckptstore[ray]"),
    }
    for hidden, (call, extra) in cases.items():
        proc = run_without(hidden, code.format(call=call), cwd=saved.parent)
        assert proc.returncode == 0, (hidden, proc.stdout, proc.stderr)
        message = proc.stdout.strip()
        assert f"pip install '{extra}'" in message and "\n" not in message, message
    # a numpy-only user reads a checkpoint holding torch tensors: the same one line
    proc = run_without("torch", code.format(
        call=f"ckptstore.CheckpointStore({str(saved)!r}).load('s1')"))
    assert proc.returncode == 0 and "ckptstore[torch]" in proc.stdout, proc.stderr


def test_core_import_needs_neither_torch_nor_boto3(saved: Path) -> None:
    proc = run_without("torch,boto3,botocore,safetensors,lightning", """
        import numpy as np, ckptstore
        repo = ckptstore.CheckpointStore(sys.argv[1])
        repo.save("np", {"a": np.arange(5)})
        assert repo.load("np")["a"].tolist() == [0, 1, 2, 3, 4]
        assert repo.verify("s1").ok
        print("ok")
    """, str(saved))
    assert proc.stdout.strip() == "ok", proc.stderr


def test_python_dash_m_ckptstore_is_the_cli(saved: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "ckptstore", "--json", "ls", str(saved)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert '"name": "s1"' in proc.stdout
    version = subprocess.run([sys.executable, "-m", "ckptstore", "--version"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert version.stdout.startswith("ckpt ")


def test_package_declares_ranges_and_ci_pins() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    assert not any(d.startswith("boto3") for d in meta["dependencies"])
    assert any(d.startswith("boto3>=") for d in extras["s3"])
    assert [d for d in extras["torch"] if d.startswith("torch")] == ["torch>=2.5"]
    assert not any("==" in d for deps in extras.values() for d in deps)
    assert {d.split(">")[0] for d in extras["dev"]} == {"ruff", "mypy"}
    assert not any(d.startswith(("ruff", "mypy")) for d in extras["test"])
    constraints = (ROOT / ".ci" / "constraints.txt").read_text().split()
    assert "torch==2.13.0" in constraints
    run = (ROOT / ".ci" / "run").read_text()
    assert "-c .ci/constraints.txt" in run and "dev]" in run and "mypy" in run
