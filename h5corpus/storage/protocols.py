"""What the loaders need of a corpus: the :class:`CorpusLike` seam.

:class:`~h5corpus.storage.reader.Corpus` implements it; the loaders type against it, so that a
mixture (or a test's corpus over memory) can stand in. Positions are global token positions of one
split's stream, ``[0, num_tokens)``; documents are ``[0, num_documents)``; ranges are half-open.

Costs (format version 3, docs/FORMAT.md): every member but :meth:`CorpusLike.doc_lengths` costs
what its arguments ask for, never O(documents); :meth:`~CorpusLike.doc_lengths` is O(documents),
for computing a plan once.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from .readpaths import RunTable


@runtime_checkable
class CorpusLike(Protocol):
    """One split of a corpus as the loaders read it (see the module docstring for units)."""

    @property
    def num_documents(self) -> int:
        """Documents in the split (from the manifest: no shard is read)."""
        ...

    @property
    def num_tokens(self) -> int:
        """Tokens in the split, EOS ids included (from the manifest)."""
        ...

    @property
    def num_shards(self) -> int:
        """Shard files of the split."""
        ...

    @property
    def fingerprint(self) -> str:
        """Hex sha256 naming this token stream (from the manifest's hashes; cheap)."""
        ...

    @property
    def dtype(self) -> np.dtype:
        """Stored token dtype (uint16 or uint32)."""
        ...

    @property
    def eos_id(self) -> int:
        """The EOS token id that ends every untruncated document."""
        ...

    @property
    def shard_token_starts(self) -> np.ndarray:
        """(shards + 1,) int64 global token position where each shard starts; last = num_tokens."""
        ...

    @property
    def shard_doc_starts(self) -> np.ndarray:
        """(shards + 1,) int64 global document index where each shard starts; last = num_documents."""
        ...

    def doc_offsets_range(self, lo: int, hi: int) -> np.ndarray:
        """(hi - lo + 1,) int64 global token offsets of document boundaries ``lo..hi`` inclusive
        (``0 <= lo <= hi <= num_documents``): document ``i`` is ``[out[i-lo], out[i-lo+1])``.
        Verified; touches only the index chunks holding them."""
        ...

    def doc_index_at(self, positions: np.ndarray) -> np.ndarray:
        """int64 index of the document holding each global token position (vectorized; positions
        in ``[0, num_tokens)``)."""
        ...

    def doc_lengths(self) -> np.ndarray:
        """(documents,) int64 tokens per document, EOS included. O(documents): for plans only."""
        ...

    def tokens(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens ``[start, stop)`` of the global stream (verified)."""
        ...

    def gather(self, starts: np.ndarray, length: int, out: np.ndarray | None = None) -> np.ndarray:
        """(n, length): ``out[j] = tokens(starts[j], starts[j] + length)``."""
        ...

    def gather_ranges(self, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The ranges ``[starts[j], starts[j] + lengths[j])`` end to end, 1-D."""
        ...

    def run_table(self) -> RunTable | None:
        """Memory-mapped runs of every shard for direct copies, or None (some shard read through
        HDF5, or more shards than this process keeps open)."""
        ...

    def cached_run_table(self) -> RunTable | None:
        """:meth:`run_table` over the shards on this node now (the others as empty runs)."""
        ...

    def document(self, i: int) -> np.ndarray:
        """Tokens of document ``i``."""
        ...

    def prefetch(self, shards: np.ndarray) -> None:
        """Hint: these shards (indices into :attr:`shard_token_starts`) will be read soon; a remote
        corpus starts fetching them into its cache in the background, a local one ignores it."""
        ...

    def cached_shards(self) -> np.ndarray:
        """(shards,) bool: which shards' bytes are on this node (a local corpus: all of them; a
        remote one: those its node cache holds)."""
        ...

    @property
    def remote(self) -> bool:
        """True when shards come from object storage through a node cache (:meth:`prefetch` then
        fetches; for local files it does nothing, and loaders skip what only feeds it)."""
        ...

    def loss_spans(self) -> np.ndarray | None:
        """(K, 2) int64 sorted, disjoint global ``[start, end)`` ranges of the positions whose
        token is a trained-on target (fine-tuning loss masks; docs/FORMAT.md), or None: every
        target is trained on. The whole split's ranges (inspection)."""
        ...

    @property
    def has_loss_mask(self) -> bool:
        """True when some target is not trained on (a fine-tuning loss mask)."""
        ...

    def loss_spans_for(self, first: np.ndarray, last: np.ndarray) -> np.ndarray | None:
        """Sorted, disjoint global ranges holding every trained-on position of each interval
        ``[first[i], last[i])`` (what a batch needs), or None without a mask; read lazily."""
        ...
