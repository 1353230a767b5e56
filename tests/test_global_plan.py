"""One global sequence of microbatches per epoch, whatever the cluster shape.

For both loaders: world_size x DataLoader workers in {1x1, 1x2, 2x1, 2x2, 4x1} yield the same
global sequence (ranks interleaved step by step) with equal counts per rank (= ``len()``); a 2x2 run
resumed mid-epoch on 4x1 and 1x1 continues with the identical next global batch; the remainder rule
wraps (or drops) exactly the microbatches it documents; every next-token pair once per epoch; long
documents' chunks spread over the epoch; ``seek`` starts at a global position without reading the
skipped microbatches; fill targets on the dev corpus. The reference sequence is the single-process
iteration (the definition of the global sequence); oracles of its contents (pairs, document runs)
are computed from the yielded tokens and segment tables, never from the loaders' internals.
"""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import torch

from h5corpus import BestFitDataset, SlidingWindowDataset, open_corpus
from h5corpus.loaders import bestfit, window
from h5corpus.loaders.batch import VarlenBatch
from h5corpus.loaders.epochplan import pack_fill
from tests.helpers import batch_digest, interleave_ranks, majority_document_run, naive_buffer_packs, naive_chunks

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated", "ignore:This DataLoader will create")

SHAPES = [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1)]

#: (name, factory(corpus, **kw)): the dev corpus at the issue's sizes (4,096-token rows, 35 per microbatch)
DEV_LOADERS = {
    "bestfit-buffer": lambda c, **kw: BestFitDataset(c, 4096, 35, 64, seed=0, **kw),
    "bestfit-bfd": lambda c, **kw: BestFitDataset(c, 4096, 35, mode="bfd", seed=1, **kw),
    "window": lambda c, **kw: SlidingWindowDataset(c, 4096, 35, seed=0, **kw),
    "window-mask": lambda c, **kw: SlidingWindowDataset(c, 4096, 35, seed=2, document_mask=True, **kw),
}
STDLIB_LOADERS = {
    "bestfit-buffer": lambda c, **kw: BestFitDataset(c, 1024, 5, 32, seed=3, **kw),
    "bestfit-bfd": lambda c, **kw: BestFitDataset(c, 1024, 5, 400, seed=3, mode="bfd", **kw),
    "window": lambda c, **kw: SlidingWindowDataset(c, 700, 6, seed=3, **kw),
    "window-mask": lambda c, **kw: SlidingWindowDataset(c, 700, 6, seed=3, document_mask=True, **kw),
}


def rank_digests(ds, num_workers: int, take: int | None = None) -> list[str]:
    """Digests of what one rank's dataset yields through a StatefulDataLoader (in-process for
    ``num_workers=1``), optionally only the first ``take``."""
    loader = ds if num_workers == 1 else StatefulDataLoader(ds, batch_size=None, num_workers=num_workers)
    out = []
    for b in loader:
        out.append(batch_digest(b))
        if take is not None and len(out) == take:
            break
    return out


def shape_sequence(make, manifest, world_size: int, num_workers: int, **kw) -> tuple[list[str], list[int]]:
    """(global sequence as the ranks consume it, per-rank counts), every rank run in turn."""
    per_rank, lens = [], []
    for r in range(world_size):
        ds = make(open_corpus(manifest, "train"), rank=r, world_size=world_size, **kw)
        lens.append(len(ds))
        per_rank.append(rank_digests(ds, num_workers))
    counts = [len(p) for p in per_rank]
    assert counts == lens, f"ranks yielded {counts}, len() said {lens}"
    return interleave_ranks(per_rank), counts


