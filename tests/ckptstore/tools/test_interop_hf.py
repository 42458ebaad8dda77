"""`ckpt import` of a sharded Hugging Face folder (or its model.safetensors.index.json) that
transformers' own `save_pretrained` wrote: one checkpoint, with the tied weights the files
leave out tied again, that exports back to a folder `from_pretrained` loads bit-exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckptstore import CheckpointStore, FormatError
from ckptstore.tools.exports import INDEX_NAME
from ckptstore.tools.interop import detect_format, import_checkpoint
from tests.ckptstore.tools.test_exports_hf import MODELS, cli, load, logits, saved_keys


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_sharded_folder_imports_and_exports_back(kind: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    model = MODELS[kind]()
    src = tmp_path / "pretrained"
    model.save_pretrained(str(src), max_shard_size="20KB")
    assert (src / INDEX_NAME).is_file() and len(list(src.glob("*.safetensors"))) > 2
    root = str(tmp_path / "repo")
    rc, doc, err = cli(capsys, "import", root, "base", str(src))
    assert rc == 0, err
    assert doc["format"] == "safetensors" and doc["files"] == len(list(src.glob("*.safetensors")))
    repo = CheckpointStore(root)
    state = repo.load("base")
    # the checkpoint holds what model.state_dict() holds, tied weights tied again
    assert list(state) == list(model.state_dict()) or set(state) == set(model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(state[k], v), k
    if kind == "gpt2":
        assert doc["tied"] == {"lm_head.weight": "transformer.wte.weight"}
        assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
        assert "tied again" in err
    else:
        assert doc["tied"] == {}
    # the index itself imports the same
    rc, doc2, err = cli(capsys, "import", root, "by-index", str(src / INDEX_NAME))
    assert rc == 0, err
    assert doc2["tensors"] == doc["tensors"] and doc2["written_bytes"] == 0  # all reused
    # and exports back to what save_pretrained wrote, loading bit-exactly
    out = tmp_path / "exported"
    rc, exp, err = cli(capsys, "export", root, "base", str(out), "--format", "safetensors",
                       "--hf-config", str(src), "--max-shard-size", "20KB")
    assert rc == 0, err
    assert exp["warnings"] == [], exp["warnings"]
    assert saved_keys(out) == saved_keys(src)
    back, info = load(out, type(model))
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert torch.equal(logits(back), logits(model))


def test_import_under_a_prefix_restores_into_a_model(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model = MODELS["gpt2"]()
    src = tmp_path / "pretrained"
    model.save_pretrained(str(src), max_shard_size="20KB")
    root = str(tmp_path / "repo")
    rc, doc, err = cli(capsys, "import", root, "base", str(src), "--prefix", "model")
    assert rc == 0, err
    fresh = MODELS["gpt2"]()
    torch.nn.init.zeros_(fresh.transformer.wte.weight)
    CheckpointStore(root).load("base", into={"model": fresh.state_dict()})
    assert torch.equal(logits(fresh), logits(model))
    # and the export relative to `model` is the Hugging Face folder again
    out = tmp_path / "exported"
    rc, exp, err = cli(capsys, "export", root, "base", str(out), "--format", "safetensors",
                       "--keys", "model", "--hf-config", str(src))
    assert rc == 0 and exp["warnings"] == [], err
    assert saved_keys(out) == saved_keys(src)


def test_our_export_records_its_ties_for_the_import(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """No config.json needed: the export's index says which keys it dropped as tied."""
    model = MODELS["gpt2"]()
    repo = CheckpointStore(tmp_path / "repo")
    repo.save("s", {"model": model.state_dict()})
    out = tmp_path / "plain"
    rc, exp, err = cli(capsys, "export", str(tmp_path / "repo"), "s", str(out),
                       "--format", "safetensors", "--keys", "model")
    assert rc == 0, err
    assert exp["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    assert not (out / "config.json").exists()
    rep = import_checkpoint(repo, "back", out)
    assert rep.tied == {"lm_head.weight": "transformer.wte.weight"}
    back = repo.load("back")
    assert back["lm_head.weight"].data_ptr() == back["transformer.wte.weight"].data_ptr()
    for k, v in model.state_dict().items():
        assert torch.equal(back[k], v), k
    # --keep-tied writes both keys, as copies
    rc, exp, err = cli(capsys, "export", str(tmp_path / "repo"), "s", str(tmp_path / "both"),
                       "--format", "safetensors", "--keys", "model", "--keep-tied")
    assert rc == 0 and exp["tied"] == {}, err
    assert saved_keys(tmp_path / "both") == set(model.state_dict())


def test_bad_hugging_face_folders_are_refused_clearly(tmp_path: Path) -> None:
    repo = CheckpointStore(tmp_path / "repo")
    folder = tmp_path / "f"
    folder.mkdir()
    save_file({"a": torch.ones(2)}, str(folder / "one.safetensors"))
    save_file({"b": torch.ones(2)}, str(folder / "two.safetensors"))
    with pytest.raises(FormatError, match="2 .safetensors files and no"):
        detect_format(folder)

    def index(weight_map: dict[str, str]) -> Path:
        path = folder / INDEX_NAME
        path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        return path

    cases = [
        ({"a": "../one.safetensors"}, FormatError, "not a file in the index's folder"),
        ({"a": "gone.safetensors"}, FileNotFoundError, "shard gone.safetensors is missing"),
        ({"a": "one.safetensors", "x": "one.safetensors"}, FormatError, "does not hold them"),
        ({"a": "two.safetensors", "b": "two.safetensors"}, FormatError, "does not hold them"),
        ({}, FormatError, "not a safetensors index"),
    ]
    for weight_map, exc, text in cases:
        path = index(weight_map)
        with pytest.raises(exc, match=text):
            import_checkpoint(repo, "x", folder)
        with pytest.raises(exc, match=text):
            import_checkpoint(repo, "x", path)
    index({"a": "one.safetensors"})  # two.safetensors holds b, which the index does not list
    save_file({"a": torch.ones(2), "b": torch.ones(1)}, str(folder / "one.safetensors"))
    with pytest.raises(FormatError, match="which the index does not give this shard"):
        import_checkpoint(repo, "x", folder)
    (folder / INDEX_NAME).write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        import_checkpoint(repo, "x", folder)
    assert repo.names() == []
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FormatError, match="not a torch.distributed.checkpoint directory or a "
                                          "Hugging Face model folder"):
        detect_format(empty)
    with pytest.raises(ValueError, match="safetensors imports only"):
        import_checkpoint(repo, "x", tmp_path / "m.pt", fmt="torch", hf_config=folder)
