"""``h5corpus inspect``: the seed's counts, statistics and data checks over a built corpus.

:func:`inspect_corpus` streams each split shard by shard: one shard's index and one block of
tokens at a time, so its memory does not grow with the corpus. It computes the figures of seed
002's table (documents, raw tokens, prediction pairs) and seed 001's statistics exactly, runs the
seed's checks (each reported pass/fail with the figure behind it), and simulates the best-fit
loader's packing. Memory, beyond one shard:

* a ``vocab_size`` token histogram (8 bytes per id) and an exact histogram of document lengths
  (8 MB dense below :data:`DENSE_LENGTHS` tokens, a dict entry per distinct longer length);
* the whole-epoch figures (pack fill, padded-batch waste, the length plot) over at most
  :data:`SAMPLE_DOCUMENTS` documents: every document when the split holds no more, else a uniform
  sample (each document kept with probability ``SAMPLE_DOCUMENTS / documents``, seeded by the
  inspect seed and the shard), stated in the report as ``packing.sampled_documents``;
* the split-leakage check: a 16-byte prefix of each id of the smaller split (128 bits: a chance
  collision among 10^12 documents has probability ~10^-15);
* the restore and input-length checks iterate the best-fit loader over the split's first shard
  (they check the loader, which treats every shard alike; planning the whole split would cost
  memory per document).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .loaders import chunking
from .loaders.batch import BatchError
from .loaders.bestfit import BestFitDataset
from .loaders.epochplan import default_packing_buffer, pack_fill
from .storage import format as fmt
from .storage.manifest import Manifest, read_manifest
from .storage.reader import Corpus, open_corpus

#: Tokens read per block while streaming a shard.
BLOCK_TOKENS = 1 << 22
#: Documents the whole-epoch figures (pack fill, padded-batch waste, the length plot) are computed
#: over; a split with more is sampled uniformly (module docstring).
SAMPLE_DOCUMENTS = 1 << 18
#: Document lengths below this many tokens are counted in a dense histogram (8 bytes each).
DENSE_LENGTHS = 1 << 20
#: Longest documents shown with their chunk lengths, and split token by token in the chunking check.
LONG_EXAMPLES, LONGEST_SPLIT = 5, 8
#: Bytes of each document id compared by the split-leakage check.
ID_PREFIX_BYTES = 16


@dataclass
class Check:
    """One of the seed's checks: ``passed`` and the figure that decided it."""

    name: str
    passed: bool
    figure: str

    def __str__(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name}: {self.figure}"


@dataclass
class InspectReport:
    manifest: str
    settings: dict[str, Any]
    splits: dict[str, dict[str, Any]] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        splits = {k: {kk: vv for kk, vv in v.items() if not kk.startswith("_")} for k, v in self.splits.items()}
        return {
            "manifest": self.manifest,
            "settings": self.settings,
            "ok": self.ok,
            "splits": splits,
            "checks": [asdict(c) for c in self.checks],
        }


class _LengthCounts:
    """Exact counts of document lengths (tokens): quantiles equal to ``np.percentile(lengths, q,
    method="nearest")`` over every document, in memory independent of the document count."""

    def __init__(self) -> None:
        self.dense = np.zeros(DENSE_LENGTHS, dtype=np.int64)  # dense[n]: documents of n tokens
        self.sparse: dict[int, int] = {}  # longer lengths -> documents

    def add(self, lengths: np.ndarray) -> None:
        small = lengths < DENSE_LENGTHS
        self.dense += np.bincount(lengths[small], minlength=DENSE_LENGTHS)
        big, counts = np.unique(lengths[~small], return_counts=True)
        for v, k in zip(big.tolist(), counts.tolist()):
            self.sparse[v] = self.sparse.get(v, 0) + k

    def quantiles(self) -> dict[str, int]:
        """min / median / p90 / p99 / max in tokens (all 0 without documents)."""
        long = sorted(self.sparse)
        values = np.concatenate([np.flatnonzero(self.dense), np.array(long, dtype=np.int64)])
        counts = np.concatenate([self.dense[self.dense > 0], np.array([self.sparse[v] for v in long], np.int64)])
        n = int(counts.sum())
        if n == 0:
            return {"min": 0, "median": 0, "p90": 0, "p99": 0, "max": 0}
        # numpy's "nearest": sorted index round-half-to-even((n - 1) * q)
        rank = np.around(np.array([50, 90, 99]) / 100 * (n - 1))
        q = values[np.searchsorted(np.cumsum(counts), rank, side="right")]
        return {"min": int(values[0]), "median": int(q[0]), "p90": int(q[1]), "p99": int(q[2]), "max": int(values[-1])}


