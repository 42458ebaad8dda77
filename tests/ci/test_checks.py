"""The repository checks of .ci/ fail when what they guard is broken: each case builds a small
fake tree in tmp_path, runs the script on it (`--root`) and reads its exit code and lines.

    .ci/check_docs.py    backticked names in README.md / docs/*.md exist
    .ci/check_layers.py  the layer map, no import cycles, where optional packages are imported
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK_DOCS = ROOT / ".ci" / "check_docs.py"
CHECK_LAYERS = ROOT / ".ci" / "check_layers.py"


def load(path: Path) -> ModuleType:
    """A .ci script as a module (registered first: its dataclasses need sys.modules)."""
    name = f"ci_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return root


def run(script: Path, root: Path) -> tuple[int, list[str], str]:
    proc = subprocess.run([sys.executable, str(script), "--root", str(root)],
                          capture_output=True, text=True, timeout=60, check=False)
    return proc.returncode, proc.stdout.splitlines(), proc.stderr


# ----------------------------------------------------------------------------- layers

LAYER_DOC = '''\
    """fake ckptstore.

    Where things are (imports flow down this list only):

        errors.py    the errors
        format/      what is stored: names,
                     and more names
        stores/      local folder, S3
        cli/         the command
    """
    '''


def layered_tree(root: Path, changes: dict[str, str] | None = None) -> Path:
    """A clean fake ckptstore (and dataloader) that respects every rule; `changes` adds or
    replaces files."""
    files = {
        "ckptstore/__init__.py": LAYER_DOC + "from .stores.local import LocalStore\n",
        "ckptstore/errors.py": "class CkptStoreError(Exception): ...\n",
        "ckptstore/format/__init__.py": "",
        "ckptstore/format/names.py": "from ..errors import CkptStoreError\n",
        "ckptstore/format/torch_types.py": "import torch\n",
        "ckptstore/stores/__init__.py": "from .local import LocalStore\n",
        "ckptstore/stores/local.py": """
            from __future__ import annotations
            from typing import TYPE_CHECKING
            from ..format import names
            if TYPE_CHECKING:
                from .memory import MemoryStore
            class LocalStore: ...
            """,
        "ckptstore/stores/memory.py": "from .local import LocalStore\n",
        "ckptstore/stores/s3.py": "import boto3\nfrom botocore.config import Config\n",
        "ckptstore/stores/testing.py": "import pytest\n",
        "ckptstore/torchft.py": "import torch\nimport torchft\n",  # allowed both, at the top
        "ckptstore/cli/__init__.py": """
            from ..stores import local
            def main() -> None:
                from ..format import names
            """,
        "dataloader/__init__.py": '"""fake dataloader (no layer map)."""\nimport ckptstore\n',
        "dataloader/write/ray_datasink.py": "import ray\n",
        "dataloader/loading/collate.py": "from ckptstore.deps import require\n"
                                         "torch = require('torch')\n",
    }
    files.update(changes or {})
    return write(root, files)


def test_layers_clean_tree_passes(tmp_path: Path) -> None:
    code, out, err = run(CHECK_LAYERS, layered_tree(tmp_path))
    assert (code, out) == (0, []), err
    assert "dataloader/__init__.py has no layer map" in err  # skipped, with a note


@pytest.mark.parametrize(("changes", "expected"), [
    pytest.param({"ckptstore/format/names.py": "from ..stores import local\n"},
                 "ckptstore/format/names.py:1: format/ imports ckptstore.stores.local, but "
                 "stores/ is listed below format/", id="upward"),
    pytest.param({"ckptstore/errors.py": "def f():\n    from .cli import main\n"},
                 "ckptstore/errors.py:2: errors.py imports ckptstore.cli (inside a function)",
                 id="upward-in-a-function"),
    pytest.param({"ckptstore/format/names.py": "from typing import TYPE_CHECKING\n"
                  "if TYPE_CHECKING:\n    from ..stores.local import LocalStore\n"},
                 "ckptstore/format/names.py:3: format/ imports ckptstore.stores.local (under "
                 "TYPE_CHECKING)", id="upward-for-types"),
    pytest.param({"ckptstore/stores/memory.py": "from .local import LocalStore\n",
                  "ckptstore/stores/local.py": "def f():\n    from . import memory\n"},
                 "ckptstore/stores/local.py:2: import cycle ckptstore.stores.local -> "
                 "ckptstore.stores.memory -> ckptstore.stores.local", id="two-module-cycle"),
    pytest.param({"ckptstore/stores/local.py": "import boto3\n"},
                 "ckptstore/stores/local.py:1: imports boto3; only ckptstore/stores/s3.py may",
                 id="boto3-outside-s3"),
    pytest.param({"ckptstore/format/names.py": "from botocore.exceptions import ClientError\n"},
                 "ckptstore/format/names.py:1: imports botocore; only ckptstore/stores/s3.py "
                 "may", id="botocore-outside-s3"),
    pytest.param({"ckptstore/cli/__init__.py": "def main():\n    import torch\n"},
                 "ckptstore/cli/__init__.py:2: imports torch; only the", id="torch-in-cli"),
    pytest.param({"ckptstore/stores/local.py": "from ..deps import require\n"
                  "torch = require('torch')\n"},
                 "ckptstore/stores/local.py:2: imports torch (require(\"torch\"))",
                 id="torch-through-require"),
    pytest.param({"ckptstore/stores/local.py": "import ray.data\n"},
                 "ckptstore/stores/local.py:1: imports ray; only dataloader/write/ray_datasink.py "
                 "may", id="ray-outside-the-datasink"),
    pytest.param({"ckptstore/extra.py": ""},
                 "ckptstore/extra.py:1: `extra.py` is not in the layer map", id="unlisted"),
    pytest.param({"ckptstore/__init__.py": LAYER_DOC.replace("stores/ ", "tiers/  ")},
                 "layer map names `tiers/`, which does not exist", id="stale-map-entry"),
    pytest.param({"ckptstore/stores/s3.py": "", "ckptstore/stores/s3_client.py": "import boto3"},
                 "ckptstore/stores/s3_client.py:1: imports boto3", id="boto3-moved"),
    pytest.param({"ckptstore/format/torch_types.py": None},
                 "allows torch in ckptstore/format/torch_types.py, which does not exist",
                 id="allowed-module-gone"),
    pytest.param({"ckptstore/stores/local.py": "import dataloader\n"},
                 "ckptstore/stores/local.py:1: ckptstore imports dataloader", id="reverse"),
])
def test_layers_broken_tree_fails(tmp_path: Path, changes: dict[str, str | None],
                                  expected: str) -> None:
    root = layered_tree(tmp_path, {k: v for k, v in changes.items() if v is not None})
    for rel, text in changes.items():
        if text is None:
            (root / rel).unlink()
    code, out, _ = run(CHECK_LAYERS, root)
    assert code == 1
    assert any(expected in line for line in out), out


def test_layers_typing_only_cycle_is_no_cycle(tmp_path: Path) -> None:
    """stores/local.py names MemoryStore under TYPE_CHECKING; memory.py imports local.py."""
    code, out, _ = run(CHECK_LAYERS, layered_tree(tmp_path))
    assert code == 0 and not any("cycle" in line for line in out)


def test_layers_longer_cycle_names_every_step(tmp_path: Path) -> None:
    root = layered_tree(tmp_path, {
        "ckptstore/format/a.py": "from . import b\n",
        "ckptstore/format/b.py": "from . import c\n",
        "ckptstore/format/c.py": "def f():\n    from .a import x\n",
    })
    code, out, _ = run(CHECK_LAYERS, root)
    assert code == 1
    cycle = [line for line in out if "import cycle" in line]
    assert len(cycle) == 1
    assert ("ckptstore.format.a -> ckptstore.format.b -> ckptstore.format.c -> "
            "ckptstore.format.a") in cycle[0]
    assert "ckptstore/format/c.py:2 imports ckptstore.format.a (inside a function)" in cycle[0]


def test_layers_dataloader_map_is_checked_when_present(tmp_path: Path) -> None:
    doc = '"""fake.\n\nimports flow down this list only:\n\n    errors.py  e\n    read/  r\n"""\n'
    root = layered_tree(tmp_path, {
        "dataloader/__init__.py": doc,
        "dataloader/errors.py": "from .read import blocks\n",
        "dataloader/read/blocks.py": "from ..errors import x\n",
    })
    code, out, err = run(CHECK_LAYERS, root)
    assert code == 1
    assert "no layer map" not in err
    assert any(line.startswith("dataloader/errors.py:1: errors.py imports dataloader.read."
                               "blocks") for line in out), out


def test_layer_map_of_this_repository_parses() -> None:
    """The real docstring keeps the format the check reads (first errors.py, last cli/)."""
    layers = load(CHECK_LAYERS)
    layer_map = layers.parse_layer_map(ROOT / "ckptstore" / "__init__.py")
    assert layer_map is not None
    order = sorted(layer_map.levels, key=layer_map.levels.__getitem__)
    assert order[0] == "errors.py" and order[-1] == "cli/", order
    assert len(order) >= 8


def test_entry_line_with_several_names_is_one_level(tmp_path: Path) -> None:
    layers = load(CHECK_LAYERS)
    init = write(tmp_path, {"__init__.py": '''
        """x.

        Imports flow down this list only:

            errors.py  redact.py   base utilities
            format/     formats
        """
        '''}) / "__init__.py"
    layer_map = layers.parse_layer_map(init)
    assert layer_map.levels == {"errors.py": 0, "redact.py": 0, "format/": 1}


# ----------------------------------------------------------------------------- docs


def docs_tree(root: Path, doc: str, extra: dict[str, str] | None = None) -> Path:
    files = {
        "ckptstore/__init__.py": """
            from .repository import CheckpointStore
            __all__ = ["CheckpointStore", "zarr_store"]
            def __getattr__(name):
                if name == "zarr_store":
                    from .tools.zarr_view import zarr_store
                    return zarr_store
                raise AttributeError(name)
            """,
        "ckptstore/repository.py": """
            from dataclasses import dataclass
            TIED = "ckptstore.tied"
            class Base:
                def wait(self) -> None: ...
            class CheckpointStore(Base):
                KIND = "x"
                def __init__(self) -> None:
                    self.tiers: list[str] = []
                def save(self) -> None: ...
            @dataclass
            class SaveInfo:
                stage_seconds: float
            """,
        "ckptstore/tools/__init__.py": "",
        "ckptstore/tools/zarr_view.py": "def zarr_store(): ...\n",
        "ckptstore/training/__init__.py": "",
        "ckptstore/training/manager.py": "class CheckpointManager:\n    def save(self): ...\n",
        "bench/run_bench.py": "",
        "docs/a.md": doc,
    }
    files.update(extra or {})
    return write(root, files)


GOOD_DOC = """
# Fine

