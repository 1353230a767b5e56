"""Sliding-window loader: windows are slices of the token stream, DDP ranks x DataLoader workers
share one global sequence of batches (epoch coverage exact, the remainder rule exact), order is a
function of the seed, document masking, resume (plain, and via torchdata's StatefulDataLoader, three
times in a row), fork/spawn workers."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from h5corpus.loaders import window
from h5corpus.loaders.batch import IGNORE_INDEX, VarlenBatch, collate_varlen, concat_batches
from h5corpus.loaders.partition import Consumer
from h5corpus.loaders.window import SlidingWindowDataset
from h5corpus.storage.reader import open_corpus
from tests.helpers import oracle_stream


def oracle_stream_i64(manifest: Path, split: str = "train"):
    """The h5py oracle with tokens as int64 (what batches hold)."""
    return oracle_stream(manifest, split, dtype=np.int64)


def expected_epoch_starts(shard_starts: np.ndarray, seq_len: int) -> np.ndarray:
    """Independent statement of the epoch layout: per shard, windows at 0, L, 2L, ... while
    ``seq_len + 1`` tokens fit inside the shard."""
    out = []
    for a, b in zip(shard_starts[:-1].tolist(), shard_starts[1:].tolist()):
        out.extend(range(a, b - seq_len, seq_len))
    return np.array(out, np.int64)


def window_key(inputs: np.ndarray, last_target: int) -> bytes:
    """Identity of a window (its seq_len + 1 tokens) for multiset comparisons."""
    return hashlib.sha1(np.append(inputs, last_target).astype(np.int64).tobytes()).digest()


def windows_of(batch: VarlenBatch, seq_len: int) -> list[bytes]:
    """Window keys of a batch built without document masking (targets are the shifted inputs)."""
    inp, tgt = batch.input_ids.numpy().reshape(-1, seq_len), batch.targets.numpy().reshape(-1, seq_len)
    assert (inp[:, 1:] == tgt[:, :-1]).all()
    return [window_key(inp[j], int(tgt[j, -1])) for j in range(inp.shape[0])]


def stream_keys(toks: np.ndarray, starts: np.ndarray, seq_len: int) -> Counter:
    return Counter(window_key(toks[a : a + seq_len], int(toks[a + seq_len])) for a in starts.tolist())


def check_batch_against_stream(
    batch: VarlenBatch, starts: np.ndarray, toks: np.ndarray, offs: np.ndarray, seq_len: int, document_mask: bool
) -> None:
    """The batch holds exactly the windows at ``starts``: inputs/targets are stream slices, and with
    document masking segments/positions/ignored targets follow the document boundaries."""
    batch.check()
    L = seq_len
    assert batch.num_packs == starts.size and batch.num_tokens == starts.size * L
    assert batch.pack_lengths.tolist() == [L] * starts.size
    inp, tgt, pos = (t.numpy().reshape(-1, L) for t in (batch.input_ids, batch.targets, batch.position_ids))
    cu = batch.cu_seqlens.numpy()
    cuts: list[int] = []
    for j, a in enumerate(starts.tolist()):
        np.testing.assert_array_equal(inp[j], toks[a : a + L])
        want = toks[a + 1 : a + L + 1].copy()
        doc = np.searchsorted(offs, np.arange(a, a + L + 1), side="right") - 1  # document of each token
        if document_mask:
            crossing = doc[1:] != doc[:-1]
            want[crossing] = IGNORE_INDEX
            starts_inside = np.flatnonzero(doc[1:L] != doc[: L - 1]) + 1
            seg_starts = np.concatenate([[0], starts_inside])
            cuts.extend((j * L + seg_starts).tolist())
            expect_pos = np.arange(L) - seg_starts[np.searchsorted(seg_starts, np.arange(L), side="right") - 1]
            np.testing.assert_array_equal(pos[j], expect_pos)
        else:
            cuts.append(j * L)
            np.testing.assert_array_equal(pos[j], np.arange(L))
        np.testing.assert_array_equal(tgt[j], want)
    np.testing.assert_array_equal(cu, np.array(cuts + [starts.size * L]))
    assert batch.max_seqlen == int(np.diff(cu).max())


# -- windows are slices of the stream --------------------------------------------------------------


@pytest.mark.parametrize("document_mask", [False, True])
@pytest.mark.parametrize("mode", ["epoch", "random"])
def test_windows_are_stream_slices_with_exact_targets_segments_and_positions(stdlib_manifest, mode, document_mask):
    """Every yielded window equals tokens[a : a + L + 1] of the shard-by-shard stream at the planned
    start a; with document masking, segments start at document starts, positions restart, and only
    the cross-document targets are ignored. Epoch mode covers the independently computed layout."""
    c = open_corpus(stdlib_manifest, "train")
    toks, offs, shard_starts = oracle_stream_i64(stdlib_manifest)
    L = 1500
    ds = SlidingWindowDataset(c, L, batch_size=6, seed=5, mode=mode, document_mask=document_mask)
    plan = ds.plan()
    if mode == "epoch":
        np.testing.assert_array_equal(np.sort(plan), expected_epoch_starts(shard_starts, L))
    else:
        assert plan.size == ds.num_windows and plan.min() >= 0 and plan.max() <= c.num_tokens - L - 1
        assert np.unique(plan).size > 0.9 * plan.size
    k = 0
    for batch in ds:
        n = batch.num_packs
        check_batch_against_stream(batch, plan[k : k + n], toks, offs, L, document_mask)
        k += n
    assert k == plan.size == ds.num_windows


def test_epoch_windows_match_stream_as_a_multiset_without_the_plan(stdlib_manifest):
    """Oracle that does not trust plan(): the multiset of yielded windows equals the multiset of
    stream windows at the documented starts (each window exactly once)."""
    c = open_corpus(stdlib_manifest, "train")
    toks, _, shard_starts = oracle_stream_i64(stdlib_manifest)
    L = 777
    got = Counter(k for b in SlidingWindowDataset(c, L, batch_size=16, seed=1) for k in windows_of(b, L))
    assert got == stream_keys(toks, expected_epoch_starts(shard_starts, L), L)


def test_epoch_windows_are_chunk_aligned_when_chunk_is_a_multiple_of_seq_len(stdlib_manifest):
    """With chunk_tokens a multiple of seq_len, every window starts a whole number of strides into
    its shard, so it lies in one chunk plus at most the first token of the next."""
    c = open_corpus(stdlib_manifest, "train")
    C = c.chunk_tokens
    for L in (C // 4, C // 2, C):
        starts = SlidingWindowDataset(c, L).plan()
        local = starts - c.shard_token_starts[np.searchsorted(c.shard_token_starts, starts, side="right") - 1]
        assert (local % L == 0).all()
        first, last = local // C, (local + L) // C
        assert ((last == first) | ((last == first + 1) & ((local + L) % C == 0))).all()


@pytest.mark.parametrize("document_mask", [False, True])
@pytest.mark.parametrize("read_path", ["mmap", "h5py"])
def test_windows_across_shard_ends_run_gaps_and_chunk_edges_equal_the_stream(stdlib_manifest, read_path, document_mask):
    """make_batch of windows at every place a copy out of the memory maps could go wrong: across
    a shard boundary (random mode's windows may cross), across a gap between two runs of
    file-contiguous chunks (where HDF5 put an index block), across chunk boundaries, and the
    stream's last window; every window equals the stream's slice, through the memory maps and
    through HDF5. All batches are kept: each stays intact while later ones are made. Starts
    outside the stream raise."""
    c = open_corpus(stdlib_manifest, "train", read_path=read_path)
    toks, offs, shard_starts = oracle_stream_i64(stdlib_manifest)
    L, N = 300, c.num_tokens
    table = open_corpus(stdlib_manifest, "train", read_path="mmap").run_table()
    gaps = np.setdiff1d(table.starts, shard_starts)  # run starts inside a shard: a gap before each
    assert gaps.size > 0 and shard_starts.size > 3  # the corpus has both kinds of boundary
    chunks = np.concatenate([np.arange(a, b, c.chunk_tokens) for a, b in zip(shard_starts[:-1], shard_starts[1:])])
    edges = np.concatenate([shard_starts[1:-1], gaps, chunks[::7]])
    starts = np.unique(np.concatenate([edges - k for k in (L, L // 2, 1, 0)] + [[0, N - L - 1]]))
    starts = starts[(starts >= 0) & (starts <= N - L - 1)]
    ds = SlidingWindowDataset(c, L, mode="random", document_mask=document_mask)
    for _ in range(2):  # chunks first seen (verified as read), then all verified (copied from both runs)
        batches = [ds.make_batch(starts[i : i + 7]) for i in range(0, starts.size, 7)]
        for i, b in zip(range(0, starts.size, 7), batches):
            check_batch_against_stream(b, starts[i : i + 7], toks, offs, L, document_mask)
    for bad in (N - L, -1):
        with pytest.raises(IndexError, match="outside"):
            ds.make_batch(np.array([0, bad]))


@pytest.mark.parametrize("document_mask", [False, True])
def test_batches_before_and_after_every_chunk_is_verified_equal_the_stream_and_stay_intact(
    stdlib_manifest, document_mask
):
    """A fresh corpus (chunks not verified yet: windows are located batch by batch) and the same
    corpus once every chunk is verified (a block of batches located at once) yield the same
    batches, equal to the stream, each intact after all later ones were produced."""
    c = open_corpus(stdlib_manifest, "train")
    toks, offs, shard_starts = oracle_stream_i64(stdlib_manifest)
    L = 900
    ds = SlidingWindowDataset(c, L, batch_size=5, seed=2, mode="random", document_mask=document_mask)
    plan = ds.plan()
    assert c.run_table().pending > 0
    fresh = list(ds)
    chunks = np.concatenate([np.arange(a, b, c.chunk_tokens) for a, b in zip(shard_starts[:-1], shard_starts[1:])])
    c.run_table().locate(chunks)  # every chunk verified (random starts need not fall in each one)
    assert c.run_table().pending == 0
    steady = list(ds)
    assert len(fresh) == len(steady) == -(-plan.size // 5)
    for i, (a, b) in enumerate(zip(fresh, steady)):
        check_batch_against_stream(a, plan[5 * i : 5 * i + a.num_packs], toks, offs, L, document_mask)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.cu_seqlens, b.cu_seqlens)
        assert torch.equal(a.ignore, b.ignore) and a.max_seqlen == b.max_seqlen


def test_dev_corpus_gpt2_windows_equal_stream_slices(dev_manifest):
    """Real GPT-2 shards: 1024-token windows (epoch and random, with and without document masking)
    equal slices of the concatenated stream; epoch mode covers the documented layout exactly."""
    c = open_corpus(dev_manifest, "train")
    toks, offs, shard_starts = oracle_stream_i64(dev_manifest)
    L = 1024
    for mode, dm in (("epoch", False), ("epoch", True), ("random", True)):
        ds = SlidingWindowDataset(c, L, batch_size=8, seed=11, mode=mode, document_mask=dm)
        plan = ds.plan()
        if mode == "epoch":
            np.testing.assert_array_equal(np.sort(plan), expected_epoch_starts(shard_starts, L))
        k = 0
        for i, batch in enumerate(ds):
            if i % 10 == 0:  # check a sample of batches in full
                check_batch_against_stream(batch, plan[k : k + batch.num_packs], toks, offs, L, dm)
            k += batch.num_packs
        assert k == plan.size


# -- order and determinism ---------------------------------------------------------------------------


def test_same_seed_same_batches_other_seed_or_epoch_same_windows_other_order(stdlib_manifest):
    """Order is a pure function of (seed, epoch): two datasets with one seed yield identical batches;
    another seed or another epoch yields the same windows in a different order."""
    c = open_corpus(stdlib_manifest, "train")
    L = 512

    def run(seed, epoch=0, mode="epoch"):
        ds = SlidingWindowDataset(c, L, batch_size=4, seed=seed, mode=mode)
        ds.set_epoch(epoch)
        return [b.input_ids.numpy().tobytes() for b in ds]

    def windows(batches):  # the multiset of windows, whatever their grouping into batches
        return Counter(map(bytes, np.frombuffer(b"".join(batches), np.int64).reshape(-1, L)))

    a = run(7)
    assert a == run(7)
    for other in (run(8), run(7, epoch=1)):
        assert other != a  # another order ...
        assert windows(other) == windows(a)  # ... of the same windows
    r = run(7, mode="random")
    assert r == run(7, mode="random") and r != run(7, epoch=1, mode="random")


# -- consumers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
def test_two_ranks_by_two_workers_share_one_global_sequence(stdlib_manifest, drop_last):
    """2 DDP ranks x 2 DataLoader workers: the epoch's windows, batch_size per batch in order, form
    one global sequence; rank r yields batches r, r + 2, ...; its workers split them in turn
    (plans, and what real DataLoader workers yield). Without drop_last the global sequence is the
    whole layout (the last batch short) and an odd last step repeats batch 0; with drop_last every
    batch is full and the incomplete step is dropped. Every rank yields the same count."""
    c = open_corpus(stdlib_manifest, "train")
    toks, _, shard_starts = oracle_stream_i64(stdlib_manifest)
    L, B = 700, 5
    layout = expected_epoch_starts(shard_starts, L)
    one = SlidingWindowDataset(c, L, batch_size=B, seed=3, drop_last=drop_last).plan()
    n = layout.size // B * B if drop_last else layout.size
    assert one.size == n and np.isin(one, layout).all() and np.unique(one).size == one.size
    batches = [one[i : i + B] for i in range(0, n, B)]
    M = len(batches)
    steps = M // 2 if drop_last else -(-M // 2)
    for rank in range(2):
        ds = SlidingWindowDataset(c, L, batch_size=B, seed=3, rank=rank, world_size=2, drop_last=drop_last)
        mine = [batches[g % M] for g in range(rank, 2 * steps, 2)]
        for w in range(2):
            want = np.concatenate(mine[w::2]) if mine[w::2] else np.zeros(0, np.int64)
            np.testing.assert_array_equal(ds.plan(consumer=Consumer(rank, 2, w, 2)), want)
        got = [windows_of(b, L) for b in DataLoader(ds, batch_size=None, num_workers=2)]
        assert len(got) == steps == len(ds)
        assert all(Counter(g) == stream_keys(toks, m, L) for g, m in zip(got, mine)), "other windows or order"
        if drop_last:
            assert {len(g) for g in got} == {B}


def test_dev_corpus_two_ranks_by_two_workers_cover_epoch_exactly(dev_manifest):
    """Real GPT-2 shards, 2 ranks x 2 forked workers: the yielded windows are exactly the epoch,
    plus batch 0's windows again when the epoch's batch count is odd (the last step wraps)."""
    c = open_corpus(dev_manifest, "train")
    toks, _, shard_starts = oracle_stream_i64(dev_manifest)
    L = 2048
    seen: Counter = Counter()
    for rank in range(2):
        ds = SlidingWindowDataset(c, L, batch_size=8, seed=0, rank=rank, world_size=2)
        for b in DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"):
            seen.update(windows_of(b, L))
    want = stream_keys(toks, expected_epoch_starts(shard_starts, L), L)
    if ds.num_microbatches() % 2:
        want.update(stream_keys(toks, SlidingWindowDataset(c, L, batch_size=8, seed=0).plan()[:8], L))
    assert seen == want


def test_spawned_workers_yield_the_same_windows_as_in_process(stdlib_manifest):
    """The dataset (and its corpus) pickles into spawned workers, which reopen the shards and yield
    the same windows as iterating in-process; worker 0's first batch is its plan's first windows."""
    c = open_corpus(stdlib_manifest, "train")
    c.tokens(0, 10)  # the parent holds open handles; workers must not need them
    L = 2000
    ds = SlidingWindowDataset(c, L, batch_size=8, seed=2, document_mask=True)

    def windows(batches):  # (inputs, targets) of every window, whatever the batch grouping
        return Counter(
            bytes(i) + bytes(t)
            for b in batches
            for i, t in zip(b.input_ids.numpy().reshape(-1, L), b.targets.numpy().reshape(-1, L))
        )

    here = windows(ds)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    batches = list(loader)
    assert windows(batches) == here and sum(here.values()) == ds.num_windows
    worker0 = SlidingWindowDataset(c, L, batch_size=8, seed=2, document_mask=True).plan(consumer=Consumer(0, 1, 0, 2))
    first = batches[0].input_ids.numpy().reshape(-1, L)[:, 0]  # DataLoader takes worker 0's batch first
    np.testing.assert_array_equal(first, c.gather(worker0[: first.size], 1)[:, 0])


# -- resume --------------------------------------------------------------------------------------------


def _resume_in_steps(make, steps: list[int]) -> list[bytes]:
    """Iterate ``steps[0]`` batches, checkpoint, rebuild, resume, ... then run to the end."""
    got: list[bytes] = []
    state = None
    for n in steps + [None]:
        ds = make()
        if state is not None:
            ds.load_state_dict(state)
        it = iter(ds)
        for i, b in enumerate(it):
            got.append(b.input_ids.numpy().tobytes() + b.targets.numpy().tobytes())
            if n is not None and i + 1 == n:
                break
        state = ds.state_dict()
    return got


@pytest.mark.parametrize("mode", ["epoch", "random"])
def test_resume_three_times_in_a_row_equals_uninterrupted(stdlib_manifest, mode):
    """Checkpoint after 3, 5 and 1 batches (three resumes in a row, plus running to the end) gives
    exactly the uninterrupted epoch; the state is plain JSON-able data."""
    c = open_corpus(stdlib_manifest, "train")
    make = lambda: SlidingWindowDataset(c, 900, batch_size=7, seed=4, mode=mode, document_mask=True, epoch=2)  # noqa: E731
    full = [b.input_ids.numpy().tobytes() + b.targets.numpy().tobytes() for b in make()]
    assert _resume_in_steps(make, [3, 5, 1]) == full
    ds = make()
    it = iter(ds)
    next(it)
    st = json.loads(json.dumps(ds.state_dict()))
    assert st["epoch"] == 2 and st["position"] == 1 and st["tokens"] == 7 * 900
    assert st["writer"] == {"rank": 0, "world_size": 1, "worker": 0, "num_workers": 1, "start": 0, "yielded": 1}


def test_resume_refuses_other_corpus_seed_or_seq_len_and_continues_on_another_rank_count(stdlib_manifest):
    """A state from another seed/seq_len/corpus is refused at load, naming the field; a state of a
    1-rank run continues on 2 ranks at the same global position (rank 1 takes the batch after)."""
    c = open_corpus(stdlib_manifest, "train")
    v = open_corpus(stdlib_manifest, "validation")
    ds = SlidingWindowDataset(c, 512, seed=1)
    next(iter(ds))
    st = ds.state_dict()
    for other, field in (
        (SlidingWindowDataset(c, 512, seed=2), "settings.seed"),
        (SlidingWindowDataset(c, 256, seed=1), "settings.seq_len"),
        (SlidingWindowDataset(v, 512, seed=1), "fingerprint"),
    ):
        with pytest.raises(ValueError, match=f"loader state field '{field}'"):
            other.load_state_dict(st)
    full = SlidingWindowDataset(c, 512, seed=1).plan()
    ranked = SlidingWindowDataset(c, 512, seed=1, rank=1, world_size=2)
    ranked.load_state_dict(st)
    b = next(iter(ranked))
    np.testing.assert_array_equal(b.input_ids.numpy().reshape(8, 512)[:, :1].ravel(), c.gather(full[16:24], 1).ravel())


def test_set_epoch_starts_fresh_and_finished_epoch_resumes_empty(stdlib_manifest):
    """A state saved at the end of an epoch resumes to nothing more in that epoch; set_epoch to the
    next epoch then yields that whole epoch."""
    c = open_corpus(stdlib_manifest, "train")
    ds = SlidingWindowDataset(c, 3000, batch_size=8, seed=9)
    n = sum(1 for _ in ds)
    st = ds.state_dict()
    assert st["position"] == ds.num_microbatches() == -(-ds.num_windows // 8) == n
    ds2 = SlidingWindowDataset(c, 3000, batch_size=8, seed=9)
    ds2.load_state_dict(st)
    assert list(ds2) == []
    ds2.set_epoch(1)
    assert sum(1 for _ in ds2) == n


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_three_times_exactly(dev_manifest, num_workers):
    """torchdata StatefulDataLoader (0 or 2 workers) checkpointed and rebuilt three times in a row
    yields exactly the uninterrupted sequence of batches (real GPT-2 shards)."""
    StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
    c = open_corpus(dev_manifest, "train")

    def make():
        ds = SlidingWindowDataset(c, 4096, batch_size=4, seed=6, document_mask=True)
        return StatefulDataLoader(ds, batch_size=None, num_workers=num_workers)

    key = lambda b: b.input_ids.numpy().tobytes() + b.targets.numpy().tobytes() + b.cu_seqlens.numpy().tobytes()  # noqa: E731
    full = [key(b) for b in make()]
    got, state = [], None
    for n in (17, 4, 9, None):
        loader = make()
        if state is not None:
            loader.load_state_dict(state)
        it = iter(loader)
        for i, b in enumerate(it):
            got.append(key(b))
            if n is not None and i + 1 == n:
                break
        state = loader.state_dict()
        del it, loader
    assert len(full) > 30 and got == full


# -- batches and collation -------------------------------------------------------------------------


def test_collate_varlen_concatenates_dataset_items_into_one_valid_batch(stdlib_manifest):
    """DataLoader(batch_size=2, collate_fn=collate_varlen) joins two VarlenBatches end to end:
    contents, segments and invariants preserved; batch_size=None passes batches through."""
    c = open_corpus(stdlib_manifest, "train")
    ds = SlidingWindowDataset(c, 600, batch_size=3, seed=0, document_mask=True)
    singles = list(ds)
    pairs = list(DataLoader(ds, batch_size=2, collate_fn=collate_varlen))
    assert len(pairs) == (len(singles) + 1) // 2
    for i, p in enumerate(pairs):
        p.check()
        want = concat_batches(singles[2 * i : 2 * i + 2])
        for f in ("input_ids", "targets", "position_ids", "cu_seqlens", "pack_lengths"):
            assert torch.equal(getattr(p, f), getattr(want, f)), f
        assert p.max_seqlen == want.max_seqlen and p.cu_seqlens.dtype == torch.int32
    passthrough = next(iter(DataLoader(ds, batch_size=None, collate_fn=collate_varlen)))
    assert torch.equal(passthrough.input_ids, singles[0].input_ids)


def test_dataset_argument_checks(stdlib_manifest):
    """Bad arguments are refused with the reason."""
    c = open_corpus(stdlib_manifest, "train")
    for kw, msg in (
        (dict(seq_len=0), "seq_len"),
        (dict(seq_len=8, batch_size=0), "batch_size"),
        (dict(seq_len=8, mode="shuffle"), "mode"),
        (dict(seq_len=8, windows_per_epoch=5), "windows_per_epoch"),
    ):
        with pytest.raises(ValueError, match=msg):
            SlidingWindowDataset(c, **kw)
    assert list(SlidingWindowDataset(c, c.num_tokens + 5)) == []


def test_document_masks_are_the_same_whichever_way_boundaries_are_read(stdlib_manifest, monkeypatch):
    """Masks of a whole epoch with the boundary cache (a corpus under 1 Mi documents) equal those
    read window by window (the path of larger corpora); reaches inside (window._DocBoundaries)
    because only its size limit picks the path."""
    c = open_corpus(stdlib_manifest, "train")
    ref = list(SlidingWindowDataset(c, 300, 5, seed=1, document_mask=True))
    monkeypatch.setattr(window._DocBoundaries, "SLOTS", 1)
    monkeypatch.setattr(window._DocBoundaries, "BLOCK", 1)
    got = list(SlidingWindowDataset(c, 300, 5, seed=1, document_mask=True))
    assert len(got) == len(ref) > 10
    for g, r in zip(got, ref):
        for f in ("input_ids", "targets", "position_ids", "cu_seqlens"):
            assert torch.equal(getattr(g, f), getattr(r, f)), f
