"""`ckpt export` of a trained model's checkpoint to a Hugging Face folder that transformers'
own `from_pretrained` loads bit-exactly: keys relative to `--keys model`, tied weights written
once (as `save_pretrained` does), keys checked against the model named by `--hf-config`.

Tiny real models built from a config (no network, no downloads): GPT-2 (tied lm_head, base
prefix `transformer`) and Llama (base prefix `model`, untied and tied)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from ckptstore import CheckpointStore
from ckptstore.cli import main
from ckptstore.tools.exports import INDEX_NAME, TIED_METADATA
from ckptstore.tools.interop import ExportWarning, export_checkpoint

TOKENS = torch.tensor([[1, 5, 9, 42, 7, 99, 3, 0], [8, 8, 2, 64, 31, 5, 77, 12]])


def gpt2() -> PreTrainedModel:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def llama(tied: bool = False) -> PreTrainedModel:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=100,
                      max_position_embeddings=32, tie_word_embeddings=tied,
                      bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(cfg).eval()


MODELS = {"gpt2": gpt2, "llama": llama, "llama-tied": lambda: llama(tied=True)}


def logits(model: PreTrainedModel) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def saved_keys(folder: Path) -> set[str]:
    """The tensor keys of a Hugging Face folder (one file or an index and its shards)."""
    if (folder / INDEX_NAME).is_file():
        return set(json.loads((folder / INDEX_NAME).read_text())["weight_map"])
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())  # noqa: SIM118 - not a dict


def load(folder: Path, cls: Any) -> tuple[PreTrainedModel, dict[str, Any]]:
    model, info = cls.from_pretrained(str(folder), local_files_only=True,
                                      output_loading_info=True)
    return model.eval(), info


def reference(model: PreTrainedModel, tmp_path: Path) -> Path:
    """What save_pretrained writes for `model` (its config.json is what a user names)."""
    ref = tmp_path / "reference"
    model.save_pretrained(str(ref))
    return ref


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any], str]:
    rc = main(["--json", *args])
    cap = capsys.readouterr()
    return rc, (json.loads(cap.out) if cap.out.strip() else {}), cap.err


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_export_of_keys_model_loads_bit_exactly(kind: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    model = MODELS[kind]()
    ref = reference(model, tmp_path)
    repo = CheckpointStore(tmp_path / "repo")
    repo.save("step-10", {"model": model.state_dict(), "step": 10})
    out = tmp_path / "hf"
    rc, doc, err = cli(capsys, "export", str(tmp_path / "repo"), "step-10", str(out),
                       "--format", "safetensors", "--keys", "model", "--hf-config", str(ref),
                       "--max-shard-size", "20KB")
    assert rc == 0, err
    assert doc["warnings"] == [] and "WARNING" not in err, err
    assert "every exported key starts with" not in err
    assert doc["strip_prefix"] == "model" and doc["files"] > 1
    # the keys save_pretrained writes, no more (tied duplicates dropped), no fewer
    assert saved_keys(out) == saved_keys(ref)
    assert doc["tensors"] == len(saved_keys(ref))
    if kind in ("gpt2", "llama-tied"):
        assert doc["tied"] == {"lm_head.weight": ("transformer.wte.weight" if kind == "gpt2"
                                                  else "model.embed_tokens.weight")}
        index = json.loads((out / INDEX_NAME).read_text())
        assert json.loads(index["metadata"][TIED_METADATA]) == doc["tied"]
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        type(model).__name__]
    back, info = load(out, type(model))
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    assert torch.equal(logits(back), logits(model))
    if kind in ("gpt2", "llama-tied"):
        assert back.lm_head.weight.data_ptr() == back.get_input_embeddings().weight.data_ptr()


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_plain_export_keys_model_with_the_config_copied_in(
        kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's own steps, no new option: `--keys model` to a folder, config.json copied in
    by hand, from_pretrained. The keys are the model's (save_pretrained's names and count)."""
    model = MODELS[kind]()
    ref = reference(model, tmp_path)
    repo = CheckpointStore(tmp_path / "repo")
    repo.save("s", {"model": model.state_dict()})
    out = tmp_path / "hf"
    rc, doc, err = cli(capsys, "export", str(tmp_path / "repo"), "s", str(out),
                       "--format", "safetensors", "--keys", "model")
    assert rc == 0, err
    assert "every exported key starts with" not in err  # not even when Llama's head is tied
    assert saved_keys(out) == saved_keys(ref)
    shutil.copy(ref / "config.json", out / "config.json")
    back, info = load(out, type(model))
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert torch.equal(logits(back), logits(model))


