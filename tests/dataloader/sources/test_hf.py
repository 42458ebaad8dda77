"""Hugging Face inputs: `datasets.Dataset` objects to `write_dataset`, and the `load_dataset`
cache (Arrow IPC stream files + dataset_info.json) to `ckpt-data convert`, every row back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest

import dataloader
from dataloader.cli import main
from dataloader.sources import open_source


def _rows(uri: str | Path) -> list[dict[str, Any]]:
    """Every stored sample as plain Python values (arrays as lists), without `_index`."""
    out = []
    for s in dataloader.StreamingDataset(str(uri)):
        out.append({k: (v.tolist() if isinstance(v, np.ndarray) else
                        v.item() if isinstance(v, np.generic) else v)
                    for k, v in s.items() if k != "_index"})
    return out


def _convert(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict | None, str]:
    capsys.readouterr()
    code = main(["convert", *argv, "--json", "--no-progress"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """load_dataset on local files only: no hub lookups."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)


COLUMNS = {
    "id": list(range(30)),
    "score": [i / 4 for i in range(30)],
    "ok": [i % 3 == 0 for i in range(30)],
    "text": [f"row {i} é" for i in range(30)],
    "ids": [list(range(i % 5)) for i in range(30)],
    "emb": [[i + 0.5, -i / 2] for i in range(30)],
    "grid": [[[i, i + 1], [i + 2, i + 3]] for i in range(30)],
}


def test_a_dataset_object_round_trips_every_row(tmp_path: Path) -> None:
    d = datasets.Dataset.from_dict(COLUMNS)
    view = d.shuffle(seed=4).select(range(25))  # an indices mapping over the Arrow table
    want = [view[i] for i in range(len(view))]
    dataloader.write_dataset(str(tmp_path / "a"), view)
    assert _rows(tmp_path / "a") == want
    dataloader.write_dataset(str(tmp_path / "b"), view, workers=2, partition_rows=8)
    assert _rows(tmp_path / "b") == want
    dataloader.write_dataset(str(tmp_path / "c"), d.to_iterable_dataset())
    assert _rows(tmp_path / "c") == [d[i] for i in range(len(d))]
    ds = dataloader.StreamingDataset(str(tmp_path / "a"))
    kinds = {f.name: (f.kind, f.dtype) for f in ds.index.fields}
    assert kinds["text"] == ("str", "|u1") and kinds["ids"] == ("ragged", "<i8")
    assert kinds["grid"][0] == "ragged" and ds[0]["grid"].shape == (2, 2)


def test_bad_dataset_objects_get_one_clear_error(tmp_path: Path) -> None:
    d = datasets.Dataset.from_dict({"id": [1, 2], "meta": [{"a": 1}, {"a": 2}]})
    with pytest.raises(TypeError, match=r"datasets\.Dataset.*column 'meta' has type struct"):
        dataloader.write_dataset(str(tmp_path / "a"), d)
    dd = datasets.DatasetDict({"train": d, "test": d})
    splits = r"DatasetDict with splits \['test', 'train'\].*d\['test'\]"
    with pytest.raises(TypeError, match=splits):
        dataloader.write_dataset(str(tmp_path / "b"), dd)
    with pytest.raises(ValueError, match="null"):
        dataloader.write_dataset(str(tmp_path / "c"),
                                 datasets.Dataset.from_dict({"x": [1, None]}))
    assert not (tmp_path / "a" / "dataset.json").exists()


