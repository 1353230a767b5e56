"""The one batch type every h5corpus loader yields: flat, padding-free, with segment boundaries.

A batch is a list of *segments* (a document, a chunk of one, or the part of a sliding window
inside one document) laid end to end. Nothing else is materialized: no padding rows, no T x T mask.

Invariants (checked by :meth:`VarlenBatch.check`):

* ``input_ids``, ``targets``, ``position_ids`` are 1-D int64 of equal length T (real inputs only).
* ``cu_seqlens`` is int32, starts at 0, strictly increases, ends at T (one entry per segment + 1).
* ``position_ids`` restart at 0 at every segment start and count up by 1 inside a segment.
* ``max_seqlen`` is the longest segment, in tokens.
* ``targets[i]`` is the token that follows ``input_ids[i]`` in its source document, or
  :data:`IGNORE_INDEX` where there is none to predict inside the same document.
* ``pack_lengths`` (int32) groups consecutive segments into packs/rows: the sum equals T.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

import numpy as np
import torch

#: Target value excluded from the loss (PyTorch's cross-entropy default).
IGNORE_INDEX = -100


@dataclass
class VarlenBatch:
    """Padding-free batch of flattened segments (see the module docstring for invariants)."""

    input_ids: torch.Tensor
    """(T,) int64 token ids the model reads."""
    targets: torch.Tensor
    """(T,) int64 next-token ids, IGNORE_INDEX where no in-document target exists."""
    position_ids: torch.Tensor
    """(T,) int64 positions, restarting at 0 per segment."""
    cu_seqlens: torch.Tensor
    """(segments + 1,) int32 cumulative segment lengths with a leading 0."""
    max_seqlen: int
    """Longest segment, in tokens."""
    pack_lengths: torch.Tensor
    """(packs,) int32 real tokens per pack (logical row); unused capacity is not included."""

    # -- derived counts ---------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Real input tokens T (what the model computes over)."""
        return int(self.input_ids.numel())

    @property
    def num_targets(self) -> int:
        """Targets that count in the loss (not IGNORE_INDEX)."""
        return int((self.targets != IGNORE_INDEX).sum())

    @property
    def num_segments(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def num_packs(self) -> int:
        return int(self.pack_lengths.numel())

    # -- Hugging Face padding-free names ---------------------------------------------------------
    @property
    def cu_seq_lens_q(self) -> torch.Tensor:
        return self.cu_seqlens

    @property
    def cu_seq_lens_k(self) -> torch.Tensor:
        return self.cu_seqlens

    @property
    def max_length_q(self) -> int:
        return self.max_seqlen

    @property
    def max_length_k(self) -> int:
        return self.max_seqlen

    def hf_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for a Hugging Face model's padding-free (flash-attention) path:
        ``model(**batch.hf_kwargs())``; inputs get a leading batch axis of 1."""
        return {
            "input_ids": self.input_ids.unsqueeze(0),
            "position_ids": self.position_ids.unsqueeze(0),
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }

    # -- movement ---------------------------------------------------------------------------------
    def _map(self, fn) -> "VarlenBatch":
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = fn(v) if isinstance(v, torch.Tensor) else v
        return VarlenBatch(**kw)

    def pin_memory(self) -> "VarlenBatch":
        """Page-locked copy (DataLoader's ``pin_memory=True`` calls this)."""
        return self._map(lambda t: t.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "VarlenBatch":
        """Copy to ``device``; the single host-to-device copy site (asynchronous when pinned)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    # -- invariants -------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        T = self.num_tokens
        for name in ("input_ids", "targets", "position_ids"):
            t = getattr(self, name)
            assert t.dim() == 1 and t.numel() == T and t.dtype == torch.int64, f"{name}: shape {tuple(t.shape)} dtype {t.dtype}"
        cu = self.cu_seqlens.cpu()
        assert cu.dtype == torch.int32, f"cu_seqlens dtype {cu.dtype}, expected int32"
        assert cu.numel() >= 1 and int(cu[0]) == 0, "cu_seqlens must start at 0"
        assert int(cu[-1]) == T, f"cu_seqlens ends at {int(cu[-1])}, T = {T}"
        lens = cu[1:] - cu[:-1]
        assert bool((lens > 0).all()), "cu_seqlens must strictly increase (no empty segments)"
        assert int(lens.max()) == self.max_seqlen if lens.numel() else self.max_seqlen == 0, "max_seqlen != longest segment"
        expect_pos = torch.arange(T) - torch.repeat_interleave(cu[:-1].long(), lens.long())
        assert torch.equal(self.position_ids.cpu(), expect_pos), "position_ids must restart at 0 per segment"
        assert int(self.pack_lengths.sum()) == T, "pack_lengths must sum to the number of inputs"


def make_batch(
    inputs: Sequence[np.ndarray],
    targets: Sequence[np.ndarray],
    pack_lengths: Sequence[int] | np.ndarray,
) -> VarlenBatch:
    """Build a :class:`VarlenBatch` from per-segment input and target arrays (equal lengths, in
    order). ``pack_lengths`` gives the real tokens of each pack/row, summing to all inputs."""
    seg_lens = np.fromiter((len(a) for a in inputs), dtype=np.int64, count=len(inputs))
    if (seg_lens <= 0).any():
        raise ValueError("segments must be non-empty")
    flat_in = np.concatenate(inputs).astype(np.int64, copy=False) if len(inputs) else np.zeros(0, np.int64)
    flat_tg = np.concatenate(targets).astype(np.int64, copy=False) if len(targets) else np.zeros(0, np.int64)
    if flat_in.shape != flat_tg.shape:
        raise ValueError(f"inputs ({flat_in.size}) and targets ({flat_tg.size}) differ in length")
    return from_flat(flat_in, flat_tg, seg_lens, np.asarray(pack_lengths, dtype=np.int64))


def from_flat(flat_inputs: np.ndarray, flat_targets: np.ndarray, seg_lens: np.ndarray, pack_lengths: np.ndarray) -> VarlenBatch:
    """Build a :class:`VarlenBatch` from already flattened int64 arrays and segment lengths."""
    cu = np.zeros(seg_lens.size + 1, dtype=np.int64)
    np.cumsum(seg_lens, out=cu[1:])
    T = int(cu[-1])
    if T != flat_inputs.size:
        raise ValueError(f"segment lengths sum to {T}, inputs hold {flat_inputs.size}")
    if cu[-1] >= 2**31:
        raise ValueError("batch too large for int32 cu_seqlens")
    pos = np.arange(T, dtype=np.int64) - np.repeat(cu[:-1], seg_lens)
    return VarlenBatch(
        input_ids=torch.from_numpy(np.ascontiguousarray(flat_inputs, dtype=np.int64)),
        targets=torch.from_numpy(np.ascontiguousarray(flat_targets, dtype=np.int64)),
        position_ids=torch.from_numpy(pos),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        max_seqlen=int(seg_lens.max()) if seg_lens.size else 0,
        pack_lengths=torch.from_numpy(np.asarray(pack_lengths, dtype=np.int32)),
    )


def concat_batches(batches: Sequence[VarlenBatch]) -> VarlenBatch:
    """One :class:`VarlenBatch` holding ``batches`` end to end (segments, packs and every
    invariant preserved; ``cu_seqlens`` offset by the tokens before each part)."""
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    if len(batches) == 1:
        return batches[0]
    cu = [batches[0].cu_seqlens]
    total = batches[0].num_tokens
    for b in batches[1:]:
        cu.append(b.cu_seqlens[1:] + total)
        total += b.num_tokens
    return VarlenBatch(
        input_ids=torch.cat([b.input_ids for b in batches]),
        targets=torch.cat([b.targets for b in batches]),
        position_ids=torch.cat([b.position_ids for b in batches]),
        cu_seqlens=torch.cat(cu).to(torch.int32),
        max_seqlen=max(b.max_seqlen for b in batches),
        pack_lengths=torch.cat([b.pack_lengths for b in batches]),
    )


def collate_varlen(items: VarlenBatch | Sequence[VarlenBatch]) -> VarlenBatch:
    """``collate_fn`` for a DataLoader over h5corpus datasets: passes a :class:`VarlenBatch`
    through (``batch_size=None``, the usual way) and concatenates a list of them
    (``batch_size=k``: k dataset items become one batch). Pinning (``pin_memory=True``) goes through
    :meth:`VarlenBatch.pin_memory`; move to the GPU with ``batch.to(device, non_blocking=True)``."""
    if isinstance(items, VarlenBatch):
        return items
    return concat_batches(list(items))