def assert_shapes_agree(make, manifest) -> None:
    ref, _ = shape_sequence(make, manifest, 1, 1)
    M = len(ref)
    assert M > 8
    for W, K in SHAPES[1:]:
        got, counts = shape_sequence(make, manifest, W, K)
        assert len(set(counts)) == 1, f"{W}x{K}: unequal counts per rank {counts}"
        assert counts[0] == -(-M // W), f"{W}x{K}: {counts[0]} per rank for {M} microbatches"
        assert got == [ref[i % M] for i in range(len(got))], f"{W}x{K}: another global sequence"


@pytest.mark.parametrize("loader", list(STDLIB_LOADERS))
def test_cluster_shapes_give_one_global_sequence_stdlib(stdlib_manifest, loader):
    """Stdlib byte ids (no ../shared needed): every shape yields the single process's sequence,
    the last step completed by wrapping to its start; every rank the same count, = len()."""
    assert_shapes_agree(STDLIB_LOADERS[loader], stdlib_manifest)


@pytest.mark.parametrize("loader", list(DEV_LOADERS))
def test_cluster_shapes_give_one_global_sequence_dev(dev_manifest, loader):
    """The dev corpus at 4,096 x 35: 1x1, 1x2, 2x1, 2x2, 4x1 yield the identical global sequence."""
    assert_shapes_agree(DEV_LOADERS[loader], dev_manifest)


def run_2x2_then_resume(make, manifest, steps: int):
    """Run 2 ranks x 2 workers for ``steps`` steps, keep each rank's StatefulDataLoader state."""
    states, seen = [], []
    for r in range(2):
        ds = make(open_corpus(manifest, "train"), rank=r, world_size=2)
        dl = StatefulDataLoader(ds, batch_size=None, num_workers=2)
        it = iter(dl)
        seen.append([batch_digest(next(it)) for _ in range(steps)])
        states.append(dl.state_dict())
        del it, dl
    return states, interleave_ranks(seen)


@pytest.mark.parametrize("loader", list(DEV_LOADERS))
def test_resume_2x2_mid_epoch_on_4x1_and_1x1(dev_manifest, loader):
    """A 2x2 run checkpointed after 7 steps (global position 14) resumes on 4x1 and 1x1 with the
    identical next global batch and the rest of the epoch; on the same shape the DataLoader's own
    load_state_dict continues too. Every rank may load any rank's state (positions are global)."""
    make = DEV_LOADERS[loader]
    ref, _ = shape_sequence(make, dev_manifest, 1, 1)
    M = len(ref)
    states, first = run_2x2_then_resume(make, dev_manifest, 7)
    assert first == ref[:14]
    P = 14
    for W in (4, 1):
        per_rank = []
        for r in range(W):
            ds = make(open_corpus(dev_manifest, "train"), rank=r, world_size=W)
            ds.load_state_dict(states[r % 2])  # a whole StatefulDataLoader state
            assert ds.state_dict()["position"] == P
            per_rank.append(rank_digests(ds, 1))
        got = interleave_ranks(per_rank)
        assert got[:W] == ref[P : P + W], f"{W}x1 does not continue with the next global batch"
        assert got == [ref[i % M] for i in range(P, P + len(got))] and P + len(got) >= M
    ds = make(open_corpus(dev_manifest, "train"), rank=1, world_size=2)
    dl = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    dl.load_state_dict(states[1])
    assert rank_digests_from(dl, 3) == [ref[P + 1], ref[P + 3], ref[P + 5]]


def rank_digests_from(loader, n: int) -> list[str]:
    it = iter(loader)
    return [batch_digest(next(it)) for _ in range(n)]


def pairs_of(batches, corpus) -> np.ndarray:
    """How often each global input position (one next-token pair each) appears in best-fit
    batches, from their segment tables."""
    offs = corpus.doc_offsets
    pos = [np.arange(offs[d] + s, offs[d] + s + n) for b in batches for d, s, n in b.segments.tolist()]
    return np.bincount(np.concatenate(pos), minlength=corpus.num_tokens) if pos else np.zeros(corpus.num_tokens, int)


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_pair_once_per_epoch_and_the_remainder_rule(stdlib_manifest, drop_last):
    """The global sequence holds every next-token pair of every document exactly once. On 5 ranks
    the remainder rule's effect is exact: wrap-around repeats the pairs of the first (-M) % 5
    microbatches once, drop_last leaves out those of the last M % 5; nothing else changes."""
    corpus = open_corpus(stdlib_manifest, "train")
    make = lambda **kw: BestFitDataset(corpus, 512, 3, 16, seed=5, with_segments=True, drop_last=drop_last, **kw)  # noqa: E731
    one = list(make())
    M, W = len(one), 5
    expected = np.ones(corpus.num_tokens, dtype=np.int64)  # every position but a document's last starts a pair
    expected[corpus.doc_offsets[1:] - 1] = 0
    assert np.array_equal(pairs_of(one, corpus), expected), "the global sequence is not every pair exactly once"
    assert M % W, "pick settings whose epoch leaves a remainder"
    per_rank = [list(make(rank=r, world_size=W)) for r in range(W)]
    assert len({len(p) for p in per_rank}) == 1
    got = pairs_of([b for p in per_rank for b in p], corpus)
    if drop_last:
        want = expected - pairs_of(one[M - M % W :], corpus)
    else:
        want = expected + pairs_of(one[: (-M) % W], corpus)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("batch_size", [35, 4])
def test_long_documents_are_spread_over_the_epoch(dev_manifest, batch_size):
    """A long document's chunks enter the stream independently: on the dev corpus (longest
    document 555,661 tokens, 136 chunks) no two consecutive microbatches are mostly one document,
    for 35 and 4 packs per microbatch. The measure fails for the layout it replaces (documents
    shuffled, chunks back to back, the same buffer packer): 4 and 34 consecutive microbatches."""
    corpus = open_corpus(dev_manifest, "train")
    for mode in ("buffer", "bfd"):
        segs = [b.segments for b in BestFitDataset(corpus, 4096, batch_size, mode=mode, with_segments=True)]
        run, top = majority_document_run(segs)
        assert run <= (0 if batch_size == 35 else 2), f"{mode}: {run} consecutive microbatches mostly one document"
        assert top <= (0.25 if batch_size == 35 else 1.0)
    L = corpus.doc_lengths()
    order = np.random.default_rng([0, 0]).permutation(L.size)
    chunks = [(int(order[k]), s, n) for k, s, n in naive_chunks([int(L[d]) for d in order], 4096)]
    packs = naive_buffer_packs([n for _, _, n in chunks], 4096, 64)
    old = [
        np.array([chunks[i] for p in packs[m : m + batch_size] for i in p]) for m in range(0, len(packs), batch_size)
    ]
    assert majority_document_run(old)[0] >= (4 if batch_size == 35 else 30)


def test_fill_targets_on_the_dev_corpus(dev_manifest):
    """Pack fill of the global sequence: >= 0.998 at buffer 64, >= 0.9995 with BFD; the dataset
    yields exactly the planned packs."""
    corpus = open_corpus(dev_manifest, "train")
    buf = pack_fill(corpus.doc_lengths(), 4096, 35, 64, seed=0, mode="buffer")
    bfd = pack_fill(corpus.doc_lengths(), 4096, 35, seed=0, mode="bfd")
    assert buf.fill >= 0.998 and bfd.fill >= 0.9995, (buf.fill, bfd.fill)
    got = [b.pack_lengths.numpy() for b in BestFitDataset(corpus, 4096, 35, 64, seed=0)]
    assert np.array_equal(np.concatenate(got), np.rint(buf.pack_fill * 4096).astype(np.int64))


@pytest.mark.parametrize("loader", list(STDLIB_LOADERS))
def test_seek_starts_at_a_global_position_without_reading_skipped_batches(stdlib_manifest, loader, monkeypatch):
    """seek(N) on rank r of 2 yields microbatch N + r first; only yielded microbatches are read."""
    make = STDLIB_LOADERS[loader]
    corpus = open_corpus(stdlib_manifest, "train")
    ref = [batch_digest(b) for b in make(corpus)]
    N = len(ref) // 2
    reads = []
    if loader.startswith("bestfit"):
        # reaches inside: counting reads needs the one private method every batch passes through
        real = bestfit._SegmentReads.batch
        monkeypatch.setattr(bestfit._SegmentReads, "batch", lambda self, mb: reads.append(1) or real(self, mb))
    else:  # a batch copied from the memory maps, or read through HDF5 (gathered); reaches inside for the same reason
        real_w, real_rows = window._WindowReads.gathered, VarlenBatch.from_window_rows
        monkeypatch.setattr(window._WindowReads, "gathered", lambda self, *a: reads.append(1) or real_w(self, *a))
        monkeypatch.setattr(
            VarlenBatch, "from_window_rows", classmethod(lambda cls, *a, **k: reads.append(1) or real_rows(*a, **k))
        )
    for r in range(2):
        ds = make(corpus, rank=r, world_size=2)
        ds.seek(N)
        got = [batch_digest(b) for b in ds]
        assert got[0] == ref[N + r] and got == [ref[i % len(ref)] for i in range(N + r, N + r + 2 * len(got), 2)]
    assert len(reads) == 2 * -(-(len(ref) - N) // 2)
    with pytest.raises(ValueError, match="position"):
        make(corpus).seek(len(ref) + 1)


@pytest.mark.parametrize("loader", list(STDLIB_LOADERS))
def test_state_is_small_constant_and_restores_the_epoch(stdlib_manifest, dev_manifest, loader, tmp_path):
    """The state has the same few fields on a 2,000-document and a 10,000-document corpus (under
    1 KB pickled), loads with torch.load(weights_only=True), and restores the epoch."""
    make = STDLIB_LOADERS[loader]
    sizes = []
    for m in (stdlib_manifest, dev_manifest):
        ds = make(open_corpus(m, "train"), epoch=3)
        it = iter(ds)
        next(it)
        st = ds.state_dict()
        sizes.append(len(pickle.dumps(st)))
        torch.save({"loader": st}, tmp_path / "ckpt.pt")
        back = torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"]
        fresh = make(open_corpus(m, "train"))
        fresh.load_state_dict(back)
        assert fresh.epoch == 3 and batch_digest(next(iter(fresh))) == batch_digest(next(it))
    assert max(sizes) < 1024 and abs(sizes[0] - sizes[1]) < 16, sizes


def test_len_and_set_epoch(stdlib_manifest):
    """len() is this rank's count for the current epoch (it changes with the epoch when packing
    does) and equals what iteration yields; set_epoch changes the sequence."""
    corpus = open_corpus(stdlib_manifest, "train")
    ds = BestFitDataset(corpus, 512, 4, seed=1, rank=1, world_size=3)
    for e in (0, 1, 2):
        ds.set_epoch(e)
        assert len(ds) == sum(1 for _ in ds) == -(-ds.num_microbatches() // 3)
    a, b = BestFitDataset(corpus, 512, 4, seed=1), BestFitDataset(corpus, 512, 4, seed=1)
    b.set_epoch(1)
    assert batch_digest(next(iter(a))) != batch_digest(next(iter(b)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(torch.utils.data.DataLoader(ds, batch_size=None)) == len(ds)
