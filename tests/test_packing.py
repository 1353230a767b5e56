"""Best-fit packing: chunking keeps every next-token pair exactly once, packers are exact best fit,
the global plan follows its documented rules, batches are padding-free and isolated per segment,
and the loader state resumes bit-identically.

Oracles are the rules of docs/PACKING.md written as plain loops (tests/helpers.py), never the
implementation's own functions."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from h5corpus import BestFitDataset, open_corpus, split_tokens
from h5corpus.loaders.batch import concat_batches
from h5corpus.loaders.chunking import ChunkTable, document_chunks
from h5corpus.loaders.epochplan import epoch_order, pack_fill
from h5corpus.loaders.packers import BufferPacker, best_fit_packs, bfd_packs, shuffled_bfd_block
from h5corpus.storage.format import TokenizerIdentity
from h5corpus.storage.manifest import Manifest, write_manifest
from h5corpus.storage.writer import ShardWriter
from tests.helpers import (
    BYTE_IDENTITY,
    batches_equal,
    interleave_ranks,
    naive_bfd_packs,
    naive_buffer_packs,
    naive_chunks,
    oracle_stream,
    owned,
)

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def tiny_corpus(
    root: Path,
    docs: list[list[int]],
    truncated: set[int] = frozenset(),
    identity: TokenizerIdentity = BYTE_IDENTITY,
    per_shard: int = 1000,
) -> Path:
    """Write ``docs`` (token lists, EOS already in place unless truncated) as a train split."""
    mpath = root / "manifests" / "shards.json"
    m = Manifest(tokenizer=identity, dtype="uint16", chunk_tokens=64)
    for s in range(0, len(docs), per_shard):
        w = ShardWriter(
            root / "shards" / f"train-{s // per_shard:05d}.h5", split="train", tokenizer=identity, chunk_tokens=64
        )
        for i in range(s, min(s + per_shard, len(docs))):
            w.add_document(
                np.asarray(docs[i], dtype=np.int64), hashlib.sha256(str(i).encode()).digest(), truncated=i in truncated
            )
        m.shards.append(w.close().relative_to(mpath.parent))
    m.splits["train"] = {"documents": len(docs), "tokens": sum(len(d) for d in docs)}
    write_manifest(mpath, m)
    return mpath


def assert_epoch_exact(corpus, outputs, max_seq_len: int, batch_size: int) -> None:
    """Every (input, target) pair of every document appears exactly once, each batch's tokens are
    the document's tokens at the positions its segments claim, and each segment is a whole document
    or one of its chunks (never cut to fill space)."""
    tokens = corpus.tokens(0, corpus.num_tokens).astype(np.int64)
    offs, lens = corpus.doc_offsets, corpus.doc_lengths()
    seen = []
    for b in outputs:
        b.check()
        assert b.segments is not None and b.segments.dtype == torch.int64 and b.segments.shape == (b.num_segments, 3)
        doc, start, n = b.segments.numpy().T
        cu = b.cu_seqlens.numpy().astype(np.int64)
        assert np.array_equal(np.diff(cu), n), "segment table disagrees with cu_seqlens"
        assert 1 <= b.num_packs <= batch_size and int(b.pack_lengths.max()) <= max_seq_len
        assert b.max_seqlen <= max_seq_len
        pairs = lens[doc] - 1
        assert np.all(start % max_seq_len == 0) and np.array_equal(n, np.minimum(pairs - start, max_seq_len)), (
            "a segment is neither a whole document nor one of its max_seq_len chunks"
        )
        g = np.repeat(offs[doc] + start - cu[:-1], n) + np.arange(cu[-1])
        assert np.array_equal(b.input_ids.numpy(), tokens[g]), "inputs are not the document's tokens"
        assert np.array_equal(b.targets.numpy(), tokens[g + 1]), "targets are not the next tokens"
        seen.append(g)
    expected = np.ones(corpus.num_tokens, dtype=np.int64)  # every position but a document's last starts a pair
    expected[offs[1:][lens > 0] - 1] = 0
    count = np.bincount(np.concatenate(seen), minlength=corpus.num_tokens) if seen else np.zeros_like(expected)
    assert int(count.sum()) == int(expected.sum()), (
        f"{int(count.sum()):,} pairs seen, the epoch has {int(expected.sum()):,}"
    )
    bad = np.flatnonzero(count != expected)
    assert bad.size == 0, f"pair at global position {int(bad[0]):,} seen {int(count[bad[0]])} times"


def run_consumers(manifest: Path, *, world_size: int, num_workers: int, **kw) -> list:
    """The epoch's global sequence (with ``segments``) as all ranks (simulated in turn) and their
    DataLoader workers yield it, ranks interleaved step by step, cut to the epoch's M microbatches
    (the last step's wrap-around repeats are left out): the segment tables cross the worker
    processes with their batches."""
    per_rank = []
    for rank in range(world_size):
        ds = BestFitDataset(open_corpus(manifest, "train"), rank=rank, world_size=world_size, with_segments=True, **kw)
        per_rank.append([owned(b) for b in StatefulDataLoader(ds, batch_size=None, num_workers=num_workers)])
    assert len({len(p) for p in per_rank}) == 1, "ranks yielded different counts"
    return interleave_ranks(per_rank)[: ds.num_microbatches()]


# --------------------------------------------------------------------------------------------
# chunking
# --------------------------------------------------------------------------------------------
def test_split_tokens_worked_example_keeps_every_pair_with_lookahead():
    """docs/PACKING.md's 6-token document at limit 4: inputs [4, 1], every pair exactly once, the
    first chunk's last target (15) is the second chunk's input, positions restart at 0."""
    tokens = [11, 12, 13, 14, 15, 99]
    chunks = list(split_tokens("example", tokens, max_seq_len=4))
    assert [len(c.inputs) for c in chunks] == [4, 1]
    assert [t for c in chunks for t in c.inputs] == tokens[:-1]
    assert [t for c in chunks for t in c.targets] == tokens[1:]
    assert chunks[0].targets[-1] == 15 and chunks[1].inputs.tolist() == [15] and chunks[1].targets.tolist() == [99]
    assert [c.position_ids.tolist() for c in chunks] == [[0, 1, 2, 3], [0]]
    assert all(c.doc == "example" for c in chunks)
    assert [len(c.inputs) for c in split_tokens(tokens, max_seq_len=4)] == [4, 1]


@pytest.mark.parametrize(
    "n_tokens, expected",
    [
        pytest.param(9000 + 1, [4096, 4096, 808], id="9000-text-tokens+EOS"),
        pytest.param(8991, [4096, 4096, 798], id="8991-tokens-with-EOS"),
        pytest.param(4097, [4096], id="exactly-4096-pairs"),
        pytest.param(4098, [4096, 1], id="4097-pairs"),
    ],
)
def test_split_tokens_long_documents_of_the_docs_table(n_tokens, expected):
    """Long documents split into consecutive 4,096-input chunks; pairs = tokens - 1, none lost."""
    doc = np.arange(n_tokens) % 50000
    doc[-1] = 50256
    chunks = split_tokens(doc, max_seq_len=4096)
    assert [len(c.inputs) for c in chunks] == expected
    assert np.array_equal(np.concatenate([c.inputs for c in chunks]), doc[:-1])
    assert np.array_equal(np.concatenate([c.targets for c in chunks]), doc[1:])
    assert [c.start for c in chunks] == [4096 * i for i in range(len(expected))]


def test_chunk_table_is_document_chunks():
    """The plan's compact chunk table (corpus order) holds exactly document_chunks's chunks."""
    rng = np.random.default_rng(3)
    for L in (1, 5, 64):
        lengths = np.concatenate([[0, 1, 2, L, L + 1, 3 * L + 2], rng.integers(0, 6 * L, 300)])
        t = ChunkTable.build(lengths, L)
        doc, start, n = document_chunks(lengths, L)
        ids = np.arange(t.num_chunks)
        assert np.array_equal(t.doc, doc) and np.array_equal(t.length, n) and np.array_equal(t.starts(ids), start)
        assert t.doc.dtype == np.int32 and t.length.dtype == np.int32 and t.first[-1] == t.num_chunks


def test_document_chunks_and_split_tokens_follow_the_documented_rule():
    """document_chunks equals the rule of docs/PACKING.md written as a loop (tests.helpers.naive_chunks),
    documents of 0 or 1 tokens yielding none; split_tokens cuts each document's own tokens at those
    chunks: inputs = tokens[start : start + n], targets one token ahead, positions 0 .. n-1."""
    rng = np.random.default_rng(0)
    for L in (1, 2, 7, 64):
        lengths = np.concatenate([[0, 1, 2, L, L + 1, L + 2, 2 * L + 1], rng.integers(0, 5 * L, 200)])
        doc, start, n = document_chunks(lengths, L)
        want = naive_chunks(lengths.tolist(), L)
        assert list(zip(doc.tolist(), start.tolist(), n.tolist())) == want
        assert 0 not in doc.tolist() and 1 not in doc.tolist()
        for d in (2, 3, 5, 6, *range(7, 40)):
            tokens = rng.integers(0, 50_000, int(lengths[d]))
            got = split_tokens(d, tokens, max_seq_len=L)
            assert [(c.doc, c.start, len(c.inputs)) for c in got] == [w for w in want if w[0] == d]
            for c in got:
                k = len(c.inputs)
                assert c.inputs.tolist() == tokens[c.start : c.start + k].tolist()
                assert c.targets.tolist() == tokens[c.start + 1 : c.start + k + 1].tolist()
                assert c.position_ids.tolist() == list(range(k))


def test_truncated_and_single_token_documents_in_a_corpus(tmp_path):
    """A document flagged truncated (no EOS) still yields all its N-1 pairs; a 1-token document
    (EOS only) yields none and is counted as skipped."""
    eos = BYTE_IDENTITY.eos_id
    docs = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [eos], [20, 21, 22, eos], list(range(30, 49)) + [eos]]
    m = tiny_corpus(tmp_path, docs, truncated={0})
    corpus = open_corpus(m, "train")
    ds = BestFitDataset(corpus, max_seq_len=4, batch_size=3, seed=1, with_segments=True)
    out = list(ds)
    assert_epoch_exact(corpus, out, 4, 3)
    assert ds.skipped_documents == 1
    segs = np.concatenate([b.segments.numpy() for b in out])
    assert sorted(segs[segs[:, 0] == 0, 2].tolist()) == [1, 4, 4]  # 9 pairs of the truncated document
    assert 1 not in segs[:, 0].tolist()


# --------------------------------------------------------------------------------------------
# packers
# --------------------------------------------------------------------------------------------
def test_best_fit_worked_example_packs():
    """Capacity 8: A6 B4 C3 D2 -> packs [A, D] (8 tokens) and [B, C] (7 tokens), for both modes."""
    assert best_fit_packs([6, 4, 3, 2], capacity=8, packing_buffer=64) == [[0, 3], [1, 2]]
    assert sorted(sorted(p) for p in bfd_packs([6, 4, 3, 2], capacity=8)) == [[0, 3], [1, 2]]


def test_best_fit_worked_example_batch(tmp_path):
    """docs/PACKING.md's batch: segments A, D, B, C with input lengths 6, 2, 4, 3 flattened into 15 rows,
    cu_seqlens [0, 6, 8, 12, 15], pack lengths [8, 7]; the unused slot is not materialized."""
    eos = BYTE_IDENTITY.eos_id
    A, B, C, D = ([base + i for i in range(n)] + [eos] for base, n in ((10, 6), (40, 4), (70, 3), (100, 2)))
    corpus = open_corpus(tiny_corpus(tmp_path, [A, B, C, D]), "train")
    (batch,) = list(BestFitDataset(corpus, max_seq_len=8, batch_size=2, shuffle=False))
    batch.check()
    assert batch.cu_seqlens.tolist() == [0, 6, 8, 12, 15] and batch.cu_seqlens.dtype == torch.int32
    assert batch.pack_lengths.tolist() == [8, 7] and batch.max_seqlen == 6
    assert batch.input_ids.tolist() == A[:-1] + D[:-1] + B[:-1] + C[:-1]
    assert batch.targets.tolist() == A[1:] + D[1:] + B[1:] + C[1:]
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 0, 1, 2, 3, 0, 1, 2]
    assert batch.num_tokens == 15 < 2 * 8


def naive_bfd_loads(lengths, capacity):
    """Pack loads of best-fit-decreasing without its tie rule (equal rooms are interchangeable)."""
    rooms = []
    for n in sorted(lengths, reverse=True):
        fit = [j for j, r in enumerate(rooms) if r >= n]
        if fit:
            j = min(fit, key=lambda j: rooms[j])
            rooms[j] -= n
        else:
            rooms.append(capacity - n)
    return sorted(capacity - r for r in rooms)


@pytest.mark.parametrize("capacity", [8, 64, 100])
@pytest.mark.parametrize("buffer_size", [1, 3, 16, 1000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_buffer_packer_equals_naive_best_fit(capacity, buffer_size, seed):
    """The bisection packer makes exactly the picks of a naive scan of the buffer: the longest
    fitting chunk, the oldest among equals, buffer topped up before every pick."""
    lengths = np.random.default_rng(seed).integers(1, capacity + 1, 300).tolist()
    assert best_fit_packs(lengths, capacity, buffer_size) == naive_buffer_packs(lengths, capacity, buffer_size)


@pytest.mark.parametrize("capacity", [8, 64, 4096])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bfd_equals_naive_best_fit_decreasing(capacity, seed):
    """BFD places every chunk once, never over capacity, and reaches exactly the pack loads of a
    naive best-fit-decreasing scan (ties between equal rooms are interchangeable)."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(1, capacity + 1, 200), rng.integers(1, max(capacity // 8, 2), 300)])
    packs = bfd_packs(lengths, capacity)
    assert sorted(i for p in packs for i in p) == list(range(lengths.size))
    loads = [int(lengths[p].sum()) for p in packs]
    assert max(loads) <= capacity
    assert sorted(loads) == naive_bfd_loads(lengths.tolist(), capacity)


@pytest.mark.parametrize("capacity", [8, 64, 4096])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bfd_equals_naive_pack_for_pack(capacity, seed):
    """BFD makes exactly the packs (and placement order) of the naive statement, tie rule
    included, so the plan is a pure function of the lengths."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(1, capacity + 1, 150), rng.integers(1, max(capacity // 8, 2), 250)])
    assert bfd_packs(lengths, capacity) == naive_bfd_packs(lengths.tolist(), capacity)


@pytest.mark.parametrize("buffer_size", [1, 5, 64])
def test_buffer_packer_bulk_packs_and_state_equal_the_stated_algorithm(buffer_size):
    """Packing many packs per call gives the packs of one-at-a-time packing, and after every pack
    the packer's cursor and buffer are those of the algorithm as stated (top-up before every pick),
    including packs that end exactly full."""
    rng = np.random.default_rng(buffer_size)
    lengths = np.concatenate([rng.integers(1, 65, 400), np.full(30, 64), rng.integers(1, 9, 100)])
    rng.shuffle(lengths)
    one = BufferPacker(lengths, 64, buffer_size)
    singles, states = [], []
    while pack := one.next_pack():
        singles.append(pack)
        states.append((one.cursor, one.buffer))
    want_states: list = []
    assert singles == naive_buffer_packs(lengths.tolist(), 64, buffer_size, want_states)
    assert states == want_states
    assert any(int(lengths[p].sum()) == 64 for p in singles)  # exactly full packs were exercised
    bulk = BufferPacker(lengths, 64, buffer_size)
    packs = []
    for count in (7, 1, 10**6):
        idx, n, ends = bulk.packs(count)
        assert n.tolist() == lengths[idx].tolist()
        packs += [idx[a:b].tolist() for a, b in zip([0, *ends[:-1]], ends)]
    assert packs == singles


@pytest.mark.parametrize("case", ["rebased", "widened"])
def test_buffer_packer_key_encoding_across_blocks(case):
    """Keys are re-based at every block of 2,048 arrivals (narrow 30-bit keys) and switch to wide
    32-bit ages when a chunk has waited longer than the narrow age field holds; both give the packs
    and states of the stated algorithm. ``mark`` = (0, base, age bits) shows which happened."""
    rng = np.random.default_rng(5)
    if case == "rebased":
        capacity, buffer_size = 64, 7
        lengths = rng.integers(1, 65, 9000)
    else:  # a 1-token chunk never fits beside full chunks: it waits for the drain, 9,000 arrivals
        capacity, buffer_size = 1 << 16, 4  # 13 age bits: a chunk may wait 8,191 arrivals
        lengths = np.full(9000, capacity)
        lengths[3] = 1
    p = BufferPacker(lengths, capacity, buffer_size)
    packs, states = [], []
    while pack := p.next_pack():
        packs.append(pack)
        states.append((p.cursor, p.buffer))
    _, base, age_bits = p.mark
    if case == "rebased":
        assert age_bits == 30 - capacity.bit_length() and base > 0
    else:
        assert age_bits == 32
    want_states: list = []
    assert packs == naive_buffer_packs(lengths.tolist(), capacity, buffer_size, want_states)
    assert states == want_states


def test_shuffled_bfd_block_puts_bfd_packs_in_the_drawn_order():
    """A BFD block's packs in the order of ``rng.permutation(packs)`` (one draw): position j holds
    best-fit-decreasing's pack perm[j], its chunks in placement order."""
    lengths = np.random.default_rng(1).integers(1, 100, 500)
    chunks, sizes = shuffled_bfd_block(lengths, 100, np.random.default_rng(42))
    got = [chunks[a:b].tolist() for a, b in zip(np.cumsum(sizes) - sizes, np.cumsum(sizes))]
    packs = naive_bfd_packs(lengths.tolist(), 100)
    perm = np.random.default_rng(42).permutation(len(packs))
    assert got == [packs[j] for j in perm.tolist()]
    assert got != packs


def test_packers_refuse_oversized_chunks():
    """A chunk longer than the capacity is an error naming it, never a silent cut."""
    with pytest.raises(ValueError, match="chunk 1 has 9 tokens"):
        bfd_packs([3, 9], 8)
    with pytest.raises(ValueError, match="chunk 1 has 9 tokens"):
        BufferPacker(np.array([3, 9]), 8, 4)


def test_pack_fill_accounts_every_token(stdlib_manifest):
    """pack_fill simulates the dataset's own plan: packs, microbatches and real tokens match an
    actual epoch; fill = real / capacity; charging the last partial microbatch lowers it."""
    corpus = open_corpus(stdlib_manifest, "train")
    for mode in ("buffer", "bfd"):
        st = pack_fill(corpus.doc_lengths(), max_seq_len=512, batch_size=7, packing_buffer=64, seed=5, mode=mode)
        batches = list(BestFitDataset(corpus, 512, 7, 64, seed=5, mode=mode))
        assert st.microbatches == len(batches) and st.packs == sum(b.num_packs for b in batches)
        assert st.real_tokens == sum(b.num_tokens for b in batches) == int((corpus.doc_lengths() - 1).sum())
        assert np.allclose(st.pack_fill * 512, np.concatenate([b.pack_lengths.numpy() for b in batches]))
        assert st.fill == pytest.approx(st.real_tokens / (st.packs * 512))
        assert st.fill_padded_last <= st.fill and 0 < st.fill <= 1


# --------------------------------------------------------------------------------------------
# the dataset
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["buffer", "bfd"])
def test_every_pair_once_across_two_ranks_and_two_workers_stdlib(stdlib_manifest, mode):
    """2 ranks x 2 DataLoader workers: every pair of every document exactly once per epoch, tokens
    equal the documents', batches padding-free and within capacity."""
    out = run_consumers(
        stdlib_manifest,
        world_size=2,
        num_workers=2,
        max_seq_len=1024,
        batch_size=16,
        packing_buffer=64 if mode == "buffer" else 500,
        seed=11,
        mode=mode,
    )
    assert_epoch_exact(open_corpus(stdlib_manifest, "train"), out, 1024, 16)


