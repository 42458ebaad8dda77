"""Optional dependencies: the one place that turns a missing optional package into one clear
line naming the extra that installs it (`pip install 'ckptstore[torch]'`, `ckptstore[s3]`).

Modules that need an optional package import it through `require(...)`, or wrap their
top-level import in ``except ModuleNotFoundError as exc: raise missing(exc) from None``, so
the API and the CLI both report a `MissingDependencyError` instead of a bare
ModuleNotFoundError (or, in the CLI, an "internal error")."""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingDependencyError

#: top-level module -> (extra that installs it, what needs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "torch": ("torch", "torch tensors, import/export and CheckpointManager"),
    "safetensors": ("torch", "safetensors import/export"),
    "boto3": ("s3", "s3:// URIs"),
    "botocore": ("s3", "s3:// URIs"),
    "lightning": ("lightning", "the Lightning plugin"),
    "ray": ("ray", "dataloader.RayDatasink"),
    "matplotlib": ("bench", "benchmark charts"),
}


def missing(exc: ModuleNotFoundError) -> ImportError:
    """The error to raise for `exc`: a MissingDependencyError naming the extra when the missing
    module is one of ours to name, else `exc` itself (a broken install says more by itself)."""
    top = (exc.name or "").partition(".")[0]
    if top not in EXTRAS:
        return exc
    extra, purpose = EXTRAS[top]
    return MissingDependencyError(f"{top} is not installed (needed for {purpose}): "
                                  f"pip install 'ckptstore[{extra}]'")


def require(module: str) -> ModuleType:
    """Import and return `module`, or raise `missing(...)` for it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise missing(exc) from None
