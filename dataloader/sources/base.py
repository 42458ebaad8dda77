"""What every converter returns: a Source (format name, files, size hint, sample stream)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMATS = ("jsonl", "parquet", "numpy", "files", "webdataset", "hf")

Sample = dict[str, Any]


@dataclass
class Source:
    """A dataset to convert. `samples()` yields its samples in a fixed order (the files in
    sorted path order); `num_samples` is the count when the format records it (else None),
    `num_bytes` the size of the input files (for progress and metadata)."""

    format: str
    files: Sequence[Path]
    open_samples: Callable[[], Iterator[Sample]]
    num_samples: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    #: The samples of file i alone, for formats whose files hold many samples each (they can
    #: be converted file by file, in parallel processes); None for the others.
    file_samples: Callable[[int], Iterator[Sample]] | None = None

    @property
    def num_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files)

    def samples(self) -> Iterator[Sample]:
        return self.open_samples()

    def metadata(self) -> dict[str, Any]:
        """What the dataset's metadata records about its origin."""
        return {"format": self.format, "files": len(self.files), **self.details}


def files_with(src: Path, suffixes: tuple[str, ...], what: str) -> list[Path]:
    """`src` itself if it is such a file, else the matching files under folder `src`
    (recursively, sorted by path). FileNotFoundError when there are none."""
    if src.is_file():
        if not src.name.endswith(suffixes):
            raise ValueError(f"{src}: not a {what} file ({' or '.join(suffixes)})")
        return [src]
    found = sorted(p for p in src.rglob("*") if p.is_file() and p.name.endswith(suffixes))
    if not found:
        raise FileNotFoundError(f"{src}: no {what} files ({' or '.join(suffixes)}) in this folder")
    return found
