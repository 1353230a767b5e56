"""The CorpusLike seam the loaders type against: Corpus implements it, and its lazy index queries
(doc_offsets_range, doc_index_at, doc_lengths) equal an oracle read straight from the shards."""

from __future__ import annotations

import numpy as np
import pytest

from h5corpus.storage.protocols import CorpusLike
from h5corpus.storage.reader import open_corpus
from tests.helpers import oracle_stream


def test_corpus_is_corpuslike(stdlib_manifest):
    c = open_corpus(stdlib_manifest, "train")
    assert isinstance(c, CorpusLike)
    assert c.shard_token_starts.dtype == np.int64 and c.shard_doc_starts.dtype == np.int64
    assert c.shard_token_starts.size == c.shard_doc_starts.size == c.num_shards + 1


def test_doc_offsets_range_and_doc_index_at_equal_the_oracle(stdlib_manifest):
    """Every slice shape (one boundary, whole, across shards) and every token position's document,
    against offsets read with h5py (tests.helpers.oracle_stream)."""
    c = open_corpus(stdlib_manifest, "train")
    _, offs, _ = oracle_stream(stdlib_manifest)
    D = offs.size - 1
    np.testing.assert_array_equal(c.doc_lengths(), np.diff(offs))
    rng = np.random.default_rng(0)
    spans = [(0, 0), (0, D), (D, D), (D - 1, D)] + [tuple(sorted(rng.integers(0, D + 1, 2))) for _ in range(50)]
    spans += [(int(s), int(s) + 1) for s in c.shard_doc_starts[1:-1]]
    for lo, hi in spans:
        got = c.doc_offsets_range(lo, hi)
        assert got.dtype == np.int64 and got.shape == (hi - lo + 1,)
        np.testing.assert_array_equal(got, offs[lo : hi + 1], err_msg=f"[{lo}, {hi}]")
    pos = np.concatenate([offs[:-1], offs[1:] - 1, rng.integers(0, offs[-1], 500)])
    want = np.array([np.flatnonzero(offs <= p)[-1] for p in pos])
    np.testing.assert_array_equal(c.doc_index_at(pos), want)
    assert c.doc_index_at(pos.reshape(2, -1)).shape == (2, pos.size // 2)


@pytest.mark.parametrize(
    "call, err",
    [
        (lambda c: c.doc_offsets_range(-1, 2), IndexError),
        (lambda c: c.doc_offsets_range(3, 2), IndexError),
        (lambda c: c.doc_offsets_range(0, c.num_documents + 1), IndexError),
        (lambda c: c.doc_offsets_range(0.0, 2), TypeError),
        (lambda c: c.doc_index_at(np.array([c.num_tokens])), IndexError),
        (lambda c: c.doc_index_at(np.array([-1])), IndexError),
        (lambda c: c.doc_index_at(np.array([1.5])), TypeError),
    ],
)
def test_bad_arguments_are_refused_by_name(stdlib_manifest, call, err):
    c = open_corpus(stdlib_manifest, "train")
    with pytest.raises(err, match="doc_offsets_range|doc_index_at"):
        call(c)
