"""Property tests: the manifest parser accepts what the writer produces and refuses anything
else with FormatError, never another exception, hang or huge allocation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore import CheckpointStore, FormatError
from ckptstore.format.manifest_parse import parse_manifest
from tests.helpers import assert_same, json_paths, sealed_manifest

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)


def _valid_manifest_bytes() -> bytes:
    repo = CheckpointStore("memory://fuzz-base")
    if not repo.exists("base"):
        repo.save("base", {"w": torch.randn(40, 3), "b": [1, 2.5, "x"], 3: np.arange(4),
                           "t": (None, b"by")}, metadata={"step": 1})
    return repo.store.get("checkpoints/base.json")


VALID = _valid_manifest_bytes()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_random_bytes_never_crash(data):
    try:
        parse_manifest(data)
    except FormatError:
        pass


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_random_json_never_crashes(doc):
    try:
        parse_manifest(json.dumps(doc).encode())
    except FormatError:
        pass


ALL_PATHS = [p for p in json_paths(json.loads(VALID)) if p]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(ALL_PATHS), json_values)
def test_mutated_valid_manifest_is_parsed_or_refused(path, value):
    doc = json.loads(VALID)
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    try:
        m = parse_manifest(sealed_manifest(doc))
    except FormatError:
        return
    # accepted: then it must be internally consistent
    for t in m.tensors:
        assert sum(c.nbytes for c in t.chunks) == t.nbytes


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=len(VALID) - 1))
def test_truncated_valid_manifest_is_refused(cut):
    try:
        parse_manifest(VALID[:cut])
    except FormatError:
        return
    raise AssertionError("a truncated manifest was accepted")


def test_deep_nesting_is_refused():
    """A hostile manifest nested 100,000 levels deep is refused with a FormatError (not a
    RecursionError or a crash); the test used to pass if the parse succeeded."""
    deep = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    with pytest.raises(FormatError):
        parse_manifest(deep)


scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10)
           | st.binary(max_size=10))
keys = st.text(max_size=5) | st.integers(-5, 5)
states = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=3) | st.tuples(c, c)
    | st.dictionaries(keys, c, max_size=3),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(states)
def test_any_supported_state_roundtrips(state):
    repo = CheckpointStore("memory://")
    repo.save("s", state)
    assert_same(state, repo.load("s"))
