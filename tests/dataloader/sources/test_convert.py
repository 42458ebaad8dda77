"""`ckpt-data convert` from real files of every source format, and the CLI's conventions."""

from __future__ import annotations

import io
import json
import os
import pty
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

import dataloader
from dataloader.cli import main
from dataloader.format import INDEX_KEY

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROOT = Path(__file__).resolve().parents[3]


def convert(src: Path, dest: Path, *extra: str) -> dict:
    """Run convert with --json and return the summary (asserting exit code 0)."""
    out = io.StringIO()
    old, sys.stdout = sys.stdout, out
    try:
        code = main(["convert", str(src), str(dest), "--json", *extra])
    finally:
        sys.stdout = old
    assert code == 0
    return json.loads(out.getvalue())


def read_all(dest: Path) -> list[dict]:
    return list(dataloader.StreamingDataset(str(dest)))


def fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI expecting exit code 2; return its one-line error."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckpt-data: ") and err.count("\n") == 1, err
    return err


def test_jsonl_workers_give_the_same_dataset_and_small_is_not_padded(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    rows = [{"id": i, "x": i / 2, "text": f"t{i}", "toks": list(range(i % 4))} for i in range(50)]
    (src / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:20]))
    (src / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[20:]))
    one = convert(src, tmp_path / "w1", "--workers", "1")
    two = convert(src, tmp_path / "w2", "--workers", "2")
    assert one["fingerprint"] == two["fingerprint"] and one["num_samples"] == 50
    assert one["metadata"]["source"] == {"format": "jsonl", "files": 2}
    assert one["rows_per_chunk"] == 50  # capped by the sample count
    assert one["stored_bytes"] < 8 << 10  # 50 small samples: a few KiB, not padded chunks
    got = read_all(tmp_path / "w2")
    assert [int(s["id"]) for s in got] == list(range(50))
    assert [s["text"] for s in got] == [r["text"] for r in rows]
    assert [s["toks"].tolist() for s in got] == [r["toks"] for r in rows]


def test_parquet_types_and_batches(tmp_path: Path) -> None:
    n = 5000  # more than one record batch
    table = pa.table({
        "id": pa.array(np.arange(n, dtype=np.int32)),
        "ok": pa.array([i % 3 == 0 for i in range(n)]),
        "text": [f"row {i}" for i in range(n)],
        "blob": pa.array([bytes([i % 256]) * (i % 7) for i in range(n)]),
        "vec": pa.array([[float(i)] * (i % 5) for i in range(n)], type=pa.list_(pa.float32())),
        "pair": pa.array([[i, -i] for i in range(n)], type=pa.list_(pa.int64(), 2)),
        "grid": pa.array([[[i, i], [0, 1]] for i in range(n)],
                         type=pa.list_(pa.list_(pa.int16()))),
    })
    src = tmp_path / "pq"
    src.mkdir()
    pq.write_table(table.slice(0, 3000), src / "part-0.parquet", row_group_size=1000)
    pq.write_table(table.slice(3000), src / "part-1.parquet")
    s = convert(src, tmp_path / "ds", "--schema", "pair=fixed")
    assert s["num_samples"] == n and s["metadata"]["source"]["format"] == "parquet"
    got = read_all(tmp_path / "ds")
    for i in (0, 1, 2999, 3000, n - 1):
        g = got[i]
        assert int(g["id"]) == i and bool(g["ok"]) == (i % 3 == 0) and g["text"] == f"row {i}"
        assert g["blob"] == bytes([i % 256]) * (i % 7)
        assert g["vec"].dtype == np.float32 and g["vec"].tolist() == [float(i)] * (i % 5)
        assert g["pair"].tolist() == [i, -i]
        assert g["grid"].dtype == np.int16 and g["grid"].tolist() == [[i, i], [0, 1]]


def test_numpy_npy_and_npz(tmp_path: Path) -> None:
    npy = tmp_path / "npy"
    npy.mkdir()
    for i in range(4):
        np.save(npy / f"{i:02d}.npy", np.arange(i + 1, dtype=np.uint16))
    s = convert(npy, tmp_path / "a", "--field", "tokens")
    assert s["num_samples"] == 4
    assert [g["tokens"].tolist() for g in read_all(tmp_path / "a")] == [
        list(range(i + 1)) for i in range(4)
    ]
    np.savez(tmp_path / "x.npz", image=np.arange(24, dtype=np.uint8).reshape(3, 2, 4),
             label=np.array([7, 8, 9]))
    convert(tmp_path / "x.npz", tmp_path / "b", "--schema", "image=fixed")
    got = read_all(tmp_path / "b")
    assert [int(g["label"]) for g in got] == [7, 8, 9]
    assert got[2]["image"].shape == (2, 4) and got[2]["image"][0, 0] == 16


