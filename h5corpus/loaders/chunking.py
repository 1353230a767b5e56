"""Long-document chunking: every next-token pair of a document exactly once, with one token of lookahead.

A document of ``N`` tokens (EOS included, unless it was truncated at build time) has ``N - 1``
next-token pairs. A document whose pairs fit ``max_seq_len`` inputs is one segment; a longer one
becomes consecutive chunks of ``max_seq_len`` inputs plus a shorter last one. Chunk ``k`` starts at
input offset ``k * max_seq_len`` and its targets look one token ahead, so the last target of a chunk
is the first input of the next and no target is lost at a cut. Positions restart at 0 in every
chunk and chunks never attend to each other. Documents of 0 or 1 tokens have no pair and yield no
chunk.

Units: lengths and offsets are in tokens; a chunk's length is its number of *inputs* (= pairs).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np


@dataclass(frozen=True)
class Chunk:
    """One independent segment of a document: ``inputs[i]`` predicts ``targets[i]``."""

    inputs: np.ndarray
    """(n,) token ids the model reads; ``1 <= n <= max_seq_len``."""
    targets: np.ndarray
    """(n,) the token following each input in the document (one token of lookahead)."""
    position_ids: np.ndarray
    """(n,) int64 ``0 .. n-1``: positions restart in every chunk."""
    start: int
    """Offset of ``inputs[0]`` inside the document, in tokens."""
    doc: Any = None
    """The document id passed to :func:`split_tokens`, if any."""


def document_chunks(doc_lengths: np.ndarray, max_seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectorized chunking of many documents at once (no tokens read).

    ``doc_lengths``: tokens per document (EOS included). Returns three equal-length int64 arrays,
    one entry per chunk, documents in the given order and chunks in document order:
    ``(doc, start, length)`` = index into ``doc_lengths``, offset of the chunk's first input inside
    its document, and number of inputs (= pairs). A document of ``N`` tokens yields
    ``ceil((N - 1) / max_seq_len)`` chunks, all of ``max_seq_len`` inputs except the last; so
    ``length.sum() == sum(max(N - 1, 0))``.
    """
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    pairs = np.maximum(np.asarray(doc_lengths, dtype=np.int64) - 1, 0)
    n_chunks = -(-pairs // max_seq_len)
    doc = np.repeat(np.arange(pairs.size, dtype=np.int64), n_chunks)
    first = np.cumsum(n_chunks) - n_chunks  # index of each document's first chunk
    k = np.arange(doc.size, dtype=np.int64) - np.repeat(first, n_chunks)  # chunk number inside its doc
    start = k * max_seq_len
    length = np.minimum(pairs[doc] - start, max_seq_len)
    return doc, start, length


def chunk_layout(doc_lengths: np.ndarray, max_seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Deprecated name of :func:`document_chunks` (``chunk_layout`` means HDF5 chunk byte offsets
    in :mod:`h5corpus.storage.format`)."""
    warnings.warn(
        "h5corpus.loaders.chunking.chunk_layout is deprecated: use document_chunks", DeprecationWarning, stacklevel=2
    )
    return document_chunks(doc_lengths, max_seq_len)


class ChunkTable(NamedTuple):
    """Every chunk of a split in corpus order (documents in order, a document's chunks in order),
    compact: what a plan needs at 8 bytes per chunk plus 8 per document. Chunk ``c`` is
    ``length[c]`` inputs of document ``doc[c]`` from input offset :meth:`starts` ``(c)``; the rule
    is :func:`document_chunks`'s (tested equal)."""

    doc: np.ndarray
    """(C,) int32 (int64 from 2**31 documents on) document of each chunk."""
    length: np.ndarray
    """(C,) int32 inputs (= pairs) per chunk, in ``[1, max_seq_len]``."""
    first: np.ndarray
    """(N + 1,) int64 index of each document's first chunk; ``first[N] == C``."""
    max_seq_len: int

    @classmethod
    def build(cls, doc_lengths: np.ndarray, max_seq_len: int) -> ChunkTable:
        """The table of ``doc_lengths`` (tokens per document, EOS included), vectorized."""
        L = int(max_seq_len)
        if L < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        if L >= 2**31:
            raise ValueError(f"max_seq_len must be < 2**31 tokens, got {L:,}")
        pairs = np.asarray(doc_lengths, dtype=np.int64) - 1  # in-place steps below: few temporaries
        np.maximum(pairs, 0, out=pairs)
        n = pairs + (L - 1)
        n //= L  # chunks per document
        first = np.zeros(pairs.size + 1, dtype=np.int64)
        np.cumsum(n, out=first[1:])
        idx = np.int32 if pairs.size < 2**31 else np.int64
        doc = np.repeat(np.arange(pairs.size, dtype=idx), n)
        length = np.full(doc.size, L, dtype=np.int32)
        step = 1 << 18  # documents per block: bounded temporaries on any corpus size
        for a in range(0, pairs.size, step):
            b = min(a + step, pairs.size)
            has = np.flatnonzero(n[a:b]) + a
            length[first[has + 1] - 1] = pairs[has] - (n[has] - 1) * L  # each document's last chunk
        return cls(doc, length, first, L)

    @property
    def num_chunks(self) -> int:
        return int(self.doc.size)

    def starts(self, chunks: np.ndarray) -> np.ndarray:
        """(k,) int64 input offset of each chunk's first input inside its document."""
        chunks = np.asarray(chunks, dtype=np.int64)
        return (chunks - self.first[self.doc[chunks]]) * self.max_seq_len


def split_tokens(*args: Any, max_seq_len: int = 4096) -> list[Chunk]:
    """Split one document into independent chunks of at most ``max_seq_len`` inputs.

    Call as ``split_tokens(tokens, max_seq_len=...)`` or, to tag every chunk with a document id,
    ``split_tokens(doc_id, tokens, max_seq_len=...)``. ``tokens`` is the whole document (EOS
    included). Every next-token pair of the document appears in exactly one chunk:
    ``concat(inputs) == tokens[:-1]`` and ``concat(targets) == tokens[1:]``.

    >>> [len(c.inputs) for c in split_tokens([11, 12, 13, 14, 15, 99], max_seq_len=4)]
    [4, 1]
    """
    if len(args) == 1:
        doc, tokens = None, args[0]
    elif len(args) == 2:
        doc, tokens = args
    else:
        raise TypeError("split_tokens(tokens, *, max_seq_len) or split_tokens(doc_id, tokens, *, max_seq_len)")
    a = np.asarray(tokens)
    if a.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {a.shape}")
    _, start, length = document_chunks(np.array([a.size]), max_seq_len)
    return [
        Chunk(
            inputs=a[s : s + n],
            targets=a[s + 1 : s + n + 1],
            position_ids=np.arange(n, dtype=np.int64),
            start=s,
            doc=doc,
        )
        for s, n in zip(start.tolist(), length.tolist())
    ]
