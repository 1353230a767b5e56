"""The O(1)-memory seeded permutation behind the window loader's epoch order: a bijection of
[0, n) for every n, computable for any subset of positions, as uniform as a shuffle on the
marginals; and the window loader reading through it holds no per-window array."""

from __future__ import annotations

import json

import numpy as np
import pytest

from h5corpus.loaders.permutation import keys, permute
from h5corpus.loaders.state import LoaderStateError
from h5corpus.loaders.window import ORDER, SlidingWindowDataset
from h5corpus.storage.reader import open_corpus


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 255, 256, 257, 1000, 4097, 65536, 100_003])
def test_a_bijection_of_every_size(n):
    k = keys(3, n, 11)
    got = permute(np.arange(n), n, k)
    assert got.dtype == np.int64 and np.array_equal(np.sort(got), np.arange(n))


def test_any_positions_give_the_full_permutations_values_and_the_seed_chooses_it():
    n = 12_345
    full = permute(np.arange(n), n, keys(0, 1))
    rng = np.random.default_rng(5)
    items = rng.integers(0, n, 500)
    assert np.array_equal(permute(items, n, keys(0, 1)), full[items])
    assert np.array_equal(permute(np.arange(n), n, keys(0, 1)), full)  # same seed, same order
    assert not np.array_equal(permute(np.arange(n), n, keys(0, 2)), full)  # another epoch, another order
    with pytest.raises(IndexError):
        permute(np.array([n]), n, keys(0, 1))


def test_positions_are_uniform_like_a_shuffle():
    """Over 3,000 seeds, each item of [0, 10) lands on each position ~300 times (a chi-square
    bound at p ~ 1e-6 for 81 degrees of freedom), and on a large n the order keeps no trace of
    the input order."""
    n, draws = 10, 3000
    counts = np.zeros((n, n), np.int64)
    for s in range(draws):
        counts[np.arange(n), permute(np.arange(n), n, keys(7, s))] += 1
    expected = draws / n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 160, chi2
    x = np.arange(200_000)
    y = permute(x, x.size, keys(1))
    assert abs(np.corrcoef(x, y)[0, 1]) < 0.01
    assert (x == y).sum() < 10  # a random permutation has one fixed point on average
    assert abs(np.abs(np.diff(y)).mean() / (x.size / 3) - 1) < 0.01  # uniform pairs: mean gap n/3


def test_the_window_loader_reads_through_it_without_a_per_window_array(stdlib_manifest):
    """A whole epoch read builds no per-window array; its window starts are the layout the shard
    sizes give (window k of shard s at its start + 64 k), each once; a checkpoint without the
    order's name (the earlier, materialized shuffle) is refused naming it."""
    c = open_corpus(stdlib_manifest, "train")
    ds = SlidingWindowDataset(c, seq_len=64, batch_size=4, seed=3)
    assert sum(1 for _ in ds) == -(-ds.num_windows // 4)
    assert "perm" not in ds._cache
    sts = c.shard_token_starts
    layout = np.concatenate(
        [sts[s] + 64 * np.arange(max((sts[s + 1] - sts[s] - 1) // 64, 0)) for s in range(sts.size - 1)]
    )
    got = ds._starts(0, np.arange(ds.num_windows))
    assert np.array_equal(np.sort(got), np.sort(layout)) and not np.array_equal(got, layout)
    st = json.loads(json.dumps(ds.state_dict()))
    assert st["settings"]["window_order"] == ORDER
    del st["settings"]["window_order"]
    again = SlidingWindowDataset(c, seq_len=64, batch_size=4, seed=3)
    with pytest.raises(LoaderStateError, match="window_order"):
        again.load_state_dict(st)