def test_a_load_dataset_cache_converts_every_row(tmp_path: Path, offline: None,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{k: v[i] for k, v in COLUMNS.items()} for i in range(30)]
    for name, part in (("a", rows[:12]), ("b", rows[12:]), ("t", rows[:5])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    cache = tmp_path / "cache"
    files = {"train": [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")],
             "test": str(tmp_path / "t.jsonl")}
    loaded = datasets.load_dataset("json", data_files=files, cache_dir=str(cache))
    train = [loaded["train"][i] for i in range(30)]
    assert train == rows
    folder = Path(loaded["train"].cache_files[0]["filename"]).parent
    loaded["train"].map(lambda r: {"id": r["id"] + 1})  # writes a cache-*.arrow beside them
    assert any(p.name.startswith("cache-") for p in folder.iterdir())
    # the cache root, the dataset's own folder, one of its .arrow files
    code, _, err = _convert(capsys, str(cache), str(tmp_path / "x"))
    assert code == 2 and "splits ['test', 'train']: pass --split NAME" in err
    code, s, _ = _convert(capsys, str(cache), str(tmp_path / "d1"), "--split", "train")
    assert code == 0 and s is not None and s["num_samples"] == 30
    assert s["metadata"]["source"]["layout"] == "cache"
    assert s["metadata"]["source"]["features"]["text"] == "string"
    assert _rows(tmp_path / "d1") == train
    code, s, _ = _convert(capsys, str(folder), str(tmp_path / "d2"), "--split", "test",
                          "--workers", "1")
    assert code == 0 and _rows(tmp_path / "d2") == rows[:5]
    code, s, _ = _convert(capsys, str(folder / "json-test.arrow"), str(tmp_path / "d3"))
    assert code == 0 and _rows(tmp_path / "d3") == rows[:5]
    # the same through the Python API: a Source, or a path
    dataloader.write_dataset(str(tmp_path / "d4"), open_source(folder, split="train"))
    assert _rows(tmp_path / "d4") == train
    dataloader.write_dataset(str(tmp_path / "d5"), folder / "json-test.arrow")
    assert _rows(tmp_path / "d5") == rows[:5]


def test_a_sharded_cache_is_read_in_shard_order(tmp_path: Path, offline: None,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    for f in range(2):
        (tmp_path / f"{f}.jsonl").write_text(
            "".join(json.dumps({"id": f * 10 + i, "t": f"x{i}"}) + "\n" for i in range(10)))
    loaded = datasets.load_dataset(
        "json", data_files={"train": [str(tmp_path / "0.jsonl"), str(tmp_path / "1.jsonl")]},
        cache_dir=str(tmp_path / "cache"), num_proc=2)
    folder = Path(loaded["train"].cache_files[0]["filename"]).parent
    names = sorted(p.name for p in folder.glob("*.arrow"))
    assert names == ["json-train-00000-of-00002.arrow", "json-train-00001-of-00002.arrow"]
    code, s, _ = _convert(capsys, str(tmp_path / "cache"), str(tmp_path / "ds"))
    assert code == 0 and s is not None and s["metadata"]["source"]["files"] == 2
    assert _rows(tmp_path / "ds") == [loaded["train"][i] for i in range(20)]
    (folder / "json-train-00001-of-00002.arrow").unlink()  # an incomplete cache
    code, _, err = _convert(capsys, str(folder), str(tmp_path / "ds2"))
    assert code == 2 and "not 0..1 of 2" in err and err.count("\n") == 1


def test_bad_cache_files_get_one_clear_error(tmp_path: Path, offline: None,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "json-train.arrow").write_text('{"not": "arrow"}\n')
    code, _, err = _convert(capsys, str(bad), str(tmp_path / "x"))
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("ckpt-data: error: ") and "json-train.arrow: not an Arrow IPC file" in err
    (tmp_path / "m.jsonl").write_text('{"id": 1, "meta": {"a": 1}}\n{"id": 2, "meta": {"a": 2}}\n')
    loaded = datasets.load_dataset("json", data_files=str(tmp_path / "m.jsonl"),
                                   cache_dir=str(tmp_path / "cache"))
    arrow = loaded["train"].cache_files[0]["filename"]
    code, _, err = _convert(capsys, arrow, str(tmp_path / "y"))
    assert code == 2 and err.count("\n") == 1
    assert "json-train.arrow" in err and "column 'meta' has type struct" in err
    assert not (tmp_path / "y" / "dataset.json").exists()
