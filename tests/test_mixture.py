"""Weighted mixtures as part of the global plan (``h5corpus.mix``), for both loaders.

Shares of input tokens follow the weights (per epoch within one item of the quota, over every
quarter of an epoch within 0.05); a source that runs out wraps into its own next source epoch and
never repeats an item before all were read; the sequence is deterministic, its state carries the
per-source tokens (equal to what was yielded), and it resumes on another rank count. Oracles count
tokens per source from the yielded segment tables and window starts, by the sources' own sizes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import h5corpus
from h5corpus import BestFitDataset, LoaderStateError, SlidingWindowDataset, TokenizerIdentity, mix, open_corpus
from tests.helpers import (
    BYTE_IDENTITY,
    batch_digest,
    byte_encode,
    interleave_ranks,
    naive_chunks,
    stdlib_texts,
    write_corpus,
)

L_BF, B_BF = 512, 4  # best-fit rows and packs per microbatch
L_W, B_W = 300, 6  # window length and windows per batch


@pytest.fixture(scope="module")
def manifests(tmp_path_factory) -> dict[str, Path]:
    """Two corpora of different sizes (standard-library sources, byte ids), and one whose
    tokenizer gives other ids."""
    texts = stdlib_texts(200)
    out = {}
    for name, part, ident in (
        ("big", texts[:140], BYTE_IDENTITY),
        ("small", texts[140:], BYTE_IDENTITY),
        (
            "alien",
            texts[:20],
            TokenizerIdentity(
                name="other",
                revision="x",
                sha256="f" * 64,
                vocab_size=BYTE_IDENTITY.vocab_size,
                eos_id=BYTE_IDENTITY.eos_id,
            ),
        ),
    ):
        root = tmp_path_factory.mktemp(f"mix-{name}")
        out[name] = write_corpus(root, part, byte_encode, ident, chunk_tokens=4096, shard_tokens=200_000)
    return out


def sources(manifests):
    return [open_corpus(manifests["big"], "train"), open_corpus(manifests["small"], "train")]


def bf_source_tokens(batches, doc_split: int) -> np.ndarray:
    """(microbatches, 2) input tokens from documents below / from ``doc_split`` (the second source)."""
    return np.array(
        [
            [int(s[s[:, 0] < doc_split, 2].sum()), int(s[s[:, 0] >= doc_split, 2].sum())]
            for s in (b.segments.numpy() for b in batches)
        ]
    )


def window_source_tokens(ds, token_split: int) -> np.ndarray:
    starts = ds.plan()
    per = []
    for b in range(0, starts.size, ds.batch_size):
        s = starts[b : b + ds.batch_size]
        per.append([int((s < token_split).sum()) * ds.seq_len, int((s >= token_split).sum()) * ds.seq_len])
    return np.array(per)


def pairs(corpus) -> int:
    return int(np.maximum(corpus.doc_lengths() - 1, 0).sum())


def layout_windows(corpus, L: int) -> int:
    sts = corpus.shard_token_starts
    return int(np.maximum((np.diff(sts) - 1) // L, 0).sum())


@pytest.mark.parametrize("weights", [(3, 1), (1, 1), (1, 4)])
def test_best_fit_token_shares_follow_the_weights(manifests, weights):
    """Per epoch each source's tokens are within one chunk (max_seq_len tokens) of its quota
    floor(T * share); T defaults to min(pairs_s / share_s); every quarter of the epoch's microbatches
    is within 0.05 of the shares."""
    big, small = sources(manifests)
    m = mix([big, small], weights)
    ds = BestFitDataset(m, L_BF, B_BF, seed=4, with_segments=True)
    share = np.array(weights, float) / sum(weights)
    T = min(int(pairs(c) * sum(weights) / w) for c, w in zip((big, small), weights))
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        per = bf_source_tokens(list(ds), big.num_documents)
        got = per.sum(axis=0)
        quota = [int((epoch + 1) * T * w / sum(weights)) - int(epoch * T * w / sum(weights)) for w in weights]
        assert np.all(np.abs(got - quota) < L_BF), (got, quota)
        assert [s["tokens"] for s in ds.mixture_summary()] == got.tolist()
        for q in np.array_split(per, 4):
            assert np.all(np.abs(q.sum(axis=0) / q.sum() - share) < 0.05), q.sum(axis=0) / q.sum()


@pytest.mark.parametrize("weights", [(3, 1), (1, 2)])
def test_window_token_shares_follow_the_weights(manifests, weights):
    """Windows: each source's windows per epoch are exactly its quota rounded up to whole windows."""
    big, small = sources(manifests)
    ds = SlidingWindowDataset(mix([big, small], weights), L_W, B_W, seed=4)
    T = min(int(layout_windows(c, L_W) * L_W * sum(weights) / w) for c, w in zip((big, small), weights))
    per = window_source_tokens(ds, big.num_tokens).sum(axis=0)
    want = [-(-int(T * w / sum(weights)) // L_W) * L_W for w in weights]
    assert per.tolist() == want
    assert [s["tokens"] for s in ds.mixture_summary()] == want


def test_a_source_that_runs_out_wraps_into_its_own_next_epoch(manifests):
    """With equal weights the small source is used up exactly once per mixture epoch (a new order
    each time) while the big one continues where it stopped and starts its next source epoch only
    after all its chunks were read; with a larger tokens_per_epoch the small source wraps within
    one epoch, which the summary reports."""
    big, small = sources(manifests)
    ds = BestFitDataset(mix([big, small], [1, 1]), L_BF, B_BF, seed=2, with_segments=True)
    n_big = big.num_documents
    seen_big = {(d, s): 0 for d, s, _ in naive_chunks(big.doc_lengths().tolist(), L_BF)}  # every chunk of big
    first_orders = []
    for epoch in range(4):
        ds.set_epoch(epoch)
        segs = np.concatenate([b.segments.numpy() for b in ds])
        mine = segs[segs[:, 0] >= n_big]
        keys = sorted(map(tuple, mine[:, :2].tolist()))
        assert len(keys) == len(set(keys)) and int(mine[:, 2].sum()) == pairs(small), "small source not once"
        first_orders.append(tuple(map(tuple, mine[:5, :2].tolist())))
        for k in map(tuple, segs[segs[:, 0] < n_big][:, :2].tolist()):
            seen_big[k] += 1
        counts = np.array(list(seen_big.values()))
        assert counts.max() - counts.min() <= 1, "a big-source chunk repeated before all were read"
        summary = ds.mixture_summary()
        assert summary[1]["source_epochs"] == [epoch, epoch]
    assert len(set(first_orders)) == 4, "the small source repeats in the same order"
    wide = BestFitDataset(mix([big, small], [1, 1], tokens_per_epoch=5 * pairs(small)), L_BF, B_BF, seed=2)
    assert wide.mixture_summary()[1]["source_epochs"] == [0, 2]


@pytest.mark.parametrize("loader", ["bestfit", "window"])
def test_mixture_is_deterministic_records_source_tokens_and_resumes(manifests, loader):
    """Same seed, same sequence (another seed, another one); the state's source_tokens equal the
    yielded tokens per source; a mid-epoch state continues on 2 ranks with the next global batch."""
    big, small = sources(manifests)

    def make(seed=1, **kw):
        m = mix({"big": big, "small": small}, {"big": 2.0, "small": 1.0})
        if loader == "bestfit":
            return BestFitDataset(m, L_BF, B_BF, seed=seed, with_segments=True, **kw)
        return SlidingWindowDataset(m, L_W, B_W, seed=seed, **kw)

    ref = [batch_digest(b) for b in make()]
    assert ref == [batch_digest(b) for b in make()] and ref != [batch_digest(b) for b in make(seed=2)]
    ds = make()
    it = iter(ds)
    got = [next(it) for _ in range(9)]
    st = ds.state_dict()
    if loader == "bestfit":
        per = bf_source_tokens(got, big.num_documents).sum(axis=0).tolist()
    else:
        per = window_source_tokens(make(), big.num_tokens)[:9].sum(axis=0).tolist()
    assert st["source_tokens"] == per and st["settings"]["mixture"]["sources"] == ["big", "small"]
    assert [r["tokens_consumed"] for r in ds.mixture_summary()] == per
    per_rank = []
    for r in range(2):
        d = make(rank=r, world_size=2)
        d.load_state_dict(st)
        per_rank.append([batch_digest(b) for b in d])
    seq = interleave_ranks(per_rank)
    assert seq[:2] == ref[9:11] and seq == [ref[i % len(ref)] for i in range(9, 9 + len(seq))]
    other = (
        BestFitDataset(mix([big, small], [1, 1]), L_BF, B_BF, seed=1)
        if loader == "bestfit"
        else (SlidingWindowDataset(mix([big, small], [1, 1]), L_W, B_W, seed=1))
    )
    with pytest.raises(LoaderStateError, match="settings.mixture"):
        other.load_state_dict(st)


def test_mix_takes_paths_pairs_and_lists_and_refuses_bad_sources(manifests):
    """Manifest paths, (manifest, split) pairs and lists of sources are accepted; bad weights, a
    source whose tokenizer gives other ids, and random-mode windows over a mixture are refused."""
    m = mix([manifests["big"], (manifests["small"], "validation")])
    assert m.num_sources == 2 and m.names == ["source0", "source1"]
    assert (
        m.num_tokens
        == open_corpus(manifests["big"]).num_tokens + open_corpus(manifests["small"], "validation").num_tokens
    )
    listed = BestFitDataset([manifests["big"], manifests["small"]], L_BF, B_BF)
    shares = [s["share"] for s in listed.mixture_summary()]
    toks = [open_corpus(manifests[k]).num_tokens for k in ("big", "small")]
    assert shares == pytest.approx([t / sum(toks) for t in toks])
    assert isinstance(h5corpus.Mixture, type)
    for weights, msg in (
        ([1, 0], "weight must be"),
        ([1, -1], "weight must be"),
        ([1, float("nan")], "weight"),
        ([1], "2 sources but 1 weights"),
        ({"source0": 1}, "name every source"),
    ):
        with pytest.raises(ValueError, match=msg):
            mix([manifests["big"], manifests["small"]], weights)
    with pytest.raises(ValueError, match="'source1': tokenizer 'other'"):
        mix([manifests["big"], manifests["alien"]])
    with pytest.raises(ValueError, match="mode='random'"):
        SlidingWindowDataset(mix([manifests["big"], manifests["small"]]), 100, mode="random")
    with pytest.raises(TypeError, match="mixture source"):
        mix([manifests["big"], 3.5])