def test_ranks_get_disjoint_microbatches_of_one_global_sequence(stdlib_manifest):
    """4 ranks: rank r yields microbatches r, r + 4, ... of the single process's sequence; with
    drop_last their shares are disjoint and together all but the incomplete last step."""
    corpus = open_corpus(stdlib_manifest, "train")
    one = list(BestFitDataset(corpus, 512, 4, seed=2, with_segments=True))
    M = len(one)
    for r in range(4):
        mine = list(BestFitDataset(corpus, 512, 4, seed=2, rank=r, world_size=4, drop_last=True, with_segments=True))
        assert len(mine) == M // 4
        assert all(batches_equal(x, one[r + 4 * i]) for i, x in enumerate(mine))


def test_dev_corpus_every_pair_once_across_two_ranks_and_two_workers(dev_manifest):
    """Real GPT-2 shards of the dev corpus at 4,096 / 35 packs: every pair of every document
    exactly once per epoch over 2 ranks x 2 workers; batches match the documents."""
    out = run_consumers(dev_manifest, world_size=2, num_workers=2, seed=0)
    assert len(out) == BestFitDataset(open_corpus(dev_manifest, "train")).num_microbatches()
    corpus = open_corpus(dev_manifest, "train")
    assert_epoch_exact(corpus, out, 4096, 35)
    fill = sum(b.num_tokens for b in out) / (sum(b.num_packs for b in out) * 4096)
    assert fill > 0.99, f"pack fill {fill:.4f}"