def _longest(idx: np.ndarray, lengths: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` longest of (document index, length) pairs: longest first, lower index first among equals."""
    order = np.lexsort((idx, -lengths))[:k]
    return idx[order], lengths[order]


@dataclass
class _ChunkCounts:
    """The chunking check's counts (:func:`_chunk_counts`), summed over shards."""

    chunks: int = 0
    chunk_pairs: int = 0
    lost: int = 0
    duplicated: int = 0
    gaps: int = 0
    bad_length: int = 0
    not_at_end: int = 0

    def add(self, other: _ChunkCounts) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


def _chunk_counts(lengths: np.ndarray, seq_len: int) -> _ChunkCounts:
    """Chunk ``lengths`` (one shard's documents) with :func:`~h5corpus.loaders.chunking.document_chunks`
    and count what breaks the rule: inside each document chunks start at 0 and each starts where
    the previous ended; lengths lie in [1, seq_len]; every pair is covered once; the last chunk's
    last target is the document's last token."""
    doc, start, length = chunking.document_chunks(lengths, seq_len)
    pairs = np.maximum(lengths - 1, 0)
    per_doc = np.bincount(doc, weights=length, minlength=lengths.size).astype(np.int64)
    first = np.r_[True, doc[1:] != doc[:-1]] if doc.size else np.zeros(0, bool)
    last = np.r_[doc[1:] != doc[:-1], True] if doc.size else np.zeros(0, bool)
    ends = start + length
    return _ChunkCounts(
        chunks=int(doc.size),
        chunk_pairs=int(length.sum()),
        lost=int(np.clip(pairs - per_doc, 0, None).sum()),
        duplicated=int(np.clip(per_doc - pairs, 0, None).sum()),
        gaps=int(np.count_nonzero(start[first] != 0))
        + int(np.count_nonzero(start[~first] != np.r_[0, ends[:-1]][~first])),
        bad_length=int(np.count_nonzero((length < 1) | (length > seq_len))),
        # the last target of a document's last chunk sits at offset start + length: its last token
        not_at_end=int(np.count_nonzero(ends[last] != lengths[doc[last]] - 1)),
    )


@dataclass
class _Scan:
    """One split's figures, accumulated shard by shard (see the module docstring for memory)."""

    vocab_size: int
    hist: np.ndarray = field(init=False)  # (vocab_size,) occurrences of each token id
    lengths: _LengthCounts = field(default_factory=_LengthCounts)
    chunking: _ChunkCounts = field(default_factory=_ChunkCounts)
    longest_idx: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    longest_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    sample: list[np.ndarray] = field(default_factory=list)  # sampled lengths, corpus order
    documents: int = 0
    pairs: int = 0
    long_documents: int = 0  # documents with more than seq_len pairs
    truncated: int = 0
    whole_documents: int = 0
    bad_ends: int = 0  # whole documents whose last token is not EOS
    eos_total: int = 0

    def __post_init__(self) -> None:
        self.hist = np.zeros(self.vocab_size, dtype=np.int64)

    @property
    def eos_inside(self) -> int:
        return self.eos_total - (self.whole_documents - self.bad_ends)

    @property
    def sampled_lengths(self) -> np.ndarray:
        return np.concatenate(self.sample) if self.sample else np.zeros(0, np.int64)


def _shard_meta(corpus: Corpus, shard: int, name: str, n: int) -> np.ndarray:
    """The first ``n`` rows of per-document dataset ``name`` (``doc_flags``, ``doc_ids``) of one
    shard, checked by the reader (row counts, the manifest's index hash)."""
    ids, flags = corpus.shard_doc_meta(shard)
    return (flags if name == fmt.DOC_FLAGS else ids)[:n]


def _scan_tokens(corpus: Corpus, a: int, b: int, ends: np.ndarray, scan: _Scan, progress) -> None:
    """Tokens ``[a, b)`` in blocks: the vocabulary histogram, EOS count, and whether each global
    position in ``ends`` (sorted, inside ``[a, b)``) holds EOS."""
    eos, vocab = corpus.eos_id, scan.vocab_size
    buf = np.empty(min(BLOCK_TOKENS, max(b - a, 1)), dtype=corpus.dtype)
    for lo in range(a, b, BLOCK_TOKENS):
        hi = min(lo + BLOCK_TOKENS, b)
        view = corpus.tokens(lo, hi, out=buf[: hi - lo])
        scan.hist += np.bincount(view, minlength=vocab)[:vocab]
        scan.eos_total += int(np.count_nonzero(view == eos))
        i, j = np.searchsorted(ends, [lo, hi])
        scan.bad_ends += int(np.count_nonzero(view[ends[i:j] - lo] != eos))
        if progress:
            progress(hi - lo)


def _scan_shard(corpus: Corpus, shard: int, scan: _Scan, seq_len: int, keep: float, rng, progress) -> None:
    """Add one shard's documents and tokens to ``scan``; keep each document's length in the sample
    with probability ``keep``."""
    lo, hi = int(corpus.shard_doc_starts[shard]), int(corpus.shard_doc_starts[shard + 1])
    offsets = corpus.doc_offsets_range(lo, hi)
    lengths = np.diff(offsets)
    flags = _shard_meta(corpus, shard, fmt.DOC_FLAGS, hi - lo)
    whole = (flags & fmt.FLAG_TRUNCATED) == 0
    ends = offsets[1:][whole] - 1  # global positions that must hold EOS
    scan.documents += lengths.size
    scan.pairs += int(np.maximum(lengths - 1, 0).sum())
    scan.long_documents += int(np.count_nonzero(lengths - 1 > seq_len))
    scan.truncated += int(np.count_nonzero(~whole))
    scan.whole_documents += int(ends.size)
    scan.lengths.add(lengths)
    scan.chunking.add(_chunk_counts(lengths, seq_len))
    idx = np.arange(lo, hi, dtype=np.int64)
    scan.longest_idx, scan.longest_len = _longest(
        np.r_[scan.longest_idx, idx], np.r_[scan.longest_len, lengths], max(LONG_EXAMPLES, LONGEST_SPLIT)
    )
    scan.sample.append(lengths if keep >= 1 else lengths[rng.random(lengths.size) < keep])
    _scan_tokens(corpus, int(offsets[0]), int(offsets[-1]), ends, scan, progress)


def _scan_split(corpus: Corpus, seq_len: int, seed: int, progress) -> _Scan:
    """Every shard of ``corpus`` in order (the sample seeded by ``seed`` and the shard)."""
    scan = _Scan(corpus.manifest.tokenizer.vocab_size)
    keep = SAMPLE_DOCUMENTS / max(corpus.num_documents, 1)
    for k in range(corpus.num_shards):
        _scan_shard(corpus, k, scan, seq_len, keep, np.random.default_rng([seed, k]), progress)
    return scan


def _check_chunking(corpus: Corpus, scan: _Scan, seq_len: int) -> tuple[bool, str]:
    """Chunking covers every next-token pair of every document exactly once, and each whole
    document's final chunk ends on its real EOS.

    Checked on the chunk index of every document, shard by shard (:func:`_chunk_counts`), with the
    token stream's count of whole documents whose last token is not EOS. The longest documents
    are also split with :func:`~h5corpus.loaders.chunking.split_tokens` and compared token by
    token: inputs == doc[:-1], targets == doc[1:].
    """
    cc = scan.chunking
    sample_bad = 0
    longest = scan.longest_idx[:LONGEST_SPLIT].tolist()
    for i in longest:
        toks = corpus.document(i)
        chunks = chunking.split_tokens(toks, max_seq_len=seq_len)
        ins = np.concatenate([c.inputs for c in chunks]) if chunks else toks[:0]
        tgs = np.concatenate([c.targets for c in chunks]) if chunks else toks[:0]
        if not (np.array_equal(ins, toks[:-1]) and np.array_equal(tgs, toks[1:])):
            sample_bad += 1
    bad = (cc.lost, cc.duplicated, cc.gaps, cc.bad_length, cc.not_at_end, scan.bad_ends, sample_bad)
    fig = (
        f"{cc.chunk_pairs:,} chunked pairs vs {scan.pairs:,} document pairs: {cc.lost:,} lost, "
        f"{cc.duplicated:,} duplicated, {cc.gaps:,} gaps/overlaps; {cc.not_at_end + scan.bad_ends:,} documents "
        f"whose last target is not their real EOS; {sample_bad}/{len(longest)} longest documents differ "
        "from split_tokens"
    )
    return not any(bad), fig


def _shared_ids(a: Corpus, b: Corpus) -> int:
    """Distinct document ids (first :data:`ID_PREFIX_BYTES` bytes) in both splits: the smaller
    split's prefixes held sorted, the larger one's streamed shard by shard."""
    small, large = sorted((a, b), key=lambda c: c.num_documents)
    dt = f"V{ID_PREFIX_BYTES}"

    def prefixes(c: Corpus, k: int) -> np.ndarray:
        n = int(c.shard_doc_starts[k + 1] - c.shard_doc_starts[k])
        ids = _shard_meta(c, k, fmt.DOC_IDS, n)[:, :ID_PREFIX_BYTES]
        return np.ascontiguousarray(ids).view(dt).ravel()

    held = np.unique(np.concatenate([np.zeros(0, dt), *(prefixes(small, k) for k in range(small.num_shards))]))
    hits = [np.intersect1d(prefixes(large, k), held) for k in range(large.num_shards)]
    return int(np.unique(np.concatenate([np.zeros(0, dt), *hits])).size)


def _check_batches(
    corpus, seq_len, batch_size, packing_buffer, seed, mode, n_batches: int = 3
) -> tuple[tuple[bool, str], tuple[bool, str]]:
    """(model input length == real inputs and positions restart per segment; restoring the
    sampler state continues with the same next batch)."""

    def dataset() -> BestFitDataset:
        return BestFitDataset(
            corpus, max_seq_len=seq_len, batch_size=batch_size, packing_buffer=packing_buffer, seed=seed, mode=mode
        )

    it = iter(dataset())
    bad_len = bad_pos = seen = real = 0
    for b in (next(it, None) for _ in range(n_batches)):
        if b is None:
            break
        seen += 1
        seg_lens = b.cu_seqlens.long().diff()
        real += int(seg_lens.sum())
        if b.input_ids.numel() != int(seg_lens.sum()) or b.input_ids.numel() != int(b.pack_lengths.sum()):
            bad_len += 1
        try:
            b.check()
        except BatchError:
            bad_pos += 1
    length_fig = (
        f"{seen} microbatches, {real:,} real inputs = model input rows; "
        f"{bad_len} with a length mismatch, {bad_pos} with positions not restarting per segment"
    )
    return (seen > 0 and bad_len == 0 and bad_pos == 0, length_fig), _check_restore(dataset)


def _same_batch(got, expected) -> bool:
    if got is None or got.input_ids.shape != expected.input_ids.shape:
        return False
    fields = ("input_ids", "targets", "position_ids", "cu_seqlens", "pack_lengths")
    return got.max_seqlen == expected.max_seqlen and all(
        bool((getattr(got, f) == getattr(expected, f)).all()) for f in fields
    )


def _check_restore(dataset: Callable[[], BestFitDataset]) -> tuple[bool, str]:
    """The state taken after batch 1 makes a fresh dataset continue with batch 2."""
    ds = dataset()
    it = iter(ds)
    first = next(it, None)
    state = ds.state_dict()
    expected = next(it, None)
    if first is None or expected is None:
        return True, "split holds fewer than 2 microbatches: nothing to resume"
    restored = dataset()
    restored.load_state_dict(state)
    same = _same_batch(next(iter(restored), None), expected)
    return same, (
        f"batch 2 after restoring the state taken after batch 1: "
        f"{'identical' if same else 'DIFFERENT'} ({expected.num_tokens:,} tokens, {expected.num_segments} segments)"
    )


def _epoch_figures(lengths: np.ndarray, seq_len: int, batch_size: int, packing_buffer: int, seed: int, mode: str):
    """(pack fill, padding wastes) of the best-fit loader over ``lengths`` (the sampled documents)."""
    pf = pack_fill(
        lengths, max_seq_len=seq_len, batch_size=batch_size, packing_buffer=packing_buffer, seed=seed, mode=mode
    )
    _, _, clen = chunking.document_chunks(lengths, seq_len)
    pairs = int(clen.sum())
    padded_rows = clen.size * seq_len
    # dynamic padding: segments in shuffled order, batch_size rows per microbatch, each row
    # padded to the microbatch's longest segment
    cl = clen[np.random.default_rng(seed).permutation(clen.size)]
    rows = np.zeros(-(-cl.size // batch_size) * batch_size, dtype=np.int64)
    rows[: cl.size] = cl
    rows = rows.reshape(-1, batch_size)
    dyn = int((rows.max(axis=1) * np.count_nonzero(rows, axis=1)).sum())
    padding = {
        "pad_each_segment_to_seq_len_waste": round(1 - pairs / padded_rows, 6) if padded_rows else 0.0,
        "pad_to_longest_in_microbatch_waste": round(1 - pairs / dyn, 6) if dyn else 0.0,
    }
    return pf, padding


def _decode_top(manifest: Manifest, ids: Sequence[int]) -> list[str] | None:
    """Texts of ``ids`` when the manifest's tokenizer can be loaded offline and is the same one
    (sha256 of its JSON); None otherwise (the table then shows ids)."""
    try:
        from .build.tokenize.tokenizer import load_tokenizer  # loads the tokenizer libraries only here

        tok = load_tokenizer(manifest.tokenizer.name)
        if tok.identity.sha256 != manifest.tokenizer.sha256:
            return None
        return [tok.hf.decode([int(i)]) for i in ids]
    except Exception:  # tokenizer not available here: figures stay numeric
        return None


def _long_examples(scan: _Scan, seq_len: int) -> list[dict[str, Any]]:
    """The longest documents with more than ``seq_len`` pairs and their chunk lengths."""
    idx, n = scan.longest_idx[:LONG_EXAMPLES], scan.longest_len[:LONG_EXAMPLES]
    long = n - 1 > seq_len
    return [
        {
            "document": int(i),
            "tokens": int(k),
            "chunk_lengths": chunking.document_chunks(np.array([k]), seq_len)[2].tolist(),
        }
        for i, k in zip(idx[long], n[long])
    ]


def _top_tokens(m: Manifest, hist: np.ndarray, top_k: int) -> list[dict[str, Any]]:
    """The ``top_k`` most frequent ids with their counts (and texts when the tokenizer loads)."""
    top = np.argsort(-hist, kind="stable")[:top_k]
    top = top[hist[top] > 0]
    decoded = _decode_top(m, top.tolist())
    return [
        {"id": int(t), "count": int(hist[t]), **({"text": decoded[k]} if decoded else {})}
        for k, t in enumerate(top.tolist())
    ]


def _split_figures(m: Manifest, split: str, c: Corpus, scan: _Scan, settings: dict[str, Any], top_k: int):
    """The report's entry of one split (``_``-keys stay out of the JSON)."""
    seq_len = settings["seq_len"]
    built = m.splits.get(split) if isinstance(m.splits.get(split), dict) else {}
    sample = scan.sampled_lengths
    pf, padding = _epoch_figures(
        sample, seq_len, settings["batch_size"], settings["packing_buffer"], settings["seed"], settings["mode"]
    )
    examples = _long_examples(scan, seq_len)
    hist = scan.hist
    top = _top_tokens(m, hist, top_k)
    chars = built.get("characters")
    return {
        "documents": c.num_documents,
        "raw_tokens": c.num_tokens,
        "prediction_pairs": scan.pairs,
        "bytes_on_disk": sum(s.bytes for s in m.shards_of(split)),
        "shards": len(m.shards_of(split)),
        "format_version": m.version,
        "verified_reads": c.verified,
        "integrity_note": c.integrity_note,
        "duplicates_dropped": built.get("duplicates"),
        "skipped": built.get("skipped"),
        "truncated": scan.truncated,
        "dropped": built.get("dropped"),
        "perplexity": built.get("perplexity"),
        "length_tokens": scan.lengths.quantiles(),
        "documents_longer_than_seq_len": scan.long_documents,
        "long_document_examples": examples,
        "chunks": scan.chunking.chunks,
        "characters_per_token": (round(chars / c.num_tokens, 3) if chars and c.num_tokens else None),
        "vocabulary_used": int(np.count_nonzero(hist)),
        "vocabulary_size": m.tokenizer.vocab_size,
        "top_tokens": top,
        "packing": {
            "fill": round(pf.fill, 6),
            "fill_full_microbatches": round(pf.fill_full_microbatches, 6),
            "packs": pf.packs,
            "microbatches": pf.microbatches,
            "real_tokens": pf.real_tokens,
            "capacity": pf.capacity,
            "sampled_documents": int(sample.size),
        },
        "padding": padding,
        "eos": {"bad_ends": scan.bad_ends, "eos_inside": scan.eos_inside, "whole_documents": scan.whole_documents},
        "_lengths": sample,
        "_pack_fill": pf.pack_fill,
    }


def _leakage_check(corpora: dict[str, Corpus], splits: Sequence[str]) -> Check:
    name = "no source document id in both splits"
    if "train" not in corpora or "validation" not in corpora:
        return Check(name, True, f"only {list(splits)} inspected: nothing to compare")
    a, b = corpora["train"], corpora["validation"]
    both = _shared_ids(a, b)
    return Check(
        name,
        both == 0,
        f"{both:,} ids shared by {a.num_documents:,} train and {b.num_documents:,} validation documents",
    )


def _first_shard(m: Manifest, split: str) -> Corpus:
    """``split``'s first shard opened as a corpus of its own (what the loader checks read)."""
    return open_corpus(dataclasses.replace(m, shards=m.shards_of(split)[:1]), split)


def _split_checks(m: Manifest, split: str, c: Corpus, scan: _Scan, settings: dict[str, Any]) -> list[Check]:
    """The per-split checks: chunking, batch input lengths and restore (on the first shard), EOS placement."""
    s = settings
    bos_eos = scan.documents if c.bos_id is not None and c.bos_id == c.eos_id else 0  # BOS = EOS: each start
    ok, fig = _check_chunking(c, scan, s["seq_len"])
    first = _first_shard(m, split)
    try:
        (lok, lfig), (rok, rfig) = _check_batches(
            first, s["seq_len"], s["batch_size"], s["packing_buffer"], s["seed"], s["mode"]
        )
    finally:
        first.close()
    if c.num_shards > 1:
        lfig, rfig = f"first of {c.num_shards:,} shards: {lfig}", f"first of {c.num_shards:,} shards: {rfig}"
    return [
        Check(f"[{split}] chunking neither drops nor duplicates a pair and keeps the real EOS", ok, fig),
        Check(f"[{split}] model input length = real input count; positions restart per segment", lok, lfig),
        Check(f"[{split}] restoring the sampler state continues with the same next batch", rok, rfig),
        Check(
            f"[{split}] every document ends with EOS and no EOS elsewhere",
            scan.bad_ends == 0 and scan.eos_inside - bos_eos == 0,
            f"{scan.bad_ends:,} of {scan.whole_documents:,} documents lack the final EOS; "
            f"{scan.eos_inside - bos_eos:,} EOS inside documents",
        ),
        *_sft_checks(m, split, c, scan, settings),
    ]


def _chosen_splits(m: Manifest, splits: Sequence[str] | None) -> list[str]:
    present = [s for s in fmt.SPLITS if m.shards_of(s)]
    chosen = list(splits) if splits else present
    for s in chosen:
        if s not in present:
            raise ValueError(f"{m.path}: split {s!r} has no shards (present: {present})")
    return chosen


def inspect_corpus(
    manifest: str | os.PathLike[str],
    *,
    splits: Sequence[str] | None = None,
    seq_len: int = 4096,
    batch_size: int = 35,
    packing_buffer: int | None = None,
    mode: str = "buffer",
    seed: int = 0,
    top_k: int = 20,
    progress: bool = False,
) -> InspectReport:
    """Statistics and checks of ``splits`` (default: every split present) of a built corpus, read
    shard by shard (module docstring: what is held in memory, what is sampled)."""
    m = read_manifest(manifest)
    chosen = _chosen_splits(m, splits)
    settings = {
        "seq_len": seq_len,
        "batch_size": batch_size,
        "packing_buffer": default_packing_buffer(mode, packing_buffer),
        "mode": mode,
        "seed": seed,
    }
    rep = InspectReport(manifest=str(m.path), settings=settings)
    bar = None
    if progress:
        from tqdm import tqdm  # optional: only for the progress bar

        total = sum(s.tokens for s in m.shards if s.split in chosen)
        bar = tqdm(total=total, unit="tok", unit_scale=True, desc="inspect", leave=False)
    corpora: dict[str, Corpus] = {}
    scans: dict[str, _Scan] = {}
    try:
        for split in chosen:
            corpora[split] = c = open_corpus(m, split)
            scans[split] = _scan_split(c, seq_len, seed, bar.update if bar else None)
            rep.splits[split] = _split_figures(m, split, c, scans[split], settings, top_k)
            rep.splits[split]["trained_tokens"] = _trained_tokens(c)
        rep.checks.append(_leakage_check(corpora, chosen))
        for split, c in corpora.items():
            rep.checks.extend(_split_checks(m, split, c, scans[split], settings))
    finally:
        if bar:
            bar.close()
        for c in corpora.values():
            c.close()
    return rep


def _runs(xs: Sequence[int]) -> str:
    """``[4096, 4096, 798]`` -> ``"2 x 4,096, 798"``."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j < len(xs) and xs[j] == xs[i]:
            j += 1
        out.append(f"{xs[i]:,}" if j - i == 1 else f"{j - i} x {xs[i]:,}")
        i = j
    return ", ".join(out)


def format_report(rep: InspectReport) -> str:
    """Human-readable table of an :class:`InspectReport`."""
    lines = [f"corpus {rep.manifest}", ""]
    names = list(rep.splits)
    rows: list[tuple[str, Callable[[dict], str]]] = [
        ("documents", lambda s: f"{s['documents']:,}"),
        ("raw tokens (EOS incl.)", lambda s: f"{s['raw_tokens']:,}"),
        ("prediction pairs", lambda s: f"{s['prediction_pairs']:,}"),
        ("bytes on disk", lambda s: f"{s['bytes_on_disk']:,}"),
        ("bytes on disk / token", lambda s: f"{s['bytes_on_disk'] / max(s['raw_tokens'], 1):.4f}"),
        (
            "format, reads",
            lambda s: f"v{s['format_version']}, " + ("verified" if s["verified_reads"] else "UNVERIFIED"),
        ),
        ("duplicates dropped", lambda s: "-" if s["duplicates_dropped"] is None else f"{s['duplicates_dropped']:,}"),
        ("records skipped", lambda s: "-" if s["skipped"] is None else f"{s['skipped']:,}"),
        ("truncated", lambda s: f"{s['truncated']:,}"),
        ("length min/median/p90/p99/max", lambda s: "/".join(f"{v:,}" for v in s["length_tokens"].values())),
        (f"docs > seq_len {rep.settings['seq_len']:,}", lambda s: f"{s['documents_longer_than_seq_len']:,}"),
        ("segments after chunking", lambda s: f"{s['chunks']:,}"),
        ("chars / token", lambda s: "-" if s["characters_per_token"] is None else f"{s['characters_per_token']}"),
        ("vocabulary used", lambda s: f"{s['vocabulary_used']:,} / {s['vocabulary_size']:,}"),
        ("pack fill (best-fit)", lambda s: f"{s['packing']['fill']:.4f}"),
        ("packs / microbatches", lambda s: f"{s['packing']['packs']:,} / {s['packing']['microbatches']:,}"),
        ("padded-batch waste (rows of seq_len)", lambda s: f"{s['padding']['pad_each_segment_to_seq_len_waste']:.1%}"),
        ("padded-batch waste (pad to longest)", lambda s: f"{s['padding']['pad_to_longest_in_microbatch_waste']:.1%}"),
    ]
    rows = _with_mask_row(rows, rep)
    w0 = max(len(r[0]) for r in rows)
    cols = [[fn(rep.splits[n]) for n in names] for _, fn in rows]
    widths = [max(len(n), *(len(c[i]) for c in cols)) for i, n in enumerate(names)]
    lines.append(" " * w0 + "  " + "  ".join(n.rjust(w) for n, w in zip(names, widths)))
    for (label, _), vals in zip(rows, cols):
        lines.append(label.ljust(w0) + "  " + "  ".join(v.rjust(w) for v, w in zip(vals, widths)))
    for n in names:
        ex = rep.splits[n]["long_document_examples"]
        if ex:
            lines.append("")
            lines.append(f"[{n}] longest documents -> chunk lengths:")
            for e in ex[:3]:
                lines.append(f"  document {e['document']:,}: {e['tokens']:,} tokens -> {_runs(e['chunk_lengths'])}")
        top = rep.splits[n]["top_tokens"][:10]
        if top:
            lines.append(
                f"[{n}] most frequent tokens: " + ", ".join(f"{t.get('text', t['id'])!r}:{t['count']:,}" for t in top)
            )
    lines += _perplexity_lines(rep)
    notes = sorted({s["integrity_note"] for s in rep.splits.values() if s.get("integrity_note")})
    for note in notes:
        lines.append("")
        lines.append(f"note: {note}")
    lines.append("")
    lines.append("checks:")
    lines.extend(f"  {c}" for c in rep.checks)
    lines.append("")
    lines.append("ALL CHECKS PASSED" if rep.ok else f"{sum(not c.passed for c in rep.checks)} CHECK(S) FAILED")
    return "\n".join(lines)


def _perplexity_lines(rep: InspectReport) -> list[str]:
    """The recorded score distribution per split (builds with a perplexity model), else nothing."""
    out = []
    for n, st in rep.splits.items():
        ppl = st.get("perplexity")
        if not ppl or not ppl.get("quantiles"):
            continue
        q = ppl["quantiles"]
        shown = ", ".join(
            f"{k} {q[k]:,.1f}" for k in ("p0", "p10", "p25", "p50", "p75", "p80", "p90", "p99", "p100") if k in q
        )
        out.append(f"[{n}] perplexity of {ppl['documents']:,} scored documents (after filters and dedup): {shown}")
    return [""] + out if out else []


def _perplexity_bins(ppl: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(left edges, widths, counts) of a recorded perplexity histogram (bins equal on a log axis)."""
    per = int(ppl["histogram"]["bins_per_decade"])
    idx = np.array([int(k) for k in ppl["histogram"]["counts"]], dtype=np.int64)
    counts = np.array(list(ppl["histogram"]["counts"].values()), dtype=np.int64)
    left = 10.0 ** (idx / per)
    return left, 10.0 ** ((idx + 1) / per) - left, counts


def plot_report(rep: InspectReport, path: str | os.PathLike[str]) -> Path:
    """Write a PNG: document length histogram (log axis), pack fill histogram, tokens per split,
    and, when the build recorded scores, the perplexity histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = {n: s["perplexity"] for n, s in rep.splits.items() if (s.get("perplexity") or {}).get("histogram")}
    fig, ax = plt.subplots(1, 4 if scored else 3, figsize=(20 if scored else 15, 4.2))
    for name, ppl in scored.items():
        left, width, counts = _perplexity_bins(ppl)
        ax[3].bar(left, counts, width=width, align="edge", alpha=0.6, label=f"{name} ({ppl['documents']:,} docs)")
    if scored:
        ax[3].set_xscale("log")
        ax[3].set_xlabel("perplexity (n-gram model)")
        ax[3].set_ylabel("documents")
        ax[3].set_title("perplexity after filters and dedup")
        ax[3].legend(fontsize=8)
    for name, s in rep.splits.items():
        L = s["_lengths"]
        if L.size:
            bins = np.logspace(0, np.log10(max(L.max(), 2)), 50)
            ax[0].hist(L, bins=bins, alpha=0.6, label=f"{name} ({s['documents']:,} docs)")
    ax[0].set_xscale("log")
    ax[0].axvline(
        rep.settings["seq_len"] + 1, color="k", ls="--", lw=1, label=f"seq_len + 1 = {rep.settings['seq_len'] + 1:,}"
    )
    ax[0].set_xlabel("document length (tokens, EOS included)")
    ax[0].set_ylabel("documents")
    ax[0].set_title("document lengths")
    ax[0].legend(fontsize=8)
    for name, s in rep.splits.items():
        pf = s["_pack_fill"]
        if pf.size:
            ax[1].hist(
                pf,
                bins=np.linspace(0, 1, 41),
                alpha=0.6,
                label=f"{name}: fill {s['packing']['fill']:.4f}, {s['packing']['packs']:,} packs",
            )
    ax[1].set_yscale("log")
    ax[1].set_xlabel("pack fill (real tokens / capacity)")
    ax[1].set_ylabel("packs")
    ax[1].set_title(f"best-fit pack fill (mode {rep.settings['mode']}, buffer {rep.settings['packing_buffer']})")
    ax[1].legend(fontsize=8)
    names = list(rep.splits)
    toks = [rep.splits[n]["raw_tokens"] for n in names]
    bars = ax[2].bar(names, toks, color=["tab:blue", "tab:orange"][: len(names)])
    for b, t in zip(bars, toks):
        ax[2].text(b.get_x() + b.get_width() / 2, b.get_height(), f"{t:,}", ha="center", va="bottom", fontsize=9)
    ax[2].set_ylabel("tokens (EOS included)")
    ax[2].set_title("tokens per split")
    fig.suptitle(Path(rep.manifest).name + (" - all checks passed" if rep.ok else " - CHECKS FAILED"))
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# -- fine-tuning corpora: the loss mask and the BOS convention ---------------------------------------
def _with_mask_row(rows: list, rep: InspectReport) -> list:
    """The table's rows with "trained-on targets" before the packing rows when a split has a loss mask."""
    if all(s.get("trained_tokens") is None for s in rep.splits.values()):
        return rows
    at = next(i for i, r in enumerate(rows) if r[0].startswith("pack fill"))
    row = (
        "trained-on targets (loss mask)",
        lambda s: "all" if s.get("trained_tokens") is None else f"{s['trained_tokens']:,}",
    )
    return [*rows[:at], row, *rows[at:]]


def _trained_tokens(c: Corpus) -> int | None:
    """Targets the loss mask trains on (None: no mask, every target)."""
    spans = c.loss_spans()
    return None if spans is None else int((spans[:, 1] - spans[:, 0]).sum())


def _sft_checks(m: Manifest, split: str, c: Corpus, scan: _Scan, settings: dict[str, Any]) -> list[Check]:
    """A fine-tuning split's checks: no masked position is ever a target (an epoch of the packing
    loader over the first shard, every target's position against the stored mask), and with a BOS
    convention, every document starts with BOS and no BOS is anywhere else."""
    out: list[Check] = []
    if c.has_loss_mask:
        first = _first_shard(m, split)
        try:
            ok, fig = _check_mask_targets(first, settings)
        finally:
            first.close()
        out.append(Check(f"[{split}] no masked position is ever a target; every trained one is, once", ok, fig))
    bos = c.bos_id
    if bos is not None:
        starts = c.doc_offsets[:-1]
        firsts = c.gather(starts, 1).reshape(-1) if starts.size else np.zeros(0, np.int64)
        missing = int(np.count_nonzero(firsts != bos))
        extra = int(scan.hist[bos]) - scan.documents - (scan.whole_documents if bos == c.eos_id else 0)
        out.append(
            Check(
                f"[{split}] every document starts with BOS {bos} and no BOS elsewhere",
                missing == 0 and extra == 0,
                f"{missing:,} of {scan.documents:,} documents lack the BOS; {extra:,} BOS inside documents",
            )
        )
    return out


def _check_mask_targets(c: Corpus, settings: dict[str, Any]) -> tuple[bool, str]:
    """One epoch of :class:`BestFitDataset` over ``c``: every kept target's position is trained on
    and every trained position is kept exactly once."""
    from .loaders.batch import IGNORE_INDEX

    spans = c.loss_spans()
    assert spans is not None
    trained = np.zeros(c.num_tokens, np.int64)
    for a, b in spans.tolist():
        trained[a:b] = 1
    seen = np.zeros(c.num_tokens, np.int64)
    offs = c.doc_offsets
    ds = BestFitDataset(
        c,
        max_seq_len=settings["seq_len"],
        batch_size=settings["batch_size"],
        seed=settings["seed"],
        with_segments=True,
        rank=0,
        world_size=1,
    )
    for batch in ds:
        seg = batch.segments.numpy()
        lens = seg[:, 2]
        first = offs[seg[:, 0]] + seg[:, 1] + 1 - (np.cumsum(lens) - lens)
        pos = np.arange(int(lens.sum())) + np.repeat(first, lens)
        np.add.at(seen, pos[batch.targets.numpy() != IGNORE_INDEX], 1)
    wrong = int(np.count_nonzero(seen[trained == 0]))
    twice = int(np.count_nonzero(seen > 1))
    lost = int(np.count_nonzero((trained == 1) & (seen == 0)))
    fig = f"first shard: {int(trained.sum()):,} trained targets; {wrong:,} masked positions targeted, {lost:,} lost, {twice:,} twice"
    return wrong == 0 and lost == 0 and twice == 0, fig
