"""Compact VarlenBatches (what the loaders yield) mean exactly what eager ones built from the token
stream mean: every field equal, int64, passing check(), on the CPU numpy path and on the torch-op path
that runs on GPUs; they survive pickling, torch.save, spawned DataLoader workers, .to(), assignment,
concatenation; counts never materialize fields; Corpus.gather_ranges equals per-range reads."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import h5corpus.loaders.batch as hb
from h5corpus.loaders.batch import IGNORE_INDEX, BatchError, VarlenBatch, collate_varlen, concat_batches, make_batch
from h5corpus.loaders.bestfit import BestFitDataset
from h5corpus.loaders.window import SlidingWindowDataset
from h5corpus.storage.format import TokenizerIdentity
from h5corpus.storage.reader import open_corpus
from tests.helpers import (
    assert_same_batch,
    batch_digest,
    byte_encode,
    oracle_stream,
    stdlib_texts,
    subprocess_env,
    write_corpus,
)

# -- oracles ------------------------------------------------------------------------------------------


def eager_windows(toks: np.ndarray, offs: np.ndarray, starts: np.ndarray, L: int, document_mask: bool) -> VarlenBatch:
    """The eager batch of the windows at ``starts``, built per window from the stream and the
    document offsets (segments split at document starts, crossing targets ignored)."""
    ins, tgs = [], []
    for a in starts.tolist():
        w = toks[a : a + L + 1].astype(np.int64)
        if not document_mask:
            ins.append(w[:-1])
            tgs.append(w[1:])
            continue
        doc = np.searchsorted(offs, np.arange(a, a + L + 1), side="right") - 1
        tg = w[1:].copy()
        tg[doc[1:] != doc[:-1]] = IGNORE_INDEX
        cuts = [0, *(np.flatnonzero(doc[1:L] != doc[: L - 1]) + 1).tolist(), L]
        for s, e in zip(cuts[:-1], cuts[1:]):
            ins.append(w[s:e])
            tgs.append(tg[s:e])
    return make_batch(ins, tgs, [L] * starts.size)


def eager_segments(toks: np.ndarray, offs: np.ndarray, segs: np.ndarray, pack_lengths: np.ndarray) -> VarlenBatch:
    """The eager batch of packed segments ``(document, start, n)``: inputs = doc[start : start + n],
    targets = doc[start + 1 : start + n + 1]."""
    ins, tgs = [], []
    for d, s, n in segs.tolist():
        doc = toks[offs[d] : offs[d + 1]].astype(np.int64)
        ins.append(doc[s : s + n])
        tgs.append(doc[s + 1 : s + n + 1])
    return make_batch(ins, tgs, pack_lengths)


@pytest.fixture(params=["numpy", "torch_ops"])
def materialize_path(request, monkeypatch):
    """Materialize CPU batches with numpy (the CPU default) or with exactly the torch ops a CUDA
    batch runs (cast + mask widening, index_select, repeat_interleave with output_size).

    Private switches on purpose: the device path is chosen by where the buffer lives, and these two
    module flags are the only way to run it on a machine without a GPU (tests/test_gpu.py runs it
    on a real device)."""
    if request.param == "torch_ops":
        monkeypatch.setattr(hb, "_CPU_NUMPY", False)
        monkeypatch.setattr(hb, "_UNSIGNED_VIEW_DEVICES", ())
    return request.param


# -- compact == eager, stdlib (core, no ../shared) ----------------------------------------------------


@pytest.mark.parametrize("document_mask", [False, True])
@pytest.mark.parametrize("mode", ["epoch", "random"])
def test_compact_windows_equal_eager_windows_from_the_stream(stdlib_manifest, mode, document_mask, materialize_path):
    """Window-loader batches are compact (2-byte int16 rows), and their lazily materialized int64
    fields equal an eager batch built window by window from the h5py stream, with document masking
    splitting segments and ignoring exactly the cross-document targets."""
    c = open_corpus(stdlib_manifest, "train")
    toks, offs, _ = oracle_stream(stdlib_manifest)
    L, B = 700, 5
    ds = SlidingWindowDataset(c, L, batch_size=B, seed=3, mode=mode, document_mask=document_mask)
    plan = ds.plan()
    n = 0
    for i, b in zip(range(12), ds):
        assert b.is_compact and b.tokens.dtype == torch.int16 and b.tokens.numel() == b.num_rows * (L + 1)
        starts = plan[i * B : i * B + b.num_rows]
        want = eager_windows(toks, offs, starts, L, document_mask)
        assert_same_batch(b, want)
        b.check()
        n += int(b.ignore.numel())
        ign = (want.targets == IGNORE_INDEX).nonzero().flatten()
        assert torch.equal(torch.sort(b.ignore).values, ign)
    assert (n > 0) == document_mask  # the windows cross documents


@pytest.mark.parametrize("mode", ["buffer", "bfd"])
def test_compact_packs_equal_eager_segments_from_the_documents(stdlib_manifest, mode, materialize_path):
    """Best-fit microbatches are compact rows (each segment's inputs + lookahead); their fields
    equal an eager batch of the same segments cut from the documents."""
    c = open_corpus(stdlib_manifest, "train")
    toks, offs, _ = oracle_stream(stdlib_manifest)
    ds = BestFitDataset(c, max_seq_len=1500, batch_size=6, mode=mode, with_segments=True)
    for _, b in zip(range(8), ds):
        assert b.is_compact and b.num_rows == b.segments.shape[0] and b.ignore.numel() == 0
        assert_same_batch(b, eager_segments(toks, offs, b.segments.numpy(), b.pack_lengths.numpy()))
        b.check()


def test_uint32_corpus_windows_widen_to_the_original_ids(tmp_path, materialize_path):
    """A uint32 corpus (ids above 65,535) is stored as int32 bit patterns and widens to the ids."""
    ident = TokenizerIdentity(name="bytes+70000", revision="local", sha256="1" * 64, vocab_size=70_300, eos_id=70_256)
    m = write_corpus(
        tmp_path,
        stdlib_texts(30),
        lambda ts: [a + 70_000 for a in byte_encode(ts)],
        ident,
        chunk_tokens=4096,
        shard_tokens=100_000,
    )
    c = open_corpus(m, "train")
    assert c.dtype == np.uint32
    toks, offs, _ = oracle_stream(m)
    ds = SlidingWindowDataset(c, 300, batch_size=4, seed=0, document_mask=True)
    plan = ds.plan()
    for i, b in zip(range(4), ds):
        assert b.tokens.dtype == torch.int32
        assert_same_batch(b, eager_windows(toks, offs, plan[4 * i : 4 * i + b.num_rows], 300, True))


def test_from_compact_widens_unsigned_bit_patterns_and_rejects_bad_layouts(materialize_path):
    """uint16/uint32 ids at the top of their range survive the signed storage; int64 is taken as
    is; row_cu/cu_seqlens/token counts that break the layout are refused."""
    for dt, top in ((np.uint16, 65_535), (np.uint32, 2**32 - 1)):
        rows = [np.array([top, 1, top - 5, 7], dt), np.array([0, top, 3], dt)]  # 3 + 2 inputs
        b = VarlenBatch.from_compact(np.concatenate(rows), [0, 3, 5], cu_seqlens=[0, 1, 3, 5], ignore=[0])
        want = make_batch(
            [np.array([top], np.int64), np.array([1, top - 5], np.int64), np.array([0, top], np.int64)],
            [np.array([IGNORE_INDEX]), np.array([top - 5, 7]), np.array([top, 3])],
            [3, 2],
        )
        assert_same_batch(b, want)
        b.check()
    b = VarlenBatch.from_compact(torch.tensor([5, 6, 7]), torch.tensor([0, 2]))
    assert b.tokens.dtype == torch.int64 and b.input_ids.tolist() == [5, 6] and b.targets.tolist() == [6, 7]
    for kw, msg in (
        (dict(tokens=np.arange(5), row_cu=[0, 2, 2]), "strictly increase"),
        (dict(tokens=np.arange(5), row_cu=[0, 3]), "need 4"),
        (dict(tokens=np.arange(6), row_cu=[0, 2, 4], cu_seqlens=[0, 3, 4]), "row start"),
        (dict(tokens=np.arange(6), row_cu=[0, 2, 4], cu_seqlens=[0, 2, 5]), "end at T"),
        (dict(tokens=np.arange(6), row_cu=[0, 2, 4], ignore=[1, 1]), "distinct"),
        (dict(tokens=np.arange(6), row_cu=[0, 2, 4], ignore=[4]), "distinct"),
    ):
        with pytest.raises(ValueError, match=msg):
            VarlenBatch.from_compact(**kw)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_from_window_rows_equals_eager_segments_and_survives_pickling(dtype, materialize_path):
    """A batch joined from row byte views (memoryviews and arrays): inputs/targets are each row
    without its last/first id, ``segment_starts`` split rows into segments (positions restart),
    ``ignore`` marks exactly the listed targets; without them each row is one segment. Equal to
    an eager batch of the same segments; valid after pickling and cloning."""
    rng = np.random.default_rng(0)
    top = np.iinfo(dtype).max
    R, U = 4, 6
    ids = rng.integers(0, top, size=(R, U + 1), endpoint=True).astype(dtype)
    ids[0, 0] = top
    rows = [memoryview(ids[0]).cast("B"), ids[1], memoryview(ids[2].tobytes()), ids[3].copy()]
    cuts = [0, 2, 6, 12, 13, 18]  # rows start at 0, 6, 12, 18; segments also at 2 and 13
    ignore = [1, 12, 23]
    for seg, ign in ((None, None), (cuts, None), (cuts, ignore), (None, [5])):
        b = VarlenBatch.from_window_rows(
            rows,
            U,
            dtype,
            segment_starts=None if seg is None else np.array(seg, np.int32),
            ignore=None if ign is None else np.array(ign, np.int64),
            max_seqlen=None if seg is None else 6,
        )
        bounds = list(range(0, R * U + 1, U)) if seg is None else [*seg, R * U]
        inp = ids[:, :-1].astype(np.int64).reshape(-1)
        tgt = ids[:, 1:].astype(np.int64).reshape(-1)
        tgt[[] if ign is None else ign] = IGNORE_INDEX
        want = make_batch(
            [inp[a:z] for a, z in zip(bounds[:-1], bounds[1:])],
            [tgt[a:z] for a, z in zip(bounds[:-1], bounds[1:])],
            [U] * R,
        )
        assert b.is_compact and b.num_rows == R
        for got in (b, pickle.loads(pickle.dumps(b)), b.clone()):
            assert_same_batch(got, want)
            got.check()


# -- compact == eager on real GPT-2 shards --------------------------------------------------------------


@pytest.mark.parametrize("document_mask", [False, True])
def test_dev_corpus_compact_windows_and_packs_equal_eager(dev_manifest, document_mask, materialize_path):
    """Real GPT-2 shards (ids up to 50,256 in int16 bit patterns): windows at 1024 and 4096 and
    best-fit packs equal their eager counterparts field by field."""
    c = open_corpus(dev_manifest, "train")
    toks, offs, _ = oracle_stream(dev_manifest)
    assert toks.max() > 32_767  # some ids are negative as int16: the widening matters
    for L in (1024, 4096):
        ds = SlidingWindowDataset(c, L, batch_size=4, seed=1, mode="random", document_mask=document_mask)
        plan = ds.plan()
        for i, b in zip(range(4), ds):
            assert_same_batch(b, eager_windows(toks, offs, plan[4 * i : 4 * i + 4], L, document_mask))
            b.check()
    if not document_mask:
        ds = BestFitDataset(c, max_seq_len=4096, batch_size=8, with_segments=True)
        for _, b in zip(range(4), ds):
            assert_same_batch(b, eager_segments(toks, offs, b.segments.numpy(), b.pack_lengths.numpy()))
            b.check()


# -- laziness, movement, pickling ------------------------------------------------------------------------


def test_counts_do_not_materialize_and_fields_are_cached(stdlib_manifest):
    """num_tokens/num_targets/num_segments/num_packs come from host-known sizes (no int64 field is
    built); a field is built once per object."""
    c = open_corpus(stdlib_manifest, "train")
    b = next(iter(SlidingWindowDataset(c, 512, batch_size=4, document_mask=True)))
    counts = (b.num_tokens, b.num_targets, b.num_segments, b.num_packs)
    # The private cache is read on purpose: it is the only observable of "nothing was built".
    assert not {"input_ids", "targets", "position_ids"} & set(b._lazy)
    assert b.input_ids is b.input_ids and b.targets is b.targets
    assert counts == (4 * 512, int((b.targets != IGNORE_INDEX).sum()), b.cu_seqlens.numel() - 1, 4)


def test_pickle_and_torch_save_send_the_compact_buffer_only(stdlib_manifest):
    """A pickled or torch.saved compact batch (fields already materialized) holds about 2 bytes per
    token, not 24, and unpickles to equal fields."""
    c = open_corpus(stdlib_manifest, "train")
    for b in (
        next(iter(SlidingWindowDataset(c, 1024, batch_size=8, document_mask=True))),
        next(iter(BestFitDataset(c, max_seq_len=2048, batch_size=4))),
    ):
        b.check()  # materializes every field
        blob = pickle.dumps(b)
        assert len(blob) < 3 * b.num_tokens + 4096
        got = pickle.loads(blob)
        assert got.is_compact
        assert_same_batch(got, b)
        f = io.BytesIO()
        torch.save(b, f)
        assert f.tell() < 3 * b.num_tokens + 8192
        f.seek(0)
        assert_same_batch(torch.load(f, weights_only=False), b)


def test_spawned_dataloader_workers_deliver_equal_compact_batches(stdlib_manifest):
    """DataLoader(num_workers=2, spawn): each worker's compact batches cross processes (one shared
    buffer each) and equal the batches of the same consumers built in process."""
    c = open_corpus(stdlib_manifest, "train")
    kw = dict(seq_len=1000, batch_size=4, seed=2, document_mask=True)
    want = Counter(batch_digest(b) for r in range(2) for b in SlidingWindowDataset(c, rank=r, world_size=2, **kw))
    loader = DataLoader(SlidingWindowDataset(c, **kw), batch_size=None, num_workers=2, multiprocessing_context="spawn")
    got = Counter()
    for b in loader:
        assert b.is_compact
        b.check()
        got[batch_digest(b)] += 1
    assert got == want and sum(got.values()) > 10


def test_to_cpu_and_clone_keep_compact_fields(stdlib_manifest):
    """.to("cpu") (blocking or not) and clone() give compact batches with equal fields; a clone
    owns its memory."""
    c = open_corpus(stdlib_manifest, "train")
    b = next(iter(BestFitDataset(c, max_seq_len=1024, batch_size=3)))
    for moved in (b.to("cpu"), b.to("cpu", non_blocking=False), b.to(torch.device("cpu")), b.clone()):
        assert moved.is_compact and moved.device.type == "cpu"
        assert_same_batch(moved, b)
    cl = b.clone()
    cl.tokens.zero_()
    assert not torch.equal(cl.input_ids, b.input_ids)


def test_assigned_fields_override_and_travel(stdlib_manifest):
    """Assigning a field (a padding loader, a test) overrides it on that object: counts follow the
    assigned tensor, other fields stay lazily correct, and the override survives pickling and .to()."""
    c = open_corpus(stdlib_manifest, "train")
    b = next(iter(SlidingWindowDataset(c, 256, batch_size=2)))
    want_targets = b.targets.clone()
    padded = torch.cat([b.input_ids, torch.zeros(10, dtype=torch.int64)])
    b.input_ids = padded
    assert b.input_ids is padded and b.num_tokens == 2 * 256 + 10
    assert torch.equal(b.targets, want_targets)
    for other in (pickle.loads(pickle.dumps(b)), b.to("cpu")):
        assert torch.equal(other.input_ids, padded) and torch.equal(other.targets, want_targets)
    with pytest.raises(BatchError, match=r"targets: shape \(512,\) dtype torch.int64, expected \(522,\) int64"):
        b.check()
    b2 = next(iter(SlidingWindowDataset(c, 256, batch_size=2)))
    b2.cu_seqlens = torch.tensor([0, 100, 256, 512], dtype=torch.int32)  # a finer segmentation
    b2.max_seqlen = 256
    assert b2.position_ids[100:103].tolist() == [0, 1, 2] and b2.position_ids[256] == 0
    b2.check()


def small_eager() -> VarlenBatch:
    """Two segments of 3 and 2 inputs in one pack of 5."""
    return make_batch([np.array([5, 6, 7]), np.array([8, 9])], [np.array([6, 7, 1]), np.array([9, 1])], [5])


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "position_ids",
            torch.tensor([0, 1, 2, 3, 4]),
            r"position_ids\[3\] = 3, expected 0 \(segment 1, inputs \[3, 5\)\)",
        ),
        ("cu_seqlens", torch.tensor([0, 3, 4], dtype=torch.int32), r"cu_seqlens ends at 4, expected T = 5"),
        ("cu_seqlens", torch.tensor([0, 3, 3, 5], dtype=torch.int32), r"segment 1 spans \[3, 3\)"),
        ("cu_seqlens", torch.tensor([0, 3, 5]), r"cu_seqlens: dtype torch.int64, expected int32"),
        ("pack_lengths", torch.tensor([4], dtype=torch.int32), r"pack_lengths sum to 4, expected T = 5"),
        ("targets", torch.tensor([6, 7, 1, 9]), r"targets: shape \(4,\) dtype torch.int64, expected \(5,\) int64"),
        ("max_seqlen", 7, r"max_seqlen is 7, the longest segment has 3 tokens"),
    ],
)
def test_check_raises_batch_error_naming_the_invariant_and_where(field, value, message):
    """check() passes a well-formed batch and raises BatchError (a ValueError) naming the first
    broken invariant and where it breaks."""
    b = small_eager()
    b.check()
    setattr(b, field, value)
    with pytest.raises(BatchError, match=message) as err:
        b.check()
    assert isinstance(err.value, ValueError)


def test_check_of_compact_parts_names_the_row():
    """On a compact batch, a segmentation whose segments span rows is refused, naming the row."""
    b = VarlenBatch.from_compact(np.arange(7, dtype=np.uint16), [0, 3, 5])  # rows of 3 and 2 inputs
    b.check()
    b.cu_seqlens = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(BatchError, match=r"every row start must be a segment start: row 1 starts at input 3"):
        b.check()


def test_check_raises_under_python_optimize():
    """check() is not built on assert: under ``python -O`` (assertions off) it still raises."""
    code = (
        "import torch; from h5corpus.loaders.batch import BatchError, make_batch\n"
        "assert False, 'assertions are on'\n"
        "b = make_batch([[1, 2, 3]], [[2, 3, 4]], [3]); b.position_ids = torch.tensor([0, 2, 1])\n"
        "try:\n    b.check()\nexcept BatchError as e:\n    print('BatchError:', e)\n"
    )
    r = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, env=subprocess_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("BatchError: position_ids must restart at 0 per segment: position_ids[1] = 2"), r.stdout


def test_concat_and_collate_keep_compact_and_match_eager(stdlib_manifest, materialize_path):
    """concat_batches/collate_varlen of compact batches stay compact (window, masked window and
    packed rows together) and equal the concatenation of their eager versions; mixed with an eager
    batch the result is eager and equal too."""
    c = open_corpus(stdlib_manifest, "train")
    parts = [
        next(iter(SlidingWindowDataset(c, 300, batch_size=2))),
        next(iter(SlidingWindowDataset(c, 300, batch_size=3, seed=4, document_mask=True))),
        next(iter(BestFitDataset(c, max_seq_len=700, batch_size=2))),
    ]
    eager = [p.eager() for p in parts]
    assert not any(e.is_compact for e in eager)
    want = concat_batches(eager)
    got = collate_varlen(parts)
    assert got.is_compact and got.num_rows == sum(p.num_rows for p in parts)
    assert_same_batch(got, want)
    got.check()
    mixed = concat_batches([parts[0], eager[1], parts[2]])
    assert not mixed.is_compact
    assert_same_batch(mixed, want)
    assert collate_varlen(parts[0]) is parts[0]


# -- reader: variable-length multi-range gather ------------------------------------------------------------


@pytest.mark.parametrize("read_path", ["auto", "h5py"])
def test_gather_ranges_equals_per_range_reads(stdlib_manifest, read_path):
    """gather_ranges(starts, lengths) = the ranges' tokens end to end, for ranges inside chunks,
    across chunk and shard boundaries, empty ones and the stream's ends, into any integer dtype."""
    c = open_corpus(stdlib_manifest, "train", read_path=read_path)
    toks, _, shard_starts = oracle_stream(stdlib_manifest)
    N = c.num_tokens
    rng = np.random.default_rng(7)
    edges = np.concatenate([shard_starts[1:-1], np.arange(4096, N, 4096)[:40]])
    starts = np.concatenate([rng.integers(0, N - 5000, 200), edges - 3, edges, [0, N - 1, N, N - 10]])
    lengths = np.concatenate([rng.integers(0, 5000, 200), np.full(2 * edges.size, 7), [1, 1, 0, 10]])
    lengths = np.minimum(lengths, N - starts)
    want = np.concatenate([toks[a : a + n] for a, n in zip(starts.tolist(), lengths.tolist())])
    for dtype in (np.uint16, np.int64):
        got = c.gather_ranges(starts, lengths, out=np.empty(want.size, dtype))
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(c.gather_ranges(starts[:50], lengths[:50]), want[: int(lengths[:50].sum())])
    assert c.gather_ranges(np.zeros(0, np.int64), np.zeros(0, np.int64)).size == 0
    with pytest.raises(IndexError, match="outside"):
        c.gather_ranges(np.array([0, N - 3]), np.array([2, 4]))
    with pytest.raises(ValueError, match="out has shape"):
        c.gather_ranges(np.array([0]), np.array([5]), out=np.empty(4, np.uint16))