def test_dev_corpus_bfd_every_pair_once(dev_manifest):
    """BFD mode on the dev corpus: exact epoch, and fill at least the bounded buffer's."""
    corpus = open_corpus(dev_manifest, "train")
    out = list(BestFitDataset(corpus, mode="bfd", with_segments=True))
    assert_epoch_exact(corpus, out, 4096, 35)
    real = sum(b.num_tokens for b in out)
    bfd_fill = real / (sum(b.num_packs for b in out) * 4096)
    assert bfd_fill >= pack_fill(corpus.doc_lengths(), mode="buffer").fill


def reference_chunks(doc_lengths, *, max_seq_len, seed, epoch) -> list:
    """The epoch's chunk stream by the rules of docs/PACKING.md: every document's chunks in corpus
    order (:func:`tests.helpers.naive_chunks`), then in the order
    ``default_rng([seed, epoch]).permutation(chunks)``. Returns ``(document, start, inputs)`` per chunk."""
    chunks = naive_chunks([int(n) for n in doc_lengths], max_seq_len)
    return [chunks[i] for i in np.random.default_rng([seed, epoch]).permutation(len(chunks)).tolist()]


def yielded_packs(batches, chunk_index: dict) -> list[list[int]]:
    """Every yielded pack, in order, as reference chunk indices (from ``batch.segments`` and
    ``pack_lengths``: a pack ends where the cumulative pack lengths meet the segments')."""
    out = []
    for b in batches:
        segs = b.segments.numpy()
        ids = [chunk_index[(d, s)] for d, s, _ in segs.tolist()]
        seg_ends, pack_ends = np.cumsum(segs[:, 2]), np.cumsum(b.pack_lengths.numpy())
        assert np.isin(pack_ends, seg_ends).all(), "a pack ends inside a segment"
        ends = (np.searchsorted(seg_ends, pack_ends) + 1).tolist()
        out += [ids[a:z] for a, z in zip([0, *ends[:-1]], ends)]
    return out


