"""The best-fit loader's rolling shard window (``shuffle_window_shards``, its default): an epoch
order over every chunk once that reads a bounded set of shards at a time, and the global shuffle
where the split has no more shards than the window."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from h5corpus import BestFitDataset, LoaderStateError, open_corpus
from h5corpus.loaders.bestfit import write_plans
from h5corpus.loaders.blockshuffle import DEFAULT_WINDOW_SHARDS, window_generator, window_order
from h5corpus.loaders.epochplan import PlanSettings, pack_fill
from tests.helpers import assert_two_ranks_of_two_workers_replay, batch_digest, naive_chunks
from tests.s3_helpers import small_shards_corpus

SEQ = 256


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return small_shards_corpus(tmp_path_factory.mktemp("window-corpus"))


def bestfit(source, window=DEFAULT_WINDOW_SHARDS, **kw) -> BestFitDataset:
    return BestFitDataset(source, 2 * SEQ, 4, 16, seed=3, shuffle_window_shards=window, **kw)


def digests(ds) -> list[str]:
    return [batch_digest(b) for b in ds]


def shards_of(order: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    return np.searchsorted(bounds, order, side="right") - 1


def test_window_order_is_a_permutation_reading_a_bounded_mixed_set_of_shards():
    """Oracle from the sequence alone: every item once; any stretch as long as the smallest shard
    reads at most K + 1 shards, yet mixes nearly K of them; each shard's items are spread over a
    stretch of about K shards' worth of items, not read in one piece."""
    counts = np.random.default_rng(1).integers(150, 250, 300)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    K = 16
    order = window_order(bounds, K, window_generator(5, 0))
    assert order.dtype == np.uint32 and np.array_equal(np.sort(order), np.arange(bounds[-1]))
    shard = shards_of(order, bounds)
    m = int(counts.min())
    distinct = np.array([np.unique(shard[i : i + m]).size for i in range(0, order.size - m, 97)])
    assert distinct.max() <= K + 1
    assert np.median(distinct) >= K - 1
    first = np.full(counts.size, order.size)
    last = np.zeros(counts.size, np.int64)
    np.minimum.at(first, shard, np.arange(order.size))
    np.maximum.at(last, shard, np.arange(order.size))
    span = (last - first + 1)[first > 0]  # shards dealt over the wrap-around start span the circle
    assert span.min() > (K - 4) * m
    assert np.array_equal(window_order(bounds, K, window_generator(5, 0)), order)
    assert not np.array_equal(window_order(bounds, K, window_generator(5, 1)), order)
    for bad in (0, counts.size, counts.size + 3):
        with pytest.raises(ValueError, match="window"):
            window_order(bounds, bad, window_generator(5, 0))


def test_the_window_over_a_corpus_every_pair_once_and_bounded_shards_per_microbatch(corpus):
    c = open_corpus(corpus)
    assert c.num_shards > 3
    lengths = c.doc_lengths()
    chunks = naive_chunks(lengths.tolist(), 2 * SEQ)  # the oracle's chunks, in corpus order
    doc_shard = np.searchsorted(c.shard_doc_starts, np.arange(lengths.size), side="right") - 1

    def wide(K):  # 16 packs per microbatch: enough segments to see how many shards one reads
        return BestFitDataset(c, 2 * SEQ, 16, 16, seed=3, shuffle_window_shards=K, with_segments=True)

    ds = wide(2)
    assert ds.settings.shuffle_window_shards == 2 and ds.state_dict()["settings"]["shuffle_window_shards"] == 2
    stream = ds.plan().stream
    assert np.array_equal(np.sort(stream), np.arange(len(chunks)))
    assert not np.array_equal(stream, wide(None).plan().stream)
    shard = doc_shard[[chunks[i][0] for i in stream.tolist()]]
    m = int(np.bincount(shard).min())
    assert max(np.unique(shard[i : i + m]).size for i in range(0, shard.size - m + 1)) <= 2 + 1
    batches = list(ds)
    segs = np.concatenate([b.segments.numpy() for b in batches])
    assert sorted(map(tuple, segs.tolist())) == sorted(chunks)  # every next-token pair exactly once
    # a chunk may wait in the packing buffer, so per microbatch the bound holds for the median
    per_mb = [np.unique(doc_shard[b.segments[:, 0].numpy()]).size for b in batches]
    glob = [np.unique(doc_shard[b.segments[:, 0].numpy()]).size for b in wide(None)]
    assert np.median(per_mb) <= 2 + 1 < np.median(glob)


