"""Which format a path holds, from its files' names (`--format auto`)."""

from __future__ import annotations

from pathlib import Path

_SUFFIXES = {
    "jsonl": (".jsonl", ".ndjson"),
    "parquet": (".parquet",),
    "numpy": (".npy", ".npz"),
    "webdataset": (".tar", ".tar.gz", ".tgz"),
    "hf": (".arrow",),  # Arrow IPC files: a load_dataset cache (or any Arrow files)
}


def detect_format(src: Path) -> str:
    """The one format `src` (a file or a folder) holds. A folder with a Hugging Face
    ``state.json`` or ``dataset_dict.json``, and any holding ``.arrow`` files (a load_dataset
    cache), is 'hf'. ValueError when no format or more than one is found; a folder of other
    files must be converted with ``--format files``."""
    if src.is_dir() and ((src / "state.json").is_file() or (src / "dataset_dict.json").is_file()):
        return "hf"
    names = [src.name] if src.is_file() else [p.name for p in src.rglob("*") if p.is_file()]
    found = sorted({fmt for fmt, suf in _SUFFIXES.items() for n in names if n.endswith(suf)})
    if len(found) == 1:
        return found[0]
    if found:
        several = ", ".join(found)
        raise ValueError(f"{src} holds files of several formats ({several}): pass --format")
    raise ValueError(
        f"{src}: no .jsonl, .parquet, .npy/.npz, .tar or .arrow files and no saved Hugging Face"
        " dataset (pass --format files to store every file as one sample)"
    )
