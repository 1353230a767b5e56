"""Weighted mixtures of several corpora, as part of the loaders' global plan.

``mix(sources, weights)`` returns a :class:`Mixture`: the sources' token streams end to end (one
``Corpus``-like object both loaders read, documents and shards renumbered in source order) plus the
rule that picks each epoch's *items* (best-fit: chunks; sliding window: windows) from them.

**Weights are shares of input tokens.** Source ``s`` gets ``share_s = w_s / sum(w)`` of every
epoch's ``T`` tokens (``tokens_per_epoch``). Each source reads its own endless stream: its items in
the order of its *source epoch* ``k`` (``default_rng([seed, k, s, 0x5352]).permutation``), then
those of ``k + 1``, and so on. Mixture epoch ``e`` takes from it every item whose first token lies,
counted along that stream, in ``[Q_s(e), Q_s(e + 1))`` with ``Q_s(e) = floor(e * T * share_s)``
(exact rationals), so an epoch's share of source ``s`` is within one item of ``share_s``, and a
source's items never repeat before all of them were read.

**Out of data: wrap with a per-source epoch.** A source whose quota outgrows its tokens starts its
next source epoch (a new order of the same items), within or across mixture epochs; the
summary (:meth:`Mixture.describe`) says which source epochs a mixture epoch reads. The default
``T`` is the largest at which no source wraps within mixture epoch 0: ``min_s floor(P_s / share_s)``
(``P_s`` = the source's item tokens), i.e. the epoch ends when its most demanded source is used up
once. The selected items of all sources are then interleaved by ``default_rng([seed, e, 0x4D49])``
(``shuffle=False``: source after source, each in corpus order).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..storage.protocols import CorpusLike
from ..storage.reader import open_corpus
from ..storage.readpaths import RunTable
from .partition import integer_arg

_TAG_SOURCE = 0x5352  # "SR": a source's own stream
_TAG_MIX = 0x4D49  # "MI": the interleaving of an epoch's selections


@dataclass(frozen=True)
class MixtureSource:
    """One source of a mixture: an opened split and its relative weight (tokens)."""

    name: str
    corpus: Any
    weight: float


def _open(src: CorpusLike | str | os.PathLike | tuple, split: str, read_path: str) -> CorpusLike:
    """A mixture source as an opened corpus: a manifest path opened at ``split``, a
    ``(manifest, split)`` pair, anything else (a ``Corpus``) as given."""
    if isinstance(src, tuple) and len(src) == 2:
        src, split = src
        if not isinstance(src, (str, os.PathLike)):
            raise TypeError(f"a (manifest, split) mixture source needs a manifest path, got {type(src).__name__}")
    if isinstance(src, (str, os.PathLike)):
        return open_corpus(src, split, read_path=read_path)  # type: ignore[arg-type]
    if not isinstance(src, CorpusLike):
        raise TypeError(f"a mixture source is a Corpus, a manifest path or (manifest, split), got {type(src).__name__}")
    return src


def mix(
    sources: Sequence[Any] | Mapping[str, Any],
    weights: Sequence[float] | Mapping[str, float] | None = None,
    *,
    split: str = "train",
    tokens_per_epoch: int | None = None,
    read_path: str = "auto",
) -> Mixture:
    """A :class:`Mixture` of ``sources`` (opened ``Corpus`` objects, manifest paths opened at
    ``split``, or ``(manifest, split)`` pairs; a dict names them) with token ``weights`` (relative,
    > 0; default: each source's tokens, i.e. every source read once per epoch in proportion). All
    sources must share the tokenizer's ids and the token dtype."""
    if isinstance(sources, Mapping):
        names, items = [str(k) for k in sources], list(sources.values())
    else:
        items = list(sources)
        names = [f"source{i}" for i in range(len(items))]
    if not items:
        raise ValueError("a mixture needs at least one source")
    corpora = [_open(s, split, read_path) for s in items]
    if weights is None:
        w = [float(max(c.num_tokens, 1)) for c in corpora]
    elif isinstance(weights, Mapping):
        missing = [n for n in names if n not in weights]
        if missing or len(weights) != len(names):
            raise ValueError(f"weights must name every source exactly: sources {names}, weights {list(weights)}")
        w = [weights[n] for n in names]
    else:
        w = list(weights)
    if len(w) != len(corpora):
        raise ValueError(f"{len(corpora)} sources but {len(w)} weights")
    return Mixture([MixtureSource(n, c, x) for n, c, x in zip(names, corpora, w)], tokens_per_epoch=tokens_per_epoch)


@dataclass
class EpochSelection:
    """What one mixture epoch reads (:meth:`Mixture.select`)."""

    items: np.ndarray
    """(n,) int64 global item ids in stream order."""
    source_items: list[int]
    source_tokens: list[int]
    """Input tokens per source in the epoch."""
    source_epochs: list[tuple[int, int]]
    """First and last source epoch each source reads in this mixture epoch."""
    tokens_per_epoch: int


class Mixture:
    """Sources end to end, ``Corpus``-like (what the loaders read), plus the epoch selection rule
    (module docstring). Source ``s`` holds global tokens ``[token_bases[s], token_bases[s + 1])``
    and documents ``[doc_bases[s], doc_bases[s + 1])``."""

    def __init__(self, sources: Sequence[MixtureSource], *, tokens_per_epoch: int | None = None) -> None:
        self.sources = list(sources)
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"mixture source names must be unique, got {names}")
        for s in self.sources:
            if isinstance(s.weight, bool) or not isinstance(s.weight, (int, float)) or not s.weight > 0:
                raise ValueError(f"mixture source {s.name!r}: weight must be a number > 0, got {s.weight!r}")
            if not np.isfinite(s.weight):
                raise ValueError(f"mixture source {s.name!r}: weight must be finite, got {s.weight!r}")
        first = self.sources[0].corpus
        for s in self.sources[1:]:
            c = s.corpus
            if np.dtype(c.dtype) != np.dtype(first.dtype):
                raise ValueError(f"mixture source {s.name!r}: token dtype {c.dtype} != {first.dtype} of {names[0]!r}")
            ta, tb = getattr(c, "tokenizer", None), getattr(first, "tokenizer", None)
            if ta is not None and tb is not None and not ta.same_ids(tb):
                raise ValueError(
                    f"mixture source {s.name!r}: tokenizer {ta.name!r} (sha256 {ta.sha256[:12]}) gives other ids "
                    f"than {tb.name!r} of {names[0]!r}"
                )
        self.tokens_per_epoch = (
            None if tokens_per_epoch is None else integer_arg("tokens_per_epoch", tokens_per_epoch, 1)
        )
        from fractions import Fraction  # exact shares; imported by mixtures only (100 KB per process)

        total = sum(Fraction(s.weight) for s in self.sources)
        self.shares = [Fraction(s.weight) / total for s in self.sources]
        self.dtype = np.dtype(first.dtype)
        self.eos_id = first.eos_id
        self.tokenizer = getattr(first, "tokenizer", None)
        self._index()

    def _index(self) -> None:
        cs = [s.corpus for s in self.sources]
        self.token_bases = np.concatenate([[0], np.cumsum([c.num_tokens for c in cs])]).astype(np.int64)
        self.doc_bases = np.concatenate([[0], np.cumsum([c.num_documents for c in cs])]).astype(np.int64)
        sts = [np.asarray(c.shard_token_starts[:-1], dtype=np.int64) + b for c, b in zip(cs, self.token_bases.tolist())]
        self.shard_token_starts = np.concatenate([*sts, self.token_bases[-1:]])
        #: (S + 1,) index of each source's first shard in ``shard_token_starts``
        self.shard_bases = np.concatenate([[0], np.cumsum([len(c.shard_token_starts) - 1 for c in cs])]).astype(
            np.int64
        )
        self._rtab: tuple | None = None

    # -- Corpus-like ----------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    @property
    def num_sources(self) -> int:
        return len(self.sources)

    @property
    def num_tokens(self) -> int:
        return int(self.token_bases[-1])

    @property
    def num_documents(self) -> int:
        return int(self.doc_bases[-1])

    def doc_lengths(self) -> np.ndarray:
        """(documents,) int64 tokens per document, EOS included (O(documents): for plans only)."""
        return np.concatenate([np.asarray(s.corpus.doc_lengths(), dtype=np.int64) for s in self.sources])

    @property
    def doc_offsets(self) -> np.ndarray:
        """(documents + 1,) int64 global token offset of every document boundary (O(documents);
        the loaders use :meth:`doc_offsets_range` / :meth:`doc_index_at`)."""
        return self.doc_offsets_range(0, self.num_documents)

    def doc_offsets_range(self, lo: int, hi: int) -> np.ndarray:
        """(hi - lo + 1,) int64 global offsets of document boundaries ``lo..hi`` inclusive, from
        the sources that hold them (only the index ranges asked for are read)."""
        if not 0 <= lo <= hi <= self.num_documents:
            raise IndexError(f"doc_offsets_range: [{lo:,}, {hi:,}] outside [0, {self.num_documents:,}]")
        db, tb = self.doc_bases.tolist(), self.token_bases.tolist()
        parts = []
        for s, src in enumerate(self.sources):
            a, b = max(lo, db[s]), min(hi, db[s + 1] - 1)  # this source's documents' start boundaries
            if a <= b:
                parts.append(src.corpus.doc_offsets_range(a - db[s], b - db[s])[: b - a + 1] + tb[s])
        if hi == self.num_documents:
            parts.append(self.token_bases[-1:])
        return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, np.int64)

    def doc_index_at(self, positions: np.ndarray) -> np.ndarray:
        """int64 index of the document holding each global token position (vectorized)."""
        pos = np.asarray(positions, dtype=np.int64)
        src = self.source_of_tokens(pos)
        out = np.empty(pos.shape, dtype=np.int64)
        for s in np.unique(src).tolist():
            sel = src == s
            local = self.sources[s].corpus.doc_index_at(pos[sel] - self.token_bases[s])
            out[sel] = np.asarray(local, dtype=np.int64) + self.doc_bases[s]
        return out

    @property
    def fingerprint(self) -> str:
        """sha256 over every source's fingerprint, in order (names and weights are settings)."""
        h = hashlib.sha256(b"h5corpus mixture")
        for s in self.sources:
            h.update(f"{s.corpus.fingerprint}\0".encode())
        return h.hexdigest()

    def settings(self) -> dict[str, Any]:
        """The mixture's part of a loader's settings (plain values)."""
        return {
            "sources": self.names,
            "weights": [float(s.weight) for s in self.sources],
            "tokens_per_epoch": self.tokens_per_epoch,
        }

    def source_of_tokens(self, pos: np.ndarray) -> np.ndarray:
        """Source index of each global token position."""
        return np.searchsorted(self.token_bases, np.asarray(pos, dtype=np.int64), side="right") - 1

    def tokens(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens ``[start, stop)`` of the concatenated stream (crossing sources if asked)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start:,}, {stop:,}) outside [0, {self.num_tokens:,})")
        if out is None:
            out = np.empty(stop - start, dtype=self.dtype)
        pos, s = start, int(self.source_of_tokens(start)) if start < self.num_tokens else 0
        while pos < stop:
            base, end = int(self.token_bases[s]), min(stop, int(self.token_bases[s + 1]))
            if end > pos:
                self.sources[s].corpus.tokens(pos - base, end - base, out[pos - start : end - start])
            pos, s = end, s + 1
        return out

    def gather(self, starts: np.ndarray, length: int, out: np.ndarray | None = None) -> np.ndarray:
        """``out[j] = tokens(starts[j], starts[j] + length)``; each window within one source."""
        starts = np.asarray(starts, dtype=np.int64)
        if out is None:
            out = np.empty((starts.size, length), dtype=self.dtype)
        src = self.source_of_tokens(starts)
        for s in np.unique(src).tolist():
            sel = np.flatnonzero(src == s)
            part = self.sources[s].corpus.gather(starts[sel] - self.token_bases[s], length)
            out[sel] = part
        return out

    def gather_ranges(self, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Ranges end to end (each within one source), like ``Corpus.gather_ranges``."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        total = int(lengths.sum())
        if out is None:
            out = np.empty(total, dtype=self.dtype)
        src = self.source_of_tokens(starts)
        ends = np.cumsum(lengths)
        for s in np.unique(src).tolist():
            sel = np.flatnonzero(src == s)
            part = self.sources[s].corpus.gather_ranges(starts[sel] - self.token_bases[s], lengths[sel])
            n = lengths[sel]
            at = np.repeat(ends[sel] - n - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
            out[at] = part
        return out

    def run_table(self) -> RunTable | None:
        """Every source's memory-mapped runs, positions shifted to the concatenated stream (None
        if some source is read through HDF5); built once per process."""
        key = (os.getpid(), self.num_tokens)
        if self._rtab is not None and self._rtab[0] == key:
            return self._rtab[1]
        tabs = [s.corpus.run_table() for s in self.sources]
        tab = None
        if all(t is not None for t in tabs):
            tab = RunTable.concatenate(tabs, self.token_bases[:-1])  # type: ignore[arg-type]
        self._rtab = (key, tab)
        return tab

    def cached_run_table(self) -> RunTable | None:
        """Every source's :meth:`~h5corpus.storage.reader.Corpus.cached_run_table`, positions
        shifted to the concatenated stream (None if some source's is None); not kept."""
        tabs = [s.corpus.cached_run_table() for s in self.sources]
        if any(t is None for t in tabs):
            return None
        return RunTable.concatenate(tabs, self.token_bases[:-1])  # type: ignore[arg-type]

    def prefetch(self, shards: np.ndarray) -> None:
        """Pass each source its own shards of ``shards`` (indices into :attr:`shard_token_starts`)."""
        shards = np.asarray(shards, dtype=np.int64).reshape(-1)
        src = np.searchsorted(self.shard_bases, shards, side="right") - 1
        for s in np.unique(src).tolist():
            if 0 <= s < len(self.sources):
                self.sources[s].corpus.prefetch(shards[src == s] - self.shard_bases[s])

    @property
    def remote(self) -> bool:
        """True when some source is read from object storage."""
        return any(s.corpus.remote for s in self.sources)

    def cached_shards(self) -> np.ndarray:
        """Every source's :meth:`~h5corpus.storage.reader.Corpus.cached_shards`, end to end."""
        return np.concatenate([s.corpus.cached_shards() for s in self.sources] or [np.zeros(0, bool)])

    def document(self, i: int) -> np.ndarray:
        a, b = self.doc_offsets_range(i, i + 1).tolist()
        return self.tokens(a, b)

    def loss_spans(self) -> np.ndarray | None:
        """Every source's trained-on ranges shifted to the concatenated stream; a source without a
        loss mask (a pretraining corpus) is one range over all its tokens. None when no source has
        a mask."""
        got = [s.corpus.loss_spans() for s in self.sources]
        if all(g is None for g in got):
            return None
        parts = []
        for g, lo, hi in zip(got, self.token_bases[:-1].tolist(), self.token_bases[1:].tolist()):
            parts.append(np.array([[lo, hi]], np.int64) if g is None else g + lo)
        return np.concatenate(parts).reshape(-1, 2)

    @property
    def has_loss_mask(self) -> bool:
        """True when some source has a loss mask."""
        return any(s.corpus.has_loss_mask for s in self.sources)

    def loss_spans_for(self, first: np.ndarray, last: np.ndarray) -> np.ndarray | None:
        """:meth:`~h5corpus.storage.reader.Corpus.loss_spans_for` over the concatenated stream:
        each source asked for the intervals' parts inside it (a source without a mask: one range
        over all its tokens). None when no source has a mask."""
        if not self.has_loss_mask:
            return None
        first, last = np.asarray(first, np.int64), np.asarray(last, np.int64)
        parts = []
        for s, lo, hi in zip(self.sources, self.token_bases[:-1].tolist(), self.token_bases[1:].tolist()):
            inside = (first < hi) & (last > lo)
            if not inside.any():
                continue
            if not s.corpus.has_loss_mask:
                parts.append(np.array([[lo, hi]], np.int64))
                continue
            a, b = np.maximum(first[inside], lo) - lo, np.minimum(last[inside], hi) - lo
            parts.append(s.corpus.loss_spans_for(a, b) + lo)
        return np.concatenate(parts).reshape(-1, 2) if parts else np.zeros((0, 2), np.int64)

    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["_rtab"] = None
        return d

    def __repr__(self) -> str:
        parts = ", ".join(f"{s.name}: {float(sh):.3f}" for s, sh in zip(self.sources, self.shares))
        return f"Mixture({parts}; documents={self.num_documents:,}, tokens={self.num_tokens:,})"

    # -- selection ------------------------------------------------------------------------------
    def epoch_tokens(self, source_item_tokens: Sequence[int]) -> int:
        """T: ``tokens_per_epoch``, or the default of the module docstring for these per-source
        item tokens."""
        if self.tokens_per_epoch is not None:
            return self.tokens_per_epoch
        return min(int(P / sh) for P, sh in zip(source_item_tokens, self.shares))

    def select(
        self, item_bases: np.ndarray, item_lengths: np.ndarray | None, unit: int, seed: int, epoch: int, shuffle: bool
    ) -> EpochSelection:
        """The items of mixture ``epoch``. Source ``s`` owns global items ``[item_bases[s],
        item_bases[s + 1])`` of ``item_lengths[i]`` input tokens each (None: ``unit`` each)."""
        bases = np.asarray(item_bases, dtype=np.int64)
        counts = np.diff(bases)
        P = [
            int(c) * unit if item_lengths is None else int(item_lengths[a:b].sum(dtype=np.int64))
            for c, a, b in zip(counts.tolist(), bases[:-1].tolist(), bases[1:].tolist())
        ]
        for s, p in zip(self.sources, P):
            if p == 0:
                raise ValueError(f"mixture source {s.name!r} holds no items at these settings (no tokens to read)")
        T = self.epoch_tokens(P)
        parts, epochs, toks = [], [], []
        for s in range(len(self.sources)):
            lens = None if item_lengths is None else item_lengths[bases[s] : bases[s + 1]]
            stream = _SourceStream(int(counts[s]), lens, unit, P[s], (int(seed), s), shuffle)
            q0, q1 = (int(e * T * self.shares[s]) for e in (epoch, epoch + 1))
            a0, a1 = stream.count_before(q0), stream.count_before(q1)
            ids = stream.items(a0, a1)
            parts.append(ids + bases[s])
            epochs.append((a0 // stream.n, max(a1 - 1, a0) // stream.n))
            toks.append(int(ids.size) * unit if lens is None else int(lens[ids].sum(dtype=np.int64)))
        items = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if shuffle:
            np.random.default_rng([int(seed), int(epoch), _TAG_MIX]).shuffle(items)
        return EpochSelection(items, [int(p.size) for p in parts], toks, epochs, T)

    def describe(self, sel: EpochSelection) -> list[dict[str, Any]]:
        """Per source: name, weight, target share, items and tokens in the epoch, realized share,
        source epochs read (a range ``(k0, k1)``; ``k1 > k0``: the source wrapped)."""
        total = sum(sel.source_tokens) or 1
        return [
            {
                "name": s.name,
                "weight": float(s.weight),
                "share": float(sh),
                "items": n,
                "tokens": t,
                "realized_share": t / total,
                "source_epochs": list(k),
            }
            for s, sh, n, t, k in zip(self.sources, self.shares, sel.source_items, sel.source_tokens, sel.source_epochs)
        ]


class _SourceStream:
    """One source's endless item stream: source epoch ``k`` is its items in the order
    ``default_rng([seed, k, s, 0x5352]).permutation(n)`` (``shuffle=False``: corpus order)."""

    def __init__(self, n: int, lengths: np.ndarray | None, unit: int, total: int, key: tuple[int, int], shuffle: bool):
        self.n, self.lengths, self.unit, self.total = n, lengths, unit, total
        self.key, self.shuffle = key, shuffle
        self._perm: dict[int, np.ndarray] = {}

    def order(self, k: int) -> np.ndarray:
        hit = self._perm.get(k)
        if hit is None:
            hit = np.arange(self.n, dtype=np.int64)
            if self.shuffle:
                np.random.default_rng([self.key[0], k, self.key[1], _TAG_SOURCE]).shuffle(hit)
            self._perm = {k: hit}
        return hit

    def count_before(self, q: int) -> int:
        """Stream items whose first token comes before stream token ``q``."""
        k, r = divmod(q, self.total)
        if self.lengths is None:
            return k * self.n + -(-r // self.unit)
        if r == 0:
            return k * self.n
        # item i starts after the inclusive sums of the items before it; every sum below r counts
        cum = np.cumsum(self.lengths[self.order(k)], dtype=np.int64)
        return k * self.n + 1 + int(np.searchsorted(cum, r, side="left"))

    def items(self, a: int, b: int) -> np.ndarray:
        """Local item ids at stream positions ``[a, b)``."""
        out = []
        x = a
        while x < b:
            k, i = divmod(x, self.n)
            j = min(self.n, i + (b - x))
            out.append(self.order(k)[i:j])
            x += j - i
        return np.concatenate(out) if out else np.zeros(0, np.int64)