def reference_batch(toks: np.ndarray, offs: np.ndarray, chunks: list, packs: list[list[int]]) -> dict:
    """The fields of one microbatch of ``packs`` (reference chunk indices), tokens read per
    segment from the h5py stream: inputs doc[start : start + n], targets one token ahead."""
    segs = [chunks[i] for p in packs for i in p]
    rows = [toks[offs[d] + s : offs[d] + s + n + 1].astype(np.int64) for d, s, n in segs]
    return {
        "input_ids": np.concatenate([r[:-1] for r in rows]),
        "targets": np.concatenate([r[1:] for r in rows]),
        "position_ids": np.concatenate([np.arange(n) for _, _, n in segs]),
        "cu_seqlens": np.cumsum([0] + [n for _, _, n in segs]),
        "pack_lengths": [sum(chunks[i][2] for i in p) for p in packs],
        "max_seqlen": max(n for _, _, n in segs),
        "segments": np.array(segs, dtype=np.int64),
    }


def assert_equals_reference(manifest, **kw):
    """Every microbatch one rank yields equals a straightforward statement of the documented
    algorithm (:func:`reference_chunks`, the naive packers of tests/helpers.py, ``batch_size``
    consecutive packs per microbatch, rank ``r`` of ``W`` taking microbatches ``r, r + W, ...``
    with the last step wrapped to the epoch's start, tokens from an independent h5py read).

    BFD's packs of each block come in an order drawn from a seeded generator; the reference takes
    that order from the dataset, after checking that it is a permutation of the block's naive BFD
    packs (and not the identity for every block). Its seeding is covered by the determinism tests."""
    rank, world_size = kw.pop("rank", 0), kw.pop("world_size", 1)
    L, B, buf = kw["max_seq_len"], kw["batch_size"], kw["packing_buffer"]
    corpus = open_corpus(manifest, "train")
    got = list(BestFitDataset(corpus, **kw, rank=rank, world_size=world_size, with_segments=True))
    toks, offs, _ = oracle_stream(manifest)
    chunks = reference_chunks(np.diff(offs), max_seq_len=L, seed=kw["seed"], epoch=kw.get("epoch", 0))
    lens = [n for _, _, n in chunks]
    if kw["mode"] == "buffer":
        packs = naive_buffer_packs(lens, L, buf)
    else:  # the order of each block's packs is the dataset's (checked to be a permutation)
        whole = list(BestFitDataset(corpus, **kw, with_segments=True))
        drawn = yielded_packs(whole, {(d, s): i for i, (d, s, _) in enumerate(chunks)})
        at = shuffled = 0
        for lo in range(0, len(lens), buf):
            block = [[lo + i for i in p] for p in naive_bfd_packs(lens[lo : lo + buf], L)]
            mine = drawn[at : at + len(block)]
            assert sorted(mine) == sorted(block), f"the block at chunk {lo:,} holds other packs"
            shuffled += mine != block
            at += len(block)
        assert at == len(drawn) and shuffled > 0
        packs = drawn
    groups = [packs[m : m + B] for m in range(0, len(packs), B)]
    M = len(groups)
    mine = [groups[i % M] for i in range(rank, -(-M // world_size) * world_size, world_size)]
    assert len(got) == len(mine)
    for k, (b, mb) in enumerate(zip(got, mine)):
        r = reference_batch(toks, offs, chunks, mb)
        assert np.array_equal(b.segments.numpy(), r["segments"]), f"microbatch {k}: other segments"
        for f in ("input_ids", "targets", "position_ids", "cu_seqlens", "pack_lengths"):
            assert np.array_equal(getattr(b, f).numpy(), r[f]), f"microbatch {k}: {f} differs"
        assert b.max_seqlen == r["max_seqlen"]
        b.check()


def crossing_chunks(corpus, max_seq_len) -> int:
    """Chunks whose tokens cross a shard end or a gap between file-contiguous HDF5 chunk runs
    (read apart from the others)."""
    doc, start, n = document_chunks(corpus.doc_lengths(), max_seq_len)
    _, _, room = corpus.run_table().locate(np.asarray(corpus.doc_offsets, dtype=np.int64)[doc] + start)
    return int(np.count_nonzero(n + 1 > room))


@pytest.mark.parametrize("mode, packing_buffer", [("buffer", 64), ("buffer", 5), ("bfd", 300)])
def test_batches_equal_a_reference_implementation_stdlib(stdlib_manifest, mode, packing_buffer):
    """Every microbatch (segments, tokens, targets, positions, cu_seqlens, pack lengths, longest
    segment) equals a straightforward implementation of the documented algorithm, for two ranks;
    chunks that cross gaps between HDF5 chunk runs are among them."""
    corpus = open_corpus(stdlib_manifest, "train")
    assert crossing_chunks(corpus, 1024) > 0
    for rank in range(2):
        assert_equals_reference(
            stdlib_manifest,
            max_seq_len=1024,
            batch_size=6,
            packing_buffer=packing_buffer,
            seed=7,
            mode=mode,
            rank=rank,
            world_size=2,
        )


def test_batches_equal_a_reference_implementation_dev_corpus(dev_manifest):
    """Real GPT-2 shards at the benchmark's configuration (4,096 x 35, buffer 64, seed 0) and BFD
    in 512-chunk blocks: microbatches equal the straightforward reference, bit for bit."""
    corpus = open_corpus(dev_manifest, "train")
    assert crossing_chunks(corpus, 4096) > 0
    assert_equals_reference(dev_manifest, max_seq_len=4096, batch_size=35, packing_buffer=64, seed=0, mode="buffer")
    assert_equals_reference(
        dev_manifest, max_seq_len=4096, batch_size=35, packing_buffer=512, seed=3, mode="bfd", epoch=1
    )


def test_only_chunks_that_span_two_runs_leave_the_memory_map(stdlib_manifest, monkeypatch):
    """Invariant of the read path: a segment is one slice of one memory-mapped run of HDF5 chunks,
    located by its own position (also the later chunks of a long document that starts in an
    earlier run); only a chunk whose tokens really span two runs is read through Corpus.tokens."""
    corpus = open_corpus(stdlib_manifest, "train")
    table = corpus.run_table()
    doc, start, n = document_chunks(corpus.doc_lengths(), 512)
    pos = np.asarray(corpus.doc_offsets, dtype=np.int64)[doc] + start
    first_run = table.locate(pos)[0]
    last_run = table.locate(pos + n)[0]  # the run of each chunk's lookahead token
    spanning = int(np.count_nonzero(first_run != last_run))
    later_chunks_in_other_runs = int(np.count_nonzero((start > 0) & (first_run != table.locate(pos - start)[0])))
    assert spanning == crossing_chunks(corpus, 512) > 0
    assert later_chunks_in_other_runs > spanning  # the case a per-document lookup got wrong
    calls = []
    real = corpus.tokens
    monkeypatch.setattr(corpus, "tokens", lambda *a, **k: calls.append(a) or real(*a, **k))
    seen = sum(b.num_tokens for b in BestFitDataset(corpus, 512, 4, 16, shuffle=False, rank=0, world_size=1))
    assert seen == int(n.sum())
    assert len(calls) == spanning


def test_hdf5_read_path_gives_the_same_batches(stdlib_manifest):
    """Shards read through HDF5 (no memory map) give the same batches as the memory-mapped path."""
    kw = dict(max_seq_len=512, batch_size=4, seed=2, with_segments=True)
    mm = list(BestFitDataset(open_corpus(stdlib_manifest, "train", read_path="mmap"), **kw))
    h5 = list(BestFitDataset(open_corpus(stdlib_manifest, "train", read_path="h5py"), **kw))
    assert len(mm) == len(h5)
    assert all(batches_equal(a, b) and torch.equal(a.segments, b.segments) for a, b in zip(mm, h5))


def test_segments_are_none_unless_asked_and_travel_with_the_batch(stdlib_manifest):
    """``batch.segments`` is None by default; with_segments=True sets it and changes nothing else;
    it survives pickling (what DataLoader workers do), stays the same host tensor through ``.to()``, is
    copied by ``clone()`` and concatenated by ``concat_batches``."""
    corpus = open_corpus(stdlib_manifest, "train")
    plain = list(BestFitDataset(corpus, 512, 4, seed=2))[:2]
    tagged = list(BestFitDataset(corpus, 512, 4, seed=2, with_segments=True))[:2]
    assert all(b.segments is None for b in plain)
    assert all(batches_equal(a, b) for a, b in zip(plain, tagged))
    b = tagged[0]
    assert torch.equal(b.segments[:, 2].to(torch.int32), b.cu_seqlens.diff())
    back = pickle.loads(pickle.dumps(b))
    assert batches_equal(back, b) and torch.equal(back.segments, b.segments)
    assert b.to("cpu").segments is b.segments
    cl = b.clone()
    assert torch.equal(cl.segments, b.segments) and cl.segments.data_ptr() != b.segments.data_ptr()
    both = concat_batches(tagged)
    assert torch.equal(both.segments, torch.cat([t.segments for t in tagged]))
    assert concat_batches([tagged[0], plain[1]]).segments is None


def test_epoch_order_is_the_documented_permutation():
    """epoch_order shuffles an int32 arange in place: the values of default_rng([seed, epoch]).permutation."""
    for n, seed, epoch in ((0, 0, 0), (1, 3, 1), (1000, 7, 2), (100_003, 1, 9)):
        got = epoch_order(n, seed, epoch)
        assert got.dtype == np.int32 and np.array_equal(got, np.random.default_rng([seed, epoch]).permutation(n))
    assert np.array_equal(epoch_order(10, 1, 1, shuffle=False), np.arange(10))


def test_epoch_order_is_seeded_and_changes_with_set_epoch(stdlib_manifest):
    """Same (seed, epoch) -> identical batches; set_epoch or another seed -> another order."""
    corpus = open_corpus(stdlib_manifest, "train")

    def first(ds):
        return next(iter(ds))

    a = BestFitDataset(corpus, 256, 4, seed=3)
    b = BestFitDataset(corpus, 256, 4, seed=3)
    assert batches_equal(first(a), first(b))
    b.set_epoch(1)
    assert not batches_equal(first(a), first(b))
    assert not batches_equal(first(a), first(BestFitDataset(corpus, 256, 4, seed=4)))


@pytest.mark.parametrize("mode", ["buffer", "bfd"])
def test_resume_three_times_in_a_row_gives_the_identical_next_batches(stdlib_manifest, mode):
    """state_dict() after any batch, restored into a fresh dataset, continues with the identical
    next batch; chained three times, the whole epoch equals an uninterrupted one."""
    corpus = open_corpus(stdlib_manifest, "train")
    kw = dict(max_seq_len=256, batch_size=5, packing_buffer=32 if mode == "buffer" else 300, seed=9, mode=mode)
    ref = list(BestFitDataset(corpus, **kw))
    got, state = [], None
    for take in (3, 17, 1):
        ds = BestFitDataset(corpus, **kw)
        if state is not None:
            ds.load_state_dict(state)
        it = iter(ds)
        got += [next(it) for _ in range(take)]
        state = ds.state_dict()
    ds = BestFitDataset(corpus, **kw)
    ds.load_state_dict(state)
    got += list(ds)
    assert len(got) == len(ref)
    assert all(batches_equal(x, y) for x, y in zip(got, ref))


def test_state_dict_is_the_global_position(stdlib_manifest, tmp_path):
    """Mid-epoch state: the epoch, the global position and the tokens consumed (equal to the
    yielded batches' tokens), nothing per document; it survives torch.save/torch.load
    (weights_only=True), continues on another world size, and another corpus or config is refused
    naming the field."""
    corpus = open_corpus(stdlib_manifest, "train")
    ds = BestFitDataset(corpus, 256, 4, 64, seed=1)
    it = iter(ds)
    first = [next(it) for _ in range(3)]
    st = ds.state_dict()
    assert st["position"] == 3 and st["epoch"] == 0 and st["tokens"] == sum(b.num_tokens for b in first)
    assert st["source_tokens"] == [st["tokens"]] and st["writer"]["yielded"] == 3
    path = tmp_path / "ckpt.pt"
    torch.save({"loader": st}, path)
    restored = BestFitDataset(corpus, 256, 4, 64, seed=1)
    restored.load_state_dict(torch.load(path, weights_only=True)["loader"])
    nxt = next(it)
    assert batches_equal(next(iter(restored)), nxt)
    with pytest.raises(ValueError, match="settings.batch_size"):
        BestFitDataset(corpus, 256, 5, 64, seed=1).load_state_dict(st)
    other = open_corpus(stdlib_manifest, "validation")
    with pytest.raises(ValueError, match="fingerprint"):
        BestFitDataset(other, 256, 4, 64, seed=1).load_state_dict(st)
    rank1 = BestFitDataset(corpus, 256, 4, 64, seed=1, rank=1, world_size=2)
    rank1.load_state_dict(st)
    second = list(BestFitDataset(corpus, 256, 4, 64, seed=1))[4]
    assert batches_equal(next(iter(rank1)), second)  # position 3: rank 1 of 2 yields microbatch 4 next


def test_stateful_dataloader_resume_with_workers(stdlib_manifest):
    """Through torchdata's StatefulDataLoader with 2 workers, three resumes in a row continue with
    the identical batches of an uninterrupted epoch."""
    kw = dict(max_seq_len=2048, batch_size=4, packing_buffer=48, seed=4)

    def loader():
        return StatefulDataLoader(
            BestFitDataset(open_corpus(stdlib_manifest, "train"), **kw), batch_size=None, num_workers=2
        )

    ref = [owned(b) for b in loader()]
    got, state = [], None
    for take in (5, 2, 9):
        dl = loader()
        if state is not None:
            dl.load_state_dict(state)
        it = iter(dl)
        got += [owned(next(it)) for _ in range(take)]
        state = dl.state_dict()
        del it, dl
    dl = loader()
    dl.load_state_dict(state)
    got += [owned(b) for b in dl]
    assert len(got) == len(ref)
    assert all(batches_equal(x, y) for x, y in zip(got, ref))