def test_folder_of_files(tmp_path: Path) -> None:
    src = tmp_path / "f"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_bytes(b"bee")
    (src / "sub" / "a.bin").write_bytes(bytes(range(256)))
    (src / ".hidden").write_bytes(b"skip me")
    convert(src, tmp_path / "ds", "--format", "files")
    got = read_all(tmp_path / "ds")
    assert [(g["path"], g["data"]) for g in got] == [
        ("b.txt", b"bee"), ("sub/a.bin", bytes(range(256)))
    ]


def _tar(path: Path, members: list[tuple[str, bytes]], mode: str = "w") -> None:
    with tarfile.open(path, mode) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_webdataset_shards(tmp_path: Path) -> None:
    src = tmp_path / "shards"
    src.mkdir()
    for shard in range(2):
        members = []
        for i in range(shard * 3, shard * 3 + 3):
            members += [(f"d/s{i:04d}.seg.png", b"P" * i), (f"d/s{i:04d}.cls", str(i).encode())]
        _tar(src / (f"shard-{shard}.tar" + (".gz" if shard else "")), members,
             "w:gz" if shard else "w")
    s = convert(src, tmp_path / "ds")
    assert s["metadata"]["source"] == {"format": "webdataset", "files": 2}
    got = read_all(tmp_path / "ds")
    assert [g["key"] for g in got] == [f"d/s{i:04d}" for i in range(6)]
    assert [g["seg_png"] for g in got] == [b"P" * i for i in range(6)]
    assert [int(g["cls"]) for g in got] == list(range(6))


def test_hugging_face_saved_to_disk(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    d = datasets.Dataset.from_dict({
        "text": [f"doc {i}" for i in range(40)],
        "label": [i % 3 for i in range(40)],
        "input_ids": [list(range(i % 6)) for i in range(40)],
    })
    d.save_to_disk(str(tmp_path / "hf"), num_shards=2)
    s = convert(tmp_path / "hf", tmp_path / "ds")
    assert s["metadata"]["source"]["files"] == 2
    assert s["metadata"]["source"]["features"]["label"] == "int64"
    got = read_all(tmp_path / "ds")
    assert [g["text"] for g in got] == [f"doc {i}" for i in range(40)]
    assert [g["input_ids"].tolist() for g in got] == [list(range(i % 6)) for i in range(40)]
    datasets.DatasetDict({"train": d, "test": d.select(range(5))}).save_to_disk(
        str(tmp_path / "dd"))
    convert(tmp_path / "dd", tmp_path / "ds2", "--split", "test")
    assert len(read_all(tmp_path / "ds2")) == 5


def test_bad_inputs_give_one_line_and_leave_nothing(tmp_path: Path, capsys) -> None:
    dest = tmp_path / "ds"
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n{"a": 2}\nnot json\n')
    assert "bad.jsonl:3" in fails(capsys, "convert", str(tmp_path / "bad.jsonl"), str(dest))
    (tmp_path / "x.parquet").write_bytes(b"PAR1 but not really")
    assert "not a readable Parquet" in fails(capsys, "convert", str(tmp_path / "x.parquet"),
                                             str(dest))
    pq.write_table(pa.table({"a": pa.array([1, None, 3])}), tmp_path / "null.parquet")
    assert "null" in fails(capsys, "convert", str(tmp_path / "null.parquet"), str(dest))
    pq.write_table(pa.table({"a": pa.array([{"x": 1}])}), tmp_path / "s.parquet")
    assert "struct" in fails(capsys, "convert", str(tmp_path / "s.parquet"), str(dest))
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert "Python objects" in fails(capsys, "convert", str(tmp_path / "o.npy"), str(dest))
    (tmp_path / "t.tar").write_bytes(b"\x00" * 100 + b"garbage" * 100)
    assert "not a readable tar" in fails(capsys, "convert", str(tmp_path / "t.tar"), str(dest))
    _tar(tmp_path / "m.tar", [("a.jpg", b"1"), ("a.cls", b"1"), ("b.jpg", b"2")])
    assert "same ones" in fails(capsys, "convert", str(tmp_path / "m.tar"), str(dest))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "state.json").write_text('{"_data_files": [{"filename": "gone.arrow"}]}')
    assert "missing" in fails(capsys, "convert", str(tmp_path / "hf"), str(dest))
    # an Arrow stream cut short in its second batch: the rows read so far are named
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, pa.schema([("a", pa.int64())])) as w:
        for start in (0, 1000):
            w.write_batch(pa.record_batch([pa.array(range(start, start + 1000))], names=["a"]))
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "data.arrow").write_bytes(sink.getvalue()[:-3000])
    (tmp_path / "cut" / "state.json").write_text('{"_data_files": [{"filename": "data.arrow"}]}')
    assert "unreadable after row 1000" in fails(capsys, "convert", str(tmp_path / "cut"),
                                                str(dest))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "a.csv").write_text("1,2\n")
    assert "--format files" in fails(capsys, "convert", str(tmp_path / "other"), str(dest))
    # a failure after many partitions were written: nothing visible, nothing left behind
    big = tmp_path / "late.jsonl"
    big.write_text("".join(json.dumps({"a": i}) + "\n" for i in range(3000)) + "oops\n")
    assert "late.jsonl:3001" in fails(capsys, "convert", str(big), str(dest),
                                      "--rows-per-chunk", "100", "--workers", "2")
    assert not dest.exists() or not any(p.is_file() for p in dest.rglob("*"))


