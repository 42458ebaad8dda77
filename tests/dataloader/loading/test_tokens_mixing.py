"""Tokens packing and dataset mixing: correctness and exact resume."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

import dataloader


@pytest.fixture(scope="module")
def docs_uri() -> tuple[str, list[np.ndarray]]:
    rng = np.random.default_rng(1)
    # document i holds tokens 1000*i .. 1000*i+len-1, so every token is unique and its document
    # and offset can be read back from its value
    docs = [
        np.arange(1000 * i, 1000 * i + int(rng.integers(1, 300)), dtype=np.int32)
        for i in range(300)
    ]
    uri = f"memory://docs-{uuid.uuid4().hex}"
    dataloader.write_dataset(
        uri, ({"tokens": d} for d in docs), rows_per_chunk=20, data_chunk_bytes=2048
    )
    return uri, docs


def _tok(uri, **kw):
    kw.setdefault("shuffle", True)
    kw.setdefault("seed", 3)
    kw.setdefault("shuffle_window", 60)
    return dataloader.TokenDataset(uri, 64, **kw)


def test_packing_keeps_documents_and_boundaries(docs_uri):
    uri, docs = docs_uri
    loader = dataloader.StreamingLoader(_tok(uri), batch_size=4)
    seen = []
    for b in loader:
        t, pos, cu = b["tokens"], b["position_ids"], b["cu_seqlens"]
        assert t.shape[1] == 64 and pos.shape == t.shape and cu.dtype == np.int32
        flat_t, flat_p = t.reshape(-1), pos.reshape(-1)
        assert cu[0] == 0 and cu[-1] == flat_t.size
        assert b["max_seqlen"] == int(np.diff(cu).max())
        for s, e in zip(cu[:-1], cu[1:], strict=True):
            seg = flat_t[s:e]
            assert np.all(np.diff(seg) == 1)  # one contiguous piece of one document
            assert np.array_equal(flat_p[s:e], np.arange(e - s))
        for row, prow in zip(t, pos, strict=True):  # a document start always has position 0
            starts = row % 1000 == 0
            assert np.all(prow[starts] == 0)
        seen.extend(flat_t.tolist())
    assert len(set(seen)) == len(seen)  # no token twice
    total = sum(len(d) for d in docs)
    ds = _tok(uri)
    assert total - len(seen) < 64 * ds.epoch_order(0).num_windows  # only window remainders dropped


def test_pad_remainder_keeps_every_token(docs_uri):
    uri, docs = docs_uri
    loader = dataloader.StreamingLoader(_tok(uri, remainder="pad", pad_id=-1), batch_size=8)
    toks = np.concatenate([b["tokens"].reshape(-1) for b in loader])
    real = toks[toks != -1]
    assert sorted(real.tolist()) == sorted(np.concatenate(docs).tolist())


@pytest.mark.parametrize(("w1", "w2"), [(1, 1), (2, 2), (2, 3)])
def test_tokens_resume_exactly(docs_uri, w1, w2):
    uri, _ = docs_uri

    def run(world, state=None, take=None):
        out = []
        for r in range(world):
            loader = dataloader.StreamingLoader(_tok(uri, rank=r, world_size=world), batch_size=3)
            if state:
                loader.load_state_dict(state)
            got = []
            for b in loader:
                got.extend(b["tokens"].tolist())
                if take and len(got) >= take:
                    break
            out.append((got, loader.state_dict()))
        return out

    full = run(w1)
    first = run(w1, take=9)
    rest = run(w2, state=first[0][1])
    seqs = [tuple(s) for got, _ in first + rest for s in got]
    assert sorted(seqs) == sorted(tuple(s) for got, _ in full for s in got)
    if w1 == w2:
        for r in range(w1):
            assert first[r][0] + rest[r][0] == full[r][0]


def test_token_field_is_checked(tmp_path):
    uri = str(tmp_path / "f")
    dataloader.write_dataset(uri, [{"tokens": np.zeros(3, np.float32)}])
    with pytest.raises(ValueError, match="integer token field"):
        dataloader.TokenDataset(uri, 8)


@pytest.fixture(scope="module")
def two_sources() -> tuple[str, str]:
    a, b = f"memory://mix-a-{uuid.uuid4().hex}", f"memory://mix-b-{uuid.uuid4().hex}"
    dataloader.write_dataset(
        a, ({"id": i, "v": np.full(2, i)} for i in range(300)), rows_per_chunk=16
    )
    dataloader.write_dataset(
        b, ({"id": 100_000 + i, "v": np.full(2, i)} for i in range(900)), rows_per_chunk=16
    )
    return a, b


def _mix(a, b, **kw):
    kw.setdefault("stopping", "first_exhausted")
    return dataloader.MixedLoader(
        [
            dataloader.StreamingDataset(a, shuffle=True, seed=1),
            dataloader.StreamingDataset(b, shuffle=True, seed=2),
        ],
        [0.25, 0.75],
        16,
        seed=4,
        **kw,
    )


def test_mixing_follows_weights_and_is_deterministic(two_sources):
    a, b = two_sources
    first = [x for batch in _mix(*two_sources) for x in batch["id"].tolist()]
    again = [x for batch in _mix(*two_sources) for x in batch["id"].tolist()]
    assert first == again
    share = np.mean([x < 100_000 for x in first])
    assert 0.18 < share < 0.32
    assert len(set(first)) == len(first)
    batch = next(iter(_mix(*two_sources)))
    assert np.array_equal(batch["_source"] == 0, batch["id"] < 100_000)
    assert np.array_equal(np.stack(batch["v"])[:, 0], batch["id"] % 100_000)


def test_mixing_resumes_exactly(two_sources):
    full = [x for batch in _mix(*two_sources) for x in batch["id"].tolist()]
    m = _mix(*two_sources)
    it = iter(m)
    head = [x for _ in range(11) for x in next(it)["id"].tolist()]
    state = m.state_dict()
    it.close()
    m2 = _mix(*two_sources)
    m2.load_state_dict(state)
    tail = [x for batch in m2 for x in batch["id"].tolist()]
    assert head + tail == full


def test_mixing_never_stops_and_cycles_epochs(two_sources):
    m = _mix(*two_sources, stopping="never")
    it = iter(m)
    ids = [x for _ in range(80) for x in next(it)["id"].tolist()]
    it.close()
    assert len(ids) == 1280
    small = [x for x in ids if x < 100_000]
    assert len(small) > 300  # source a went into its second epoch
    assert sorted(small[:300]) == list(range(300))
    assert m.state_dict()["sources"][0]["epoch"] >= 1


def test_mixing_validates_inputs(two_sources, tmp_path):
    a, b = two_sources
    with pytest.raises(ValueError, match="weight"):
        dataloader.MixedLoader([dataloader.StreamingDataset(a)], [0.5, 0.5], 4)
    with pytest.raises(ValueError, match="non-negative"):
        dataloader.MixedLoader([dataloader.StreamingDataset(a)], [-1.0], 4)
    other = str(tmp_path / "o")
    dataloader.write_dataset(other, [{"x": 1}])
    with pytest.raises(ValueError, match="same fields"):
        dataloader.MixedLoader(
            [dataloader.StreamingDataset(a), dataloader.StreamingDataset(other)], [1, 1], 4
        )


def test_token_dataset_takes_the_old_names_of_the_torch_worker_options(docs_uri):
    uri, _ = docs_uri
    with pytest.warns(DeprecationWarning, match="is deprecated") as caught:
        old = dataloader.TokenDataset(uri, 64, num_workers=2, batch_size=4)
    assert {w.filename for w in caught} == {__file__}  # the caller's line, not ours
    new = dataloader.TokenDataset(uri, 64, torch_workers=2, torch_batch_size=4)
    assert old.order_options() == new.order_options()
    assert old.order_options()["torch_workers"] == [2, 4]