def test_a_split_of_no_more_shards_than_the_window_is_shuffled_as_before(corpus):
    """The default window on a 12-shard split: the global shuffle, and settings (so plan files
    and checkpoints) without the window, as written before it existed."""
    c = open_corpus(corpus)
    for K in (DEFAULT_WINDOW_SHARDS, c.num_shards):
        ds = bestfit(c, K)
        assert ds.settings == bestfit(c, None).settings
        assert "shuffle_window_shards" not in ds.state_dict()["settings"]
        assert digests(ds) == digests(bestfit(c, None))
    assert bestfit(c, 4, shuffle_block_shards=2).settings.shuffle_window_shards is None  # blocks win
    assert bestfit(c, 4, shuffle=False).settings.shuffle_window_shards is None
    assert bestfit([c, c], 4).settings.shuffle_window_shards is None  # a mixture interleaves its sources


def test_same_batches_on_two_ranks_of_two_workers_and_resume_on_another_world_size(corpus):
    c = open_corpus(corpus)
    want = assert_two_ranks_of_two_workers_replay(lambda **kw: bestfit(c, 2, **kw))
    ds = bestfit(c, 2, rank=0, world_size=2)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = ds.state_dict()
    again = bestfit(c, 2, rank=0, world_size=1)
    again.load_state_dict(state)
    assert digests(again) == want[6:]
    for other in (None, 3):
        with pytest.raises(LoaderStateError, match="shuffle_window_shards"):
            bestfit(c, other).load_state_dict(state)
    old = bestfit(c, None, rank=0, world_size=1)  # a checkpoint of the global order (as before the window)
    it = iter(old)
    next(it)
    state = old.state_dict()
    assert "shuffle_window_shards" not in state["settings"]
    with pytest.raises(LoaderStateError, match="shuffle_window_shards.*missing"):
        bestfit(c, 2).load_state_dict(state)
    again = bestfit(c, None)
    again.load_state_dict(state)  # continued in its own order
    assert digests(again) == digests(bestfit(c, None))[1:]


def test_plan_files_and_the_plan_command_are_keyed_by_the_window(corpus, tmp_path):
    from typer.testing import CliRunner

    from h5corpus.cli import app

    c = open_corpus(corpus)
    common = dict(max_seq_len=2 * SEQ, batch_size=4, packing_buffer=16, seed=3)
    assert write_plans(corpus, tmp_path, [0], shuffle_window_shards=2, **common) != write_plans(
        corpus, tmp_path, [0], shuffle_window_shards=None, **common
    )
    pdir = tmp_path / "cli"
    args = ["plan", str(corpus), "--plan-dir", str(pdir), "--max-seq-len", str(2 * SEQ), "--batch-size", "4"]
    args += ["--packing-buffer", "16", "--seed", "3"]
    for K in ("2", "0"):
        res = CliRunner().invoke(app, [*args, "--shuffle-window-shards", K])
        assert res.exit_code == 0, res.output
    assert len(list(pdir.glob("*.h5cplan"))) == 2
    assert digests(bestfit(c, 2, plan_dir=pdir)) == digests(bestfit(c, 2))
    assert digests(bestfit(c, None, plan_dir=pdir)) == digests(bestfit(c, None))
    assert len(list(pdir.glob("*.h5cplan"))) == 2  # the datasets found the command's files
    bad = CliRunner().invoke(app, [*args, "--shuffle-window-shards", "-1"])
    assert bad.exit_code == 2 and "shuffle_window_shards" in bad.output and "Traceback" not in bad.output


def test_bad_window_settings_are_refused_by_name(corpus):
    c = open_corpus(corpus)
    for bad in (0, -1, 1.5, True):
        with pytest.raises((ValueError, TypeError), match="shuffle_window_shards"):
            bestfit(c, bad)
    with pytest.raises(ValueError, match="shuffle_window_shards"):
        PlanSettings(shuffle=False, shuffle_window_shards=4)
    with pytest.raises(ValueError, match="shuffle_window_shards"):
        PlanSettings(shuffle_block_shards=2, shuffle_window_shards=4)


def test_pack_fill_under_the_window_on_the_dev_train_split(dev_manifest):
    """docs/PACKING.md: the window leaves pack fill where the global shuffle has it. The dev train
    split's documents cut into 200 consecutive "shards" (as a build's shards follow its inputs)."""
    c = open_corpus(dev_manifest, "train")
    lengths = c.doc_lengths()
    sds = np.linspace(0, lengths.size, 201).astype(np.int64)
    for mode, buf, floor in (("buffer", 64, 0.999), ("bfd", None, 0.9998)):
        base = pack_fill(lengths, 4096, 35, buf, 0, mode)
        f = pack_fill(lengths, 4096, 35, buf, 0, mode, shuffle_window_shards=64, shard_doc_starts=sds)
        assert f.real_tokens == base.real_tokens  # the same pairs, another order
        assert f.fill > floor, (mode, f.fill, base.fill)
        print(f"dev train in 200 shards, {mode}: fill {f.fill:.5f} (global {base.fill:.5f})")