def test_cli_conventions(tmp_path: Path, capsys) -> None:
    src = tmp_path / "a.jsonl"
    src.write_text('{"a": 1}\n')
    dest = tmp_path / "ds"
    assert main(["convert", str(src), str(dest)]) == 0
    out = capsys.readouterr().out
    assert " B\n" in out and "MB" not in out  # binary units
    err = fails(capsys, "convert", str(src), str(dest))
    assert "--overwrite" in err and "overwrite=True" not in err
    assert main(["convert", str(src), str(dest), "--overwrite"]) == 0
    assert "ckpt-data: error:" in fails(capsys, "convert", str(src))
    assert "'ckpt-data --help'" in fails(capsys, "info")
    assert "positive integer" in fails(capsys, "convert", str(src), str(dest), "--workers", "0")
    assert "ckpt-data" in fails(capsys)
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("ckpt-data ")
    # verify: a damaged chunk is exit code 1
    capsys.readouterr()
    chunk = next(p for p in dest.rglob("*") if p.is_file() and "/c/" in p.as_posix())
    chunk.write_bytes(b"\xff" + chunk.read_bytes()[1:])
    assert main(["verify", str(dest)]) == 1
    assert capsys.readouterr().err.startswith("ckpt-data: verify failed:")


def test_progress_bar_only_on_a_terminal(tmp_path: Path) -> None:
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"a": i}) + "\n" for i in range(200)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "dataloader", "convert", str(src)]
    piped = subprocess.run(cmd + [str(tmp_path / "d1")], capture_output=True, text=True, env=env)
    assert piped.returncode == 0 and piped.stderr == ""
    leader, follower = pty.openpty()
    proc = subprocess.run(cmd + [str(tmp_path / "d2")], stdout=subprocess.PIPE, stderr=follower,
                          env={**env, "COLUMNS": "100"}, timeout=60)
    os.close(follower)
    drawn = b""
    try:
        while chunk := os.read(leader, 4096):
            drawn += chunk
    except OSError:  # EIO: the terminal's other end is closed
        pass
    os.close(leader)
    assert proc.returncode == 0 and b"converting jsonl" in drawn
    assert (tmp_path / "d2" / INDEX_KEY).exists()


def test_convert_to_s3(tmp_path: Path, s3_uri: str, moto_endpoint: str, capsys) -> None:
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"id": i, "t": f"x{i}"}) + "\n" for i in range(20)))
    ep = ["--endpoint-url", moto_endpoint]
    assert main(["convert", str(src), s3_uri, "--workers", "2", *ep]) == 0
    capsys.readouterr()
    assert main(["verify", s3_uri, "--json", *ep]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verified"] is True and report["num_samples"] == 20
    ds = dataloader.StreamingDataset(s3_uri, store_options={"endpoint_url": moto_endpoint})
    assert [s["t"] for s in ds] == [f"x{i}" for i in range(20)]


def test_file_by_file_in_processes(tmp_path: Path, capsys) -> None:
    """Files are converted by forked processes, each file its own partitions: the same
    dataset for any number of processes; a bad line in a later file stops everything."""
    src = tmp_path / "src"
    src.mkdir()
    for f in range(3):
        pq.write_table(pa.table({"id": pa.array(range(f * 700, (f + 1) * 700)),
                                 "v": pa.array([[float(f)] * 3] * 700)}),
                       src / f"part-{f}.parquet")
    one = convert(src, tmp_path / "w1", "--workers", "1", "--rows-per-chunk", "64")
    three = convert(src, tmp_path / "w3", "--workers", "3", "--rows-per-chunk", "64")
    assert one["fingerprint"] == three["fingerprint"] and one["num_samples"] == 2100
    parts = sorted(p.name for p in (tmp_path / "w3" / "parts").iterdir())
    assert parts[:3] == ["000000", "000001", "000002"] and "1000000" in parts
    assert [int(s["id"]) for s in read_all(tmp_path / "w3")] == list(range(2100))
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in range(3):
        lines = [json.dumps({"a": f * 10 + i}) for i in range(10)]
        if f == 2:
            lines[7] = "{broken"
        (bad / f"{f}.jsonl").write_text("\n".join(lines) + "\n")
    err = fails(capsys, "convert", str(bad), str(tmp_path / "ds"), "--workers", "2")
    assert "2.jsonl:8" in err
    assert not any(p.is_file() for p in (tmp_path / "ds").rglob("*"))
