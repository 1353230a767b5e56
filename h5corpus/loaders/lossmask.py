"""Fine-tuning loss masks in batches: targets at positions the corpus does not train on become
:data:`~h5corpus.loaders.batch.IGNORE_INDEX`, in both loaders, whatever the cuts.

The corpus's mask (docs/FORMAT.md, "Loss masks") is defined on *predicted* tokens: position ``p``
of the split's token stream is trained on iff ``p`` lies in one of
:meth:`~h5corpus.storage.protocols.CorpusLike.loss_spans`. A batch row whose first input is the
global token ``s`` and which holds ``n`` inputs predicts positions ``s + 1 .. s + n``: input ``j``'s
target is kept iff ``s + 1 + j`` is trained on. The rule sees only positions, never token ids
(so a pad id equal to EOS cannot hide the EOS that ends an answer), and a chunk cut or a pack
boundary changes nothing: a chunk's lookahead target keeps its own position's mask.

A batch of a corpus without a mask is returned as it is (pretraining pays nothing).
"""

from __future__ import annotations

import numpy as np
import torch

from .batch import VarlenBatch


def target_ignore(spans: np.ndarray, row_starts: np.ndarray, row_lens: np.ndarray) -> np.ndarray:
    """int64 input indices (batch order: rows end to end) whose target is not trained on.

    ``spans``: (K, 2) sorted, disjoint ``[start, end)`` trained-on positions; row ``r`` holds
    ``row_lens[r]`` inputs starting at global token ``row_starts[r]``. One searchsorted over the
    batch's targets (numpy, no Python step per token)."""
    lens = np.asarray(row_lens, dtype=np.int64)
    T = int(lens.sum())
    if T == 0:
        return np.zeros(0, np.int64)
    first = np.asarray(row_starts, dtype=np.int64) + 1  # the position row r's first input predicts
    before = np.cumsum(lens) - lens
    pos = np.arange(T, dtype=np.int64) + np.repeat(first - before, lens)
    if spans.shape[0] == 0:
        return np.arange(T, dtype=np.int64)
    k = np.searchsorted(spans[:, 0], pos, side="right") - 1
    kept = (k >= 0) & (pos < spans[np.maximum(k, 0), 1])
    return np.flatnonzero(~kept).astype(np.int64)


def apply_loss_mask(batch: VarlenBatch, spans: np.ndarray | None, row_starts: np.ndarray) -> VarlenBatch:
    """``batch`` (compact, as the loaders make it) with the targets that ``spans`` does not train
    on ignored too (:func:`target_ignore`; ``row_starts``: the global token of each row's first
    input). Returns ``batch`` itself when ``spans`` is None. The new batch keeps every other field
    and ``segments``."""
    if spans is None:
        return batch
    row_cu = batch.row_cu
    assert row_cu is not None, "apply_loss_mask takes the loaders' compact batches"
    lens = np.diff(row_cu.cpu().numpy().astype(np.int64))
    extra = target_ignore(spans, row_starts, lens)
    old = batch.ignore
    ignore = extra if old is None or not old.numel() else np.union1d(old.cpu().numpy(), extra)
    out = VarlenBatch.from_compact(
        batch.tokens,
        row_cu,
        batch.cu_seqlens,
        batch.max_seqlen,
        batch.pack_lengths,
        ignore=torch.from_numpy(np.ascontiguousarray(ignore, dtype=np.int64)),
    )
    out.segments = batch.segments
    return out