def test_a_wrong_export_is_warned_about_loudly(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    model = gpt2()
    ref = reference(model, tmp_path)
    repo = CheckpointStore(tmp_path / "repo")
    repo.save("s", {"model": model.state_dict()})
    # the whole checkpoint, keys still under `model.`: nothing would load
    rc, doc, err = cli(capsys, "export", str(tmp_path / "repo"), "s", str(tmp_path / "a"),
                       "--format", "safetensors", "--hf-config", str(ref))
    assert rc == 0, err
    assert len(doc["warnings"]) == 2, doc["warnings"]
    missing, unexpected = doc["warnings"]
    assert "29 of the 29 weights GPT2LMHeadModel expects are not in the export" in missing
    assert "initialise them at random" in missing
    assert "exported key(s) are not weights of GPT2LMHeadModel" in unexpected
    assert "--keys model" in unexpected
    assert err.count("WARNING:") == 2
    # without a model to check against, the shared `model.` prefix is still pointed out
    rc, doc, err = cli(capsys, "export", str(tmp_path / "repo"), "s", str(tmp_path / "b"),
                       "--format", "safetensors")
    assert rc == 0 and "every exported key starts with 'model.'" in err, err
    # the API raises the same as Python warnings
    with pytest.warns(ExportWarning) as caught:
        rep = export_checkpoint(repo, "s", tmp_path / "c", fmt="safetensors", hf_config=ref)
    assert [str(w.message) for w in caught] == rep.warnings and len(rep.warnings) == 2
    assert "initialise them at random" in rep.warnings[0]
    # a config of another size: the shapes are named
    other = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100,
                                       n_positions=32, bos_token_id=0, eos_token_id=0))
    other.config.save_pretrained(str(tmp_path / "other"))
    rc, doc, err = cli(capsys, "export", str(tmp_path / "repo"), "s", str(tmp_path / "d"),
                       "--format", "safetensors", "--keys", "model",
                       "--hf-config", str(tmp_path / "other"), "--hf-model", "GPT2LMHeadModel")
    assert rc == 0, err
    assert json.loads((tmp_path / "d" / "config.json").read_text())["architectures"] == [
        "GPT2LMHeadModel"]  # --hf-model completes a config built without a model
    assert any("other shapes than GPT2LMHeadModel expects" in w and "96 in the checkpoint, "
               "192 in the model" in w for w in doc["warnings"]), doc["warnings"]
    # a clean export warns about nothing, from the API either
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)
        rep = export_checkpoint(repo, "s", tmp_path / "e", fmt="safetensors", hf_config=ref,
                                strip_prefix="model")
    assert rep.warnings == [] and rep.tied == {"lm_head.weight": "transformer.wte.weight"}