`ckptstore.training.manager` and `ckptstore.CheckpointStore.save` exist, as do
`ckptstore/repository.py`, `training/manager.py`, `tools/zarr_view`, `docs/a.md`,
`repository.py`, `ckptstore.zarr_store(repo, "step-200")`, `CheckpointStore.tiers`,
`CheckpointStore.wait()` (inherited), `CheckpointStore.KIND`, `SaveInfo.stage_seconds`,
`repo.save(...)`, `mgr.save`, `manager.CheckpointManager`, `training/manager.CheckpointManager`,
`python bench/run_bench.py --fast`, `bench/run_bench.py --fast` and `ckptstore.tied` (a key the
code writes). Not code, so not checked: `s3://bucket/x`, `checkpoints/<name>.json`,
`runs/exp1`, `torch.Tensor.nope`, `ckptstore.json`, `dataset.json.arrays`, `blobs/xx/`,
`ckpt ls runs/exp1`, `-c .ci/constraints.txt`, `bench/results/out.json` (written by a run).

```python
ckptstore.not_in_a_fence_check()   # examples are not citations
```
"""


def test_docs_clean_tree_passes(tmp_path: Path) -> None:
    root = docs_tree(tmp_path, GOOD_DOC, {".gitignore": "/bench/results/\n"})
    code, out, err = run(CHECK_DOCS, root)
    assert (code, out) == (0, []), (out, err)


@pytest.mark.parametrize(("cited", "reported"), [
    ("ckptstore.training.nothere", "ckptstore.training.nothere"),
    ("ckptstore.tiers.far", "ckptstore.tiers.far"),
    ("ckptstore/tiers/far.py", "ckptstore/tiers/far.py"),
    ("training/peers.py", "training/peers.py"),
    ("training/manager.restore", "training/manager.restore"),
    ("ckptstore.CheckpointStore.load", "ckptstore.CheckpointStore.load"),
    ("CheckpointStore.load", "CheckpointStore.load"),
    ("CheckpointStore.load()", "CheckpointStore.load"),
    ("repo.load(...)", "repo.load"),
    ("SaveInfo.write_seconds", "SaveInfo.write_seconds"),
    ("ckptstore.zarr_view", "ckptstore.zarr_view"),
    ("python bench/gone_bench.py --x", "bench/gone_bench.py"),
    ("gone.py", "gone.py"),
    ("docs/gone.md", "docs/gone.md"),
])
def test_docs_stale_reference_fails(tmp_path: Path, cited: str, reported: str) -> None:
    root = docs_tree(tmp_path, f"# Title\n\nSee\n`{cited}` here.\n")
    code, out, _ = run(CHECK_DOCS, root)
    assert code == 1
    assert out == [f"docs/a.md:4: `{reported}` not found"]


def test_docs_span_wrapped_onto_the_next_line_is_found_on_its_line(tmp_path: Path) -> None:
    root = docs_tree(tmp_path, "one `a`\ntwo `ckptstore.gone`, three\n`CheckpointStore.gone`\n")
    code, out, _ = run(CHECK_DOCS, root)
    assert code == 1
    assert out == ["docs/a.md:2: `ckptstore.gone` not found",
                   "docs/a.md:3: `CheckpointStore.gone` not found"]


def test_docs_readme_and_contributing_are_checked(tmp_path: Path) -> None:
    root = docs_tree(tmp_path, "ok\n", {"README.md": "`ckptstore.gone`\n",
                                        "CONTRIBUTING.md": "# title\n`dataloader/gone.py`\n"})
    code, out, _ = run(CHECK_DOCS, root)
    assert code == 1
    assert out == ["README.md:1: `ckptstore.gone` not found",
                   "CONTRIBUTING.md:2: `dataloader/gone.py` not found"]


def test_docs_ignore_file_names_exceptions(tmp_path: Path) -> None:
    root = docs_tree(tmp_path, "`ckptstore.gone` and `repo.gone`\n", {
        ".ci/check_docs_ignore.txt": "docs/a.md: ckptstore.gone  # why\n"})
    code, out, _ = run(CHECK_DOCS, root)
    assert code == 1
    assert out == ["docs/a.md:1: `repo.gone` not found"]
