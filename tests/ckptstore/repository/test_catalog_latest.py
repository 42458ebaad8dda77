"""`latest()` finds the newest checkpoint from the first bytes of each manifest and parses
only the newest one (to be sure it is whole), not every manifest in the repository."""

from __future__ import annotations

import json

import pytest
import torch

from ckptstore import CheckpointStore, FormatError
from ckptstore.format import manifest_parse as manifest_mod


def _repo(store_uri: str, store_options: dict) -> CheckpointStore:
    return CheckpointStore(store_uri, **store_options)


def _save_three(repo: CheckpointStore) -> None:
    # created times are increasing; names are not in creation order
    for name in ("zeta", "alpha", "mid"):
        repo.save(name, {"w": torch.arange(4) + len(name)})


def test_latest_is_newest_by_creation_time(store_uri, store_options):
    repo = _repo(store_uri, store_options)
    assert repo.latest() is None
    _save_three(repo)
    fresh = _repo(store_uri, store_options)
    assert fresh.latest() == "mid"
    assert [i.name for i in fresh.list()] == ["zeta", "alpha", "mid"]
    fresh.delete("mid")
    assert _repo(store_uri, store_options).latest() == "alpha"


def test_latest_parses_only_the_newest_manifest(store_uri, store_options, monkeypatch):
    _save_three(_repo(store_uri, store_options))
    fresh = _repo(store_uri, store_options)
    parsed = []

    def counting_parse(data, expected_name=None, *args):
        parsed.append(expected_name)
        return manifest_mod.parse_manifest(data, expected_name, *args)

    monkeypatch.setattr("ckptstore.repository.catalog.parse_manifest", counting_parse)
    assert fresh.latest() == "mid"
    assert parsed == ["mid"]


def test_a_corrupt_older_manifest_does_not_hide_the_latest(store_uri, store_options):
    repo = _repo(store_uri, store_options)
    _save_three(repo)
    key = "checkpoints/zeta.json"
    raw = repo.store.get(key)
    repo.store.put(key, raw[:200] + b"garbage")  # header intact, body broken
    fresh = _repo(store_uri, store_options)
    assert fresh.latest() == "mid"
    assert torch.equal(fresh.load()["w"], torch.arange(4) + 3)
    assert [i.name for i in fresh.list()] == ["alpha", "mid"]  # skipped, and reported:
    [problem] = fresh.problems()
    assert problem.key == key and "not valid JSON" in problem.reason
    with pytest.raises(FormatError):
        fresh.load("zeta")


def test_manifest_without_canonical_header_falls_back_to_parsing(store_uri, store_options):
    repo = _repo(store_uri, store_options)
    _save_three(repo)
    # the same document as a pretty-printed version-1 manifest (version 1 has no seal):
    # valid, but "created" is not in the first bytes
    key = "checkpoints/mid.json"
    doc = json.loads(repo.store.get(key))
    del doc["self_digest"]
    doc["version"] = 1
    repo.store.put(key, json.dumps(doc, indent=2, sort_keys=False).encode())
    fresh = _repo(store_uri, store_options)
    assert manifest_mod.parse_manifest(fresh.store.get(key), expected_name="mid").name == "mid"
    assert fresh.latest() == "mid"
