"""Fine-tuning loss masks in batches: targets at positions the corpus does not train on become
:data:`~h5corpus.loaders.batch.IGNORE_INDEX`, in both loaders, whatever the cuts.

The corpus's mask (docs/FORMAT.md, "Loss masks") is defined on *predicted* tokens: position ``p``
of the split's token stream is trained on iff ``p`` lies in one of
:meth:`~h5corpus.storage.protocols.CorpusLike.loss_spans_for`. A batch row whose first input is the
global token ``s`` and which holds ``n`` inputs predicts positions ``s + 1 .. s + n``: input ``j``'s
target is kept iff ``s + 1 + j`` is trained on. The rule sees only positions, never token ids
(so a pad id equal to EOS cannot hide the EOS that ends an answer), and a chunk cut or a pack
boundary changes nothing: a chunk's lookahead target keeps its own position's mask.

A batch of a corpus without a mask is returned as it is (pretraining pays nothing).
"""

from __future__ import annotations

import numpy as np
import torch

from ..storage.protocols import CorpusLike
from .batch import VarlenBatch, alloc_compact


def target_kept(spans: np.ndarray, row_starts: np.ndarray, row_lens: np.ndarray) -> np.ndarray:
    """bool per input (batch order: rows end to end): its target is trained on.

    ``spans``: (K, 2) sorted, disjoint ``[start, end)`` trained-on positions; row ``r`` holds
    ``row_lens[r]`` inputs starting at global token ``row_starts[r]``, so its targets are the
    positions ``row_starts[r] + 1 ...``. Interval arithmetic: two searchsorted per row, one
    bincount per batch (no search per token, no Python step per token)."""
    lens = np.asarray(row_lens, dtype=np.int64)
    T = int(lens.sum())
    first = np.asarray(row_starts, dtype=np.int64) + 1
    last = first + lens
    base = np.cumsum(lens) - lens  # where each row starts in the batch
    lo = np.searchsorted(spans[:, 1], first, side="right")  # first range ending after the row's first target
    hi = np.searchsorted(spans[:, 0], last, side="left")  # ranges starting before the row's end
    n = np.maximum(hi - lo, 0)
    row = np.repeat(np.arange(lens.size), n)
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n) + np.repeat(lo, n)
    shift = base[row] - first[row]
    a = np.maximum(spans[k, 0], first[row]) + shift
    b = np.minimum(spans[k, 1], last[row]) + shift
    edges = np.bincount(a, minlength=T + 1) - np.bincount(b, minlength=T + 1)
    return np.cumsum(edges[:T]) > 0


def target_ignore(spans: np.ndarray, row_starts: np.ndarray, row_lens: np.ndarray) -> np.ndarray:
    """int64 input indices (batch order) whose target is not trained on (:func:`target_kept`)."""
    return np.flatnonzero(~target_kept(spans, row_starts, row_lens)).astype(np.int64)


def apply_loss_mask(batch: VarlenBatch, spans: np.ndarray | None, row_starts: np.ndarray) -> VarlenBatch:
    """``batch`` (compact, on the CPU, as the loaders make it) with the targets that ``spans``
    does not train on ignored too (:func:`target_kept`; ``row_starts``: the global token of each
    row's first input), merged with the ignores it has. Returns ``batch`` itself when ``spans`` is
    None. The new batch (one copy of the compact buffer) keeps every other field and ``segments``."""
    if spans is None:
        return batch
    row_cu, cu, tokens, old = batch.row_cu, batch.cu_seqlens, batch.tokens, batch.ignore
    assert row_cu is not None and tokens is not None and old is not None, "takes the loaders' compact batches"
    rc = row_cu.numpy()
    lens = np.diff(rc).astype(np.int64)
    ignored = ~target_kept(spans, row_starts, lens)
    ignored[old.numpy()] = True
    ig = np.flatnonzero(ignored)
    seg_rows = cu.numel() == row_cu.numel()  # every row start is a segment start: equal counts, equal arrays
    pk = batch.pack_lengths
    parts = alloc_compact(
        lens.size,
        int(rc[-1]),
        batch_token_dtype(tokens),
        packs=pk.numel(),
        segments=None if seg_rows else cu.numel() - 1,
        ignored=ig.size,
    )
    parts.tokens[:] = tokens.numpy().view(parts.tokens.dtype)
    parts.row_cu[:] = rc
    if not seg_rows:
        parts.cu_seqlens[:] = cu.numpy()
    parts.pack_lengths[:] = pk.numpy()
    parts.ignore[:] = ig
    out = parts.batch(batch.max_seqlen, row_len=int(lens[0]) if lens.size and (lens == lens[0]).all() else 0)
    out.segments = batch.segments
    return out


def mask_batch(batch: VarlenBatch, corpus: CorpusLike, row_starts: np.ndarray) -> VarlenBatch:
    """:func:`apply_loss_mask` with the ranges the batch's targets need, read from ``corpus``
    (:meth:`~h5corpus.storage.protocols.CorpusLike.loss_spans_for`: only the shards its rows
    touch, loaded lazily); ``batch`` itself for a corpus without a mask."""
    assert batch.row_cu is not None, "takes the loaders' compact batches"
    first = np.asarray(row_starts, dtype=np.int64) + 1  # row r's targets: first[r] .. first[r] + len - 1
    spans = corpus.loss_spans_for(first, first + np.diff(batch.row_cu.numpy()).astype(np.int64))
    return apply_loss_mask(batch, spans, row_starts)


def batch_token_dtype(tokens: torch.Tensor) -> np.dtype:
    """The corpus dtype a compact batch's stored tokens hold (int16 bits: uint16, int32: uint32)."""
    return {torch.int16: np.dtype(np.uint16), torch.int32: np.dtype(np.uint32)}.get(tokens.dtype, np.dtype(np.int64))
