"""positional_builder: the same frozen records as their __init__, or a clear refusal."""

from __future__ import annotations

import dataclasses

import pytest

from ckptstore.format.manifest import ChunkRef, TensorEntry
from ckptstore.format.records import positional_builder
from ckptstore.pipeline.planning import LeafPlan, TensorSpec

DIGEST = "0123456789abcdef" * 2


def test_built_records_equal_their_init_and_stay_frozen():
    ref = positional_builder(ChunkRef)(DIGEST, 64, 8, 8, DIGEST)
    same = ChunkRef(DIGEST, 64, 8, 8, DIGEST)
    assert ref == same and hash(ref) == hash(same) and repr(ref) == repr(same)
    assert type(ref) is ChunkRef and vars(ref) == vars(same)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.offset = 0  # type: ignore[misc]
    entry = positional_builder(TensorEntry)("k", "torch", None, (2,), 2, None, (ref,), False,
                                            False, None, None)
    assert entry == TensorEntry("k", "torch", None, (2,), 2, None, (ref,))
    assert list(vars(entry)) == [f.name for f in dataclasses.fields(TensorEntry)]


def test_a_missing_or_extra_value_is_refused():
    build = positional_builder(LeafPlan)
    assert build(4, True, 0, None) == LeafPlan(4, packed=True)
    with pytest.raises(TypeError, match="4 fields, 3 values"):
        build(4, True, 0)
    with pytest.raises(TypeError, match="4 fields, 5 values"):
        build(4, True, 0, None, 1)


def test_classes_whose_init_does_more_are_refused():
    @dataclasses.dataclass(frozen=True)
    class Checked:
        x: int

        def __post_init__(self) -> None:
            assert self.x >= 0

    @dataclasses.dataclass(frozen=True, slots=True)
    class Slotted:
        x: int

    @dataclasses.dataclass(frozen=True)
    class Derived:
        x: int
        y: int = dataclasses.field(init=False, default=0)

    for cls in (Checked, Slotted, Derived, dict):
        with pytest.raises(TypeError):
            positional_builder(cls)
    assert positional_builder(TensorSpec)  # the classes the writer builds are plain
