"""Manifests carry a self-digest (version 2): no flipped bit loads as other values."""

from __future__ import annotations

import json

import pytest
import torch

from ckptstore import CheckpointStore, FormatError
from ckptstore.format.canonical import SEAL_FIELD, canonical_json, seal
from ckptstore.format.manifest_parse import parse_manifest
from tests.helpers import sealed_manifest


@pytest.fixture
def saved(tmp_path) -> tuple[CheckpointStore, bytes]:
    repo = CheckpointStore(tmp_path / "repo")
    repo.save("s-1", {"w": torch.arange(6.0), "b": [1, 2.5, "x"], 3: torch.ones(2)},
              metadata={"step": 1234})
    return repo, repo.store.get("checkpoints/s-1.json")


def test_every_single_bit_flip_is_refused_or_harmless(saved):
    """The audit found ~4.5% of flips loading silently with other values (a step number, a
    key, a tree leaf). With the seal, a flip is refused or parses to the same manifest."""
    _repo, raw = saved
    good = parse_manifest(raw, "s-1")
    accepted = 0
    for bit in range(len(raw) * 8):
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            m = parse_manifest(bytes(flipped), "s-1")
        except FormatError:
            continue
        accepted += 1
        assert m == good, f"bit {bit} changed the manifest silently"
    assert accepted == 0  # canonical JSON has no byte whose flip means the same


def test_version_1_manifests_stay_readable(saved):
    repo, raw = saved
    doc = json.loads(raw)
    del doc[SEAL_FIELD]
    doc["version"] = 1
    v1 = sealed_manifest(doc)
    assert SEAL_FIELD.encode() not in v1
    m = parse_manifest(v1, "s-1")
    assert m.version == 1 and m.metadata == {"step": 1234}
    repo.store.put("checkpoints/s-1.json", v1)
    loaded = CheckpointStore(repo.store.uri).load("s-1")
    assert torch.equal(loaded["w"], torch.arange(6.0))


@pytest.mark.parametrize("tamper, message", [
    (lambda raw: raw.replace(b',"self_digest"', b',"self_digesx"'), "unknown field"),
    (lambda raw: json.dumps(json.loads(raw)).encode(), "version 2 must carry"),
    (lambda raw: raw.replace(b'"step":1234', b'"step":1235'), "corrupt"),
    (lambda raw: raw[:-10] + b'0000000000', "no valid self_digest|not valid JSON"),
    (lambda raw: raw.replace(b'"version":2', b'"version":1'), "corrupt"),
    (lambda raw: seal(canonical_json({**_unsealed(raw), "version": 1})), "must not carry"),
])
def test_tampered_seal_is_refused_with_a_clear_error(saved, tamper, message):
    _repo, raw = saved
    with pytest.raises(FormatError, match=message):
        parse_manifest(tamper(raw), "s-1")


def _unsealed(raw: bytes) -> dict:
    doc = json.loads(raw)
    del doc[SEAL_FIELD]
    return doc
