"""Sliding windows over a corpus's token stream, as padding-free :class:`~h5corpus.loaders.batch.VarlenBatch`es.

A window is ``seq_len + 1`` consecutive tokens ``w``; the model reads ``w[:-1]`` and predicts
``w[1:]``. Two ways to choose windows (``mode``):

``"epoch"`` (default)
    Every non-overlapping window exactly once per epoch, in a shuffled order that depends only on
    ``(seed, epoch)``. Windows are laid out per shard: window ``k`` of shard ``s`` starts at
    ``shard_start[s] + k * seq_len``, so consecutive windows share one token and no next-token pair
    inside a window's span is lost. A window never spans two shard files, and when ``chunk_tokens``
    is a multiple of ``seq_len`` every window starts on a chunk boundary or a whole stride inside
    one: it reads one chunk (plus one token of the next for the window that ends a chunk).
    **Dropped**: at the end of each shard, the last ``(shard_tokens - 1) % seq_len`` next-token
    pairs (fewer than ``seq_len`` per shard) and the pair that would cross into the next shard (an
    EOS followed by the next shard's first document: a cross-document pair anyway).

``"random"``
    nanoGPT-style: i.i.d. uniform starts in ``[0, num_tokens - seq_len - 1]`` of the global stream
    (a window may cross shards and documents). An "epoch" is ``windows_per_epoch`` windows (default:
    as many as epoch mode has); the starts depend only on ``(seed, epoch, window index)``.

Optional ``document_mask``: a window is split into segments at every document start inside it
(``cu_seqlens``), ``position_ids`` restart at 0 per segment, and the target that would cross from
one document into the next is :data:`~h5corpus.loaders.batch.IGNORE_INDEX`. Without it each window is one
segment and every target counts.

Consumers: an epoch's windows are split among ``world_size`` DDP ranks x DataLoader workers
(:func:`~h5corpus.loaders.partition.current_consumer`); consumer ``c`` of ``n`` takes items ``c, c+n, ...``
of the epoch's order, so consumers are disjoint and their union is the epoch. Each consumer groups
its items into batches of ``batch_size`` windows; its last batch may be short unless ``drop_last``,
which trims the epoch to a multiple of ``n * batch_size`` so every consumer yields the same number
of full batches (what DDP needs: equal step counts on every rank).

Checkpointing: :meth:`SlidingWindowDataset.state_dict` / :meth:`~SlidingWindowDataset.load_state_dict`
(the torchdata ``Stateful`` protocol, so ``StatefulDataLoader`` saves one state per worker) record
the epoch and how many windows this consumer has yielded; a resumed iterator continues with the
next batch without reading the skipped ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
from torch.utils.data import IterableDataset

from ..storage.reader import Corpus
from .batch import VarlenBatch, alloc_compact
from .partition import Consumer, current_consumer

Mode = Literal["epoch", "random"]
MODES = ("epoch", "random")

#: Version of :meth:`SlidingWindowDataset.state_dict`'s layout and of the window order; tick it
#: whenever either changes (old checkpoints are then refused instead of resuming elsewhere).
STATE_VERSION = 1

#: Random-mode starts are drawn in blocks of this many windows, each from its own seed, so any
#: window's start is computable without drawing the ones before it.
RANDOM_BLOCK = 1 << 16

#: Batches whose window starts (and document masking) are computed in one vectorized call: numpy's
#: per-call overhead, paid per block instead of per batch, would otherwise rival the batch's reads.
PLAN_BLOCK_BATCHES = 64

_TAG_EPOCH = 0x45504F43  # "EPOC": separates the two modes' random streams
_TAG_RANDOM = 0x52414E44  # "RAND"


class SlidingWindowDataset(IterableDataset):
    """Windows of ``seq_len + 1`` tokens from ``corpus``, ``batch_size`` per yielded
    :class:`~h5corpus.loaders.batch.VarlenBatch` (use ``DataLoader(ds, batch_size=None)``).

    What to iterate:
        corpus: an open :class:`~h5corpus.storage.reader.Corpus` (pickled into workers without handles).
        seq_len: model inputs per window, in tokens (the window reads ``seq_len + 1``).
        batch_size: windows per batch; a batch holds ``batch_size * seq_len`` inputs.
        mode: ``"epoch"`` (every non-overlapping window once, shuffled) or ``"random"`` (i.i.d. starts).
        document_mask: split windows at document boundaries (see the module docstring).
        windows_per_epoch: random mode only; default = the epoch-mode window count.

    How to iterate:
        seed: order = f(seed, epoch); same seed, same batches.
        rank, world_size: DDP position; default ``torch.distributed`` if initialized, else 0 of 1.
        drop_last: yield only full batches, equally many on every consumer.
        epoch: starting epoch (see :meth:`set_epoch`).
    """

    def __init__(
        self,
        corpus: Corpus,
        seq_len: int,
        batch_size: int = 8,
        seed: int = 0,
        mode: Mode = "epoch",
        document_mask: bool = False,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        windows_per_epoch: int | None = None,
        epoch: int = 0,
    ) -> None:
        super().__init__()
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1 token, got {seq_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 window, got {batch_size}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if seed < 0 or epoch < 0:
            raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
        if windows_per_epoch is not None and (mode != "random" or windows_per_epoch < 0):
            raise ValueError("windows_per_epoch is for mode='random' and must be >= 0")
        self.corpus = corpus
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.mode: Mode = mode
        self.document_mask = bool(document_mask)
        self.rank = rank
        self.world_size = world_size
        self.drop_last = bool(drop_last)
        self.windows_per_epoch = windows_per_epoch
        self.epoch = int(epoch)
        self._resume: dict[str, Any] | None = None
        self._progress: dict[str, Any] | None = None
        self._cache: dict[Any, Any] = {}  # this epoch's order or random block (never pickled)
        self._templates: dict[Any, np.ndarray] = {}  # row_cu per (batch size, seq_len)
        self._layout: tuple[Any, np.ndarray] | None = None

    # -- layout -----------------------------------------------------------------------------------
    def _shard_windows(self) -> np.ndarray:
        """(shards + 1,) cumulative epoch-mode window counts per shard (cached per corpus size)."""
        sts = self.corpus.shard_token_starts
        key = (sts.size, int(sts[-1]))
        hit = self._layout
        if hit is None or hit[0] != key:
            w = np.maximum((np.diff(sts) - 1) // self.seq_len, 0)
            hit = self._layout = (key, np.concatenate([[0], np.cumsum(w)]).astype(np.int64))
        return hit[1]

    @property
    def num_windows(self) -> int:
        """Windows in one epoch, all consumers together (before ``drop_last``)."""
        if self.mode == "random":
            if self.windows_per_epoch is not None:
                return self.windows_per_epoch if self.corpus.num_tokens > self.seq_len else 0
        return int(self._shard_windows()[-1])

    def _epoch_windows(self, consumers: int) -> int:
        total = self.num_windows
        if self.drop_last:
            per = consumers * self.batch_size
            total = total // per * per
        return total

    def _order(self, epoch: int, total: int) -> np.ndarray:
        """Epoch mode: the epoch's shuffled window ids (cached: one permutation per epoch)."""
        key = ("perm", epoch, total)
        perm = self._cache.get(key)
        if perm is None:
            dtype = np.uint32 if total < 2**32 else np.int64
            perm = np.arange(total, dtype=dtype)
            np.random.default_rng([self.seed, epoch, _TAG_EPOCH]).shuffle(perm)
            self._cache = {key: perm}
        return perm

    def _items(self, epoch: int, consumer: Consumer) -> np.ndarray:
        """This consumer's window ids (epoch mode) or sample indices (random mode), in yield order."""
        total = self._epoch_windows(consumer.count)
        if self.mode == "epoch":
            return self._order(epoch, self.num_windows)[:total][consumer.index :: consumer.count]
        return np.arange(consumer.index, total, consumer.count, dtype=np.int64)

    def _starts(self, epoch: int, items: np.ndarray) -> np.ndarray:
        """Global token position where each item's window starts."""
        items = items.astype(np.int64, copy=False)
        if self.mode == "epoch":
            cum = self._shard_windows()
            s = np.searchsorted(cum, items, side="right") - 1
            return self.corpus.shard_token_starts[s] + (items - cum[s]) * self.seq_len
        blocks = items // RANDOM_BLOCK
        b0 = int(blocks[0]) if items.size else 0
        if items.size and b0 == int(blocks[-1]) and (items.size == 1 or bool((blocks == b0).all())):
            return self._random_block(epoch, b0)[items - b0 * RANDOM_BLOCK]
        out = np.empty(items.size, dtype=np.int64)
        for b in np.unique(blocks).tolist():
            sel = blocks == b
            out[sel] = self._random_block(epoch, b)[items[sel] - b * RANDOM_BLOCK]
        return out

    def _random_block(self, epoch: int, block: int) -> np.ndarray:
        key = ("rand", epoch, block, self.corpus.num_tokens)
        starts = self._cache.get(key)
        if starts is None:
            rng = np.random.default_rng([self.seed, epoch, _TAG_RANDOM, block])
            starts = rng.integers(0, self.corpus.num_tokens - self.seq_len, size=RANDOM_BLOCK, dtype=np.int64)
            self._cache = {key: starts}
        return starts

    def plan(self, epoch: int | None = None, consumer: Consumer | None = None) -> np.ndarray:
        """Global start token of every window ``consumer`` (default: this process's) reads in
        ``epoch`` (default: the current one), in yield order. For inspection and tests."""
        consumer = consumer or current_consumer(self.rank, self.world_size)
        e = self.epoch if epoch is None else int(epoch)
        return self._starts(e, self._items(e, consumer))

    # -- epochs and checkpoints ---------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration reads (call before each epoch, as with
        DistributedSampler; with ``persistent_workers=True`` workers keep the epoch they started with)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self._progress = None
        if self._resume is not None and self._resume["epoch"] != epoch:
            self._resume = None  # a checkpoint of another epoch no longer applies
        self.epoch = int(epoch)

    def _identity(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "fingerprint": self.corpus.fingerprint,
            "mode": self.mode,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "num_windows": self.num_windows,
        }

    def state_dict(self) -> dict[str, Any]:
        """Where this consumer stands: ``{version, fingerprint, mode, seq_len, seed, drop_last,
        num_windows, epoch, consumer: [index, count] or None, windows_done}``. JSON-serializable."""
        d = self._identity()
        if self._resume is not None:
            d.update(
                epoch=self._resume["epoch"],
                consumer=self._resume["consumer"],
                windows_done=self._resume["windows_done"],
            )
        elif self._progress is not None:
            d.update(self._progress)
        else:
            d.update(epoch=self.epoch, consumer=None, windows_done=0)
        return d

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration continues this consumer's epoch after
        its ``windows_done`` windows. Refuses a state from another corpus, order or window size."""
        mine = self._identity()
        bad = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in mine.items() if state.get(k) != v]
        if bad:
            raise ValueError("cannot resume SlidingWindowDataset: " + "; ".join(bad))
        self.epoch = int(state["epoch"])
        self._progress = None
        self._resume = {
            "epoch": self.epoch,
            "consumer": state.get("consumer"),
            "windows_done": int(state["windows_done"]),
        }

    # -- iteration ----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[VarlenBatch]:
        return self._generate()

    def _generate(self) -> Iterator[VarlenBatch]:
        consumer = current_consumer(self.rank, self.world_size)
        epoch = self.epoch
        skip = 0
        resume, self._resume = self._resume, None
        if resume is not None and resume["epoch"] == epoch:
            saved = resume["consumer"]
            if saved is not None and list(saved) != [consumer.index, consumer.count]:
                raise ValueError(
                    f"cannot resume: state was saved by consumer {saved[0]} of {saved[1]} (rank x worker), this "
                    f"is consumer {consumer.index} of {consumer.count}; resume with the same world size and num_workers"
                )
            skip = resume["windows_done"]
        items = self._items(epoch, consumer)
        progress = {"epoch": epoch, "consumer": [consumer.index, consumer.count], "windows_done": min(skip, items.size)}
        self._progress = progress
        B = self.batch_size
        step = B * PLAN_BLOCK_BATCHES  # window starts are computed for this many batches at once
        for blo in range(skip, items.size, step):
            block = self._starts(epoch, items[blo : blo + step])
            mask = self._mask_plan(block) if self.document_mask else None
            for lo in range(0, block.size, B):
                starts = block[lo : lo + B]
                batch = self._batch(starts, mask, lo)
                progress["windows_done"] = blo + lo + starts.size
                yield batch

    # -- batches --------------------------------------------------------------------------------------
    def make_batch(self, starts: np.ndarray) -> VarlenBatch:
        """The compact batch of windows starting at global token positions ``starts``.

        One ``(B, seq_len + 1)`` read straight into the batch's row storage (the corpus's own
        width, e.g. 2 bytes per uint16 token; no int64 copies): row j is window j, ``row_cu`` =
        ``[0, L, 2L, ...]``, one pack per window. With document masking, ``cu_seqlens`` adds every
        document start inside a window and ``ignore`` lists the inputs whose target is the next
        document's first token. The int64 fields materialize lazily where the batch is used
        (:class:`~h5corpus.loaders.batch.VarlenBatch`)."""
        starts = np.asarray(starts, dtype=np.int64)
        return self._batch(starts, self._mask_plan(starts) if self.document_mask else None, 0)

    def _batch(self, starts: np.ndarray, mask: tuple | None, j0: int) -> VarlenBatch:
        """make_batch for windows ``j0 .. j0 + len(starts)`` of a block whose document masking
        was planned at once (:meth:`_mask_plan`; None without masking)."""
        B, L = starts.size, self.seq_len
        T = B * L
        if mask is not None:
            cut_flat, cut_ptr, ign_flat, ign_ptr, seg_max = mask
            p0, p1, q0, q1 = cut_ptr[j0], cut_ptr[j0 + B], ign_ptr[j0], ign_ptr[j0 + B]
            parts = alloc_compact(B, T, self.corpus.dtype, packs=B, segments=p1 - p0, ignored=q1 - q0)
            np.subtract(cut_flat[p0:p1], j0 * L, out=parts.cu_seqlens[:-1])
            parts.cu_seqlens[-1] = T
            np.subtract(ign_flat[q0:q1], j0 * L, out=parts.ignore)
            max_seqlen = int(seg_max[j0 : j0 + B].max()) if B else 0
        else:
            parts = alloc_compact(B, T, self.corpus.dtype, packs=B)
            max_seqlen = L
        self.corpus.gather(starts, L + 1, out=parts.tokens.reshape(B, L + 1))
        parts.row_cu[:] = self._row_starts(B)
        parts.pack_lengths[:] = L
        return parts.batch(max_seqlen, row_len=L)

    def _mask_plan(self, starts: np.ndarray) -> tuple:
        """Document masking for the windows at ``starts``, all at once (one set of numpy calls per
        block of batches): positions in the block's flat input axis (window k owns
        ``[k*L, (k+1)*L)``) of

        * every segment start (``cut_flat``: each window's start, then every document start
          strictly inside it), with ``cut_ptr[k]`` = where window k's entries begin;
        * every input whose target is ignored (``ign_flat``: the input just before a document
          start in ``(a, a + L]``, its target being the next document's first token), ``ign_ptr``;
        * ``seg_max[k]``, window k's longest segment.
        """
        B, L = starts.size, self.seq_len
        offs = self.corpus.doc_offsets
        lo = offs.searchsorted(starts, side="right")  # first document start after the window start
        counts = offs.searchsorted(starts + L, side="right") - lo  # ... up to the last target's position
        ends = np.cumsum(counts)
        n = int(ends[-1]) if B else 0
        win = np.repeat(np.arange(B, dtype=np.int64), counts)
        rel = offs[np.arange(n, dtype=np.int64) + (lo + counts - ends)[win]] - starts[win]  # in (0, L]
        at = win * L + rel
        inner = rel < L  # a document starting at rel == L starts the next window's row
        cut_flat = np.concatenate([np.arange(B, dtype=np.int64) * L, at[inner]])
        cut_flat.sort()  # window k's start, then its inner document starts, then window k + 1 ...
        cut_ptr = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(1 + np.bincount(win[inner], minlength=B), out=cut_ptr[1:])
        seg_lens = np.diff(cut_flat, append=B * L)
        seg_max = np.maximum.reduceat(seg_lens, cut_ptr[:-1]) if B else seg_lens
        ign_ptr = np.concatenate([[0], ends])
        return cut_flat, cut_ptr.tolist(), at - 1, ign_ptr.tolist(), seg_max

    def _row_starts(self, B: int) -> np.ndarray:
        """(B + 1,) int32 ``[0, L, 2L, ..., B*L]``: ``row_cu`` of a batch of B windows (cached)."""
        key = (B, self.seq_len)
        tpl = self._templates.get(key)
        if tpl is None:
            tpl = self._templates[key] = np.arange(0, B * self.seq_len + 1, self.seq_len, dtype=np.int32)
        return tpl

    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["_cache"] = {}
        d["_templates"] = {}
        d["_layout"] = None
        return d

    def __repr__(self) -> str:
        return (
            f"SlidingWindowDataset(seq_len={self.seq_len}, batch_size={self.batch_size}, mode={self.mode!r}, "
            f"seed={self.seed}, epoch={self.epoch}, document_mask={self.document_mask}, windows={self.num_windows:,})"
        )