def test_relative_keys_in_every_format_and_the_old_keys_on_request(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = llama()
    sd = model.state_dict()
    repo = CheckpointStore(tmp_path / "repo")
    repo.save("s", {"model": sd, "optim": {"lr": 0.1}})
    root = str(tmp_path / "repo")
    # one safetensors file: relative keys, the file loads into the model with load_file
    rc, doc, err = cli(capsys, "export", root, "s", str(tmp_path / "m.safetensors"),
                       "--keys", "model")
    assert rc == 0, err
    from safetensors.torch import load_file

    fresh = llama()
    torch.nn.init.zeros_(fresh.lm_head.weight)
    fresh.load_state_dict(load_file(str(tmp_path / "m.safetensors")))  # strict: every key
    assert torch.equal(logits(fresh), logits(model))
    # a torch file: the subtree itself, a plain state_dict
    rc, doc, err = cli(capsys, "export", root, "s", str(tmp_path / "m.pt"),
                       "--strip-prefix", "model")
    assert rc == 0, err
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(loaded) == list(sd)
    # zarr: arrays named relative to the prefix
    import zarr

    rc, doc, err = cli(capsys, "export", root, "s", str(tmp_path / "m.zarr"), "--keys", "model")
    assert rc == 0, err
    names = {n for n, _a in zarr.open_group(str(tmp_path / "m.zarr"), mode="r").arrays()}
    assert names == set(sd)
    # --keep-prefix: the keys as before (model.x); globs and several --keys keep them too
    for extra in (["--keys", "model", "--keep-prefix"], ["--keys", "model.*"],
                  ["--keys", "model", "--keys", "optim"]):
        out = tmp_path / f"full{len(extra)}{extra[1][-1]}.safetensors"
        rc, doc, err = cli(capsys, "export", root, "s", str(out), *extra)
        assert rc == 0, err
        with safe_open(str(out), framework="pt") as f:
            assert set(f.keys()) == {f"model.{k}" for k in sd}  # noqa: SIM118
        assert doc["strip_prefix"] is None


def test_bad_export_options_are_clear_errors(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    model = gpt2()
    ref = reference(model, tmp_path)
    repo = CheckpointStore(tmp_path / "repo")
    repo.save("s", {"model": model.state_dict()})
    root = str(tmp_path / "repo")
    bare = tmp_path / "bare"
    GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
               bos_token_id=0, eos_token_id=0).save_pretrained(str(bare))  # no architectures
    assert json.loads((bare / "config.json").read_text()).get("architectures") is None
    (tmp_path / "notjson").mkdir()
    (tmp_path / "notjson" / "config.json").write_text("{nope")
    cases = [
        (["m.safetensors", "--hf-config", str(ref)], "applies to a safetensors export to a folder"),
        (["m.pt", "--keep-tied"], "--keep-tied applies to a safetensors export to a folder"),
        (["d", "--format", "safetensors", "--hf-config", str(tmp_path / "none")],
         "no Hugging Face config at"),
        (["d", "--format", "safetensors", "--hf-config", str(bare)],
         "names no architectures: pass the model class, e.g. --hf-model"),
        (["d", "--format", "safetensors", "--hf-config", str(ref), "--hf-model", "os"],
         "'os' is not a model class of transformers"),
        (["d", "--format", "safetensors", "--hf-config", str(tmp_path / "notjson")],
         "is not valid JSON"),
        (["d", "--format", "safetensors", "--strip-prefix", "nope"], "no keys below 'nope'"),
        (["d", "--format", "safetensors", "--strip-prefix", "model.", ], "invalid prefix"),
        (["d", "--format", "safetensors", "--keys", "model", "--keep-prefix",
          "--strip-prefix", "model"], "contradict"),
    ]
    for args, expected in cases:
        rc, _doc, err = cli(capsys, "export", root, "s", str(tmp_path / args[0]), *args[1:])
        assert rc == 2, (args, err)
        assert expected in err, (args, err)
        assert not (tmp_path / args[0]).exists()


def test_without_transformers_the_config_is_a_clear_error_or_a_note(tmp_path: Path) -> None:
    from tests.campaigns.test_installs import run_without

    model = gpt2()
    ref = reference(model, tmp_path)
    repo = CheckpointStore(tmp_path / "repo")
    repo.save("s", {"model": model.state_dict()})
    code = """
        import json, sys
        from ckptstore.cli import main
        rc1 = main(["export", sys.argv[1], "s", sys.argv[2], "--format", "safetensors",
                    "--keys", "model", "--hf-config", sys.argv[3]])
        rc2 = main(["--json", "import", sys.argv[1], "back", sys.argv[3]])
        assert "transformers" not in sys.modules
        raise SystemExit(rc1 * 10 + rc2)
    """
    proc = run_without("transformers", code, str(tmp_path / "repo"), str(tmp_path / "out"),
                       str(ref))
    assert proc.returncode == 20, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert "ckpt: error: transformers is not installed (needed to check keys against a " \
           "Hugging Face config): pip install transformers" in lines
    assert any("tied weights not restored from" in line for line in lines), lines
    assert not (tmp_path / "out").exists()
    assert json.loads(proc.stdout)["tied"] == {}
