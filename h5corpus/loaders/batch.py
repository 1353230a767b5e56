"""The one batch type every h5corpus loader yields: flat, padding-free, with segment boundaries.

A batch is a list of *segments* (a document, a chunk of one, or the part of a sliding window
inside one document) laid end to end. Nothing else is materialized: no padding rows, no T x T mask.

Invariants (checked by :meth:`VarlenBatch.check`, which raises :class:`BatchError`):

* ``input_ids``, ``targets``, ``position_ids`` are 1-D int64 of equal length T (real inputs only).
* ``cu_seqlens`` is int32, starts at 0, strictly increases, ends at T (one entry per segment + 1).
* ``position_ids`` restart at 0 at every segment start and count up by 1 inside a segment.
* ``max_seqlen`` is the longest segment, in tokens.
* ``targets[i]`` is the token that follows ``input_ids[i]`` in its source document, or
  :data:`IGNORE_INDEX` where there is none to predict inside the same document.
* ``pack_lengths`` (int32) groups consecutive segments into packs/rows: the sum equals T.

Two representations, one interface
----------------------------------
*Eager* batches hold the three int64 arrays (24 bytes per token): ``VarlenBatch(input_ids=...,
targets=..., position_ids=..., cu_seqlens=..., max_seqlen=..., pack_lengths=...)``, :func:`make_batch`,
:func:`from_flat`.

*Compact* batches (what the loaders yield) hold the raw token ids of their *rows* in the corpus's
storage width, 2 bytes per token for uint16 corpora, and compute the int64 fields lazily, with torch
ops on the device where the compact tensors live, cached per object. A row of ``n`` inputs stores
``n + 1`` tokens (inputs ``row[:-1]``, targets ``row[1:]``; a sliding window, or a packed segment
with its one-token lookahead). The compact tensors, all in **one** byte buffer (one shared-memory
segment per batch through DataLoader workers, one host-to-device copy):

* ``tokens``: (T + R,) the R rows end to end. uint16 ids are kept as their bit pattern in int16,
  uint32 ids in int32 (widened with ``& 0xFFFF`` / ``& 0xFFFFFFFF``); int64 is taken as is.
  (``torch.uint16`` tensors cannot be pickled in torch 2.13, so none is ever stored in a batch.)
* ``row_cu``: (R + 1,) int32 cumulative *inputs* per row; row r occupies
  ``tokens[row_cu[r] + r : row_cu[r + 1] + r + 1]``.
* ``cu_seqlens``: (segments + 1,) int32 over inputs: the same array as ``row_cu`` for plain windows
  and packing, finer with document masking (every row start is a segment start).
* ``pack_lengths``: (packs,) int32; ``ignore``: (k,) int64 distinct input indices whose target is
  :data:`IGNORE_INDEX`.

So ``batch.to("cuda", non_blocking=True)`` moves ~2 bytes per token and the widening to int64 runs
on the GPU; ``pin_memory()`` pins only the compact buffer; pickling (workers, ``torch.save``) sends it
alone. Materializing needs no host-device synchronization (every size is known on the host). Counts
(``num_tokens``, ``num_targets``, ``num_segments``) never materialize anything. Assigning a field
(``batch.input_ids = x``) overrides it on that object (it then travels with ``.to()`` and pickling).

Loaders build compact batches with :func:`alloc_compact` (fill views in place),
:meth:`VarlenBatch.from_row_bytes` (one join of row byte views, rows = segments) or
:meth:`VarlenBatch.from_window_rows` (the same for equal rows, with optional finer segments and
ignored targets); no other module needs the buffer's layout. ``batch.segments`` optionally tags each segment with its source
(``(document, start, length)``, set by the best-fit loader on request).

One module on purpose, longer than the others: the buffer layout is private to it, and the two
representations, their lazy materialization (numpy on the CPU, torch ops elsewhere) and the
invariant checks are one type's interface, kept beside each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

#: Target value excluded from the loss (PyTorch's cross-entropy default).
IGNORE_INDEX = -100

#: Public per-token and per-segment fields, in constructor order (``max_seqlen`` is a plain int).
FIELDS = ("input_ids", "targets", "position_ids", "cu_seqlens", "max_seqlen", "pack_lengths")


class BatchError(ValueError):
    """A :class:`VarlenBatch`, or the parts of one, breaks an invariant of this module's docstring;
    the message names the invariant and where it breaks (field, index, segment or row)."""


#: Corpus token dtype -> (storage dtype in a batch, numpy view the reader writes through).
_STORAGE = {
    np.dtype(np.uint16): (torch.int16, np.dtype(np.uint16)),
    np.dtype(np.uint32): (torch.int32, np.dtype(np.uint32)),
    np.dtype(np.int64): (torch.int64, np.dtype(np.int64)),
}
#: Storage dtype -> (unsigned view for CPU widening, mask for widening elsewhere).
_WIDEN = {torch.int16: (torch.uint16, 0xFFFF), torch.int32: (torch.uint32, 0xFFFFFFFF)}
_NP_OF = {torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}
_ITEMSIZE = {torch.int16: 2, torch.int32: 4, torch.int64: 8}
_NP_VIEW = {torch.int16: np.uint16, torch.int32: np.uint32, torch.int64: np.int64}  # stored -> id dtype

Layout = tuple  # ((name, torch dtype, byte offset, numel), ...): where each compact tensor sits in the buffer
_LAYOUTS: dict[tuple, tuple[Layout, int]] = {}
_POS_TEMPLATES: dict[tuple[int, int], np.ndarray] = {}

#: Materialize fields of CPU batches with numpy (faster per call than torch ops at batch sizes);
#: tests switch it off to run the device path (torch ops) on the CPU.
_CPU_NUMPY = True
#: Devices where torch widens through an unsigned view (one pass); elsewhere cast + mask.
_UNSIGNED_VIEW_DEVICES = ("cpu",)


def _layout(
    rows: int, stored: int, storage: torch.dtype, segments: int | None, packs: int, ignored: int
) -> tuple[Layout, int]:
    """Byte layout of a compact buffer (8-byte aligned entries; ``segments=None``: ``cu_seqlens``
    is ``row_cu`` itself). Returns (layout, total bytes); cached per shape."""
    key = (rows, stored, storage, segments, packs, ignored)
    hit = _LAYOUTS.get(key)
    if hit is not None:
        return hit
    entries, off = [], 0
    for name, dt, n in (
        ("ignore", torch.int64, ignored),
        ("row_cu", torch.int32, rows + 1),
        ("cu_seqlens", torch.int32, None if segments is None else segments + 1),
        ("pack_lengths", torch.int32, packs),
        ("tokens", storage, stored),
    ):
        if n is None:  # alias of row_cu
            entries.append((name, dt, entries[-1][2], rows + 1))
            continue
        entries.append((name, dt, off, n))
        off += -(-n * _ITEMSIZE[dt] // 8) * 8
    if len(_LAYOUTS) > 4096:  # document-masked windows: one layout per (segments, ignored) seen
        _LAYOUTS.clear()
    hit = _LAYOUTS[key] = (tuple(entries), off)
    return hit


_SLOT = {"ignore": 0, "row_cu": 1, "cu_seqlens": 2, "pack_lengths": 3, "tokens": 4}  # order in a layout
_ZEROS = bytes(16)  # padding for joined buffers: every gap in a layout is < 8 bytes, row_cu[0] = 0 is 4 more


class CompactParts:
    """A freshly allocated compact buffer with writable numpy views, for loaders to fill in place
    (:func:`alloc_compact`); :meth:`batch` wraps it as a :class:`VarlenBatch` without copying.

    ``tokens`` is viewed in the corpus's unsigned dtype (uint16/uint32), so
    ``Corpus.gather(..., out=parts.tokens.reshape(R, n + 1))`` copies straight into the batch."""

    __slots__ = ("buf", "layout", "rows", "num_tokens", "tokens", "row_cu", "cu_seqlens", "pack_lengths", "ignore")

    def __init__(self, nbytes: int, layout: Layout, rows: int, num_tokens: int, token_view: np.dtype) -> None:
        self.buf = a = np.empty(nbytes, dtype=np.uint8)
        self.layout, self.rows, self.num_tokens = layout, rows, num_tokens
        ig, rc, cu, pk, tk = layout
        self.ignore = a[ig[2] : ig[2] + 8 * ig[3]].view(np.int64)
        self.row_cu = a[rc[2] : rc[2] + 4 * rc[3]].view(np.int32)
        self.cu_seqlens = a[cu[2] : cu[2] + 4 * cu[3]].view(np.int32)
        self.pack_lengths = a[pk[2] : pk[2] + 4 * pk[3]].view(np.int32)
        self.tokens = a[tk[2] : tk[2] + token_view.itemsize * tk[3]].view(token_view)

    def batch(self, max_seqlen: int, row_len: int = 0) -> VarlenBatch:
        """The filled buffer as a compact batch. ``row_len``: the common input count of every row
        (0 if rows differ; a hint that lets materialization use reshapes instead of an index)."""
        seg_rows = self.layout[2][2] == self.layout[1][2]  # cu_seqlens aliases row_cu
        return VarlenBatch._compact(
            torch.from_numpy(self.buf), self.layout, self.num_tokens, self.rows, int(max_seqlen), int(row_len), seg_rows
        )


def alloc_compact(
    rows: int, num_tokens: int, token_dtype: Any, *, packs: int, segments: int | None = None, ignored: int = 0
) -> CompactParts:
    """Allocate one compact batch of ``rows`` rows holding ``num_tokens`` inputs in total (so
    ``num_tokens + rows`` stored tokens), ``packs`` packs, ``segments`` segments (None: the rows are
    the segments and ``cu_seqlens`` is ``row_cu``) and ``ignored`` ignored targets.

    ``token_dtype``: the corpus's dtype (uint16 or uint32; int64 for ids already widened).
    Fill every view of the returned :class:`CompactParts`, then call its ``batch()``."""
    storage, view = _STORAGE[np.dtype(token_dtype)]
    layout, nbytes = _layout(rows, num_tokens + rows, storage, segments, packs, ignored)
    return CompactParts(nbytes, layout, rows, num_tokens, view)


_WINDOW_FRAMES: dict[tuple, tuple[Layout, bytes, bytes, bytes]] = {}


def _window_frame(R: int, U: int, token_dtype: Any, S: int | None, k: int) -> tuple[Layout, bytes, bytes, bytes]:
    """A compact batch of R rows of U inputs, one pack per row, ``S`` segments (None: the rows)
    and ``k`` ignored targets, as (layout, ``head``, ``mid``, ``tail``): its buffer is
    ``ignore + head + segment starts + mid + rows + tail`` (``segment starts`` absent when S is
    None). Cached per shape."""
    key = (R, U, token_dtype, S, k)
    hit = _WINDOW_FRAMES.get(key)
    if hit is not None:
        return hit
    storage, view = _STORAGE[np.dtype(token_dtype)]
    T = R * U
    layout, nbytes = _layout(R, T + R, storage, S, R, k)
    rc, cu, pk, tk = (layout[_SLOT[n]][2] for n in ("row_cu", "cu_seqlens", "pack_lengths", "tokens"))
    row_cu, packs = np.arange(0, T + 1, U, dtype=np.int32).tobytes(), np.full(R, U, dtype=np.int32).tobytes()
    after_packs = packs + bytes(tk - pk - len(packs))
    if S is None:  # cu_seqlens is row_cu
        head, mid = row_cu + bytes(pk - rc - len(row_cu)) + after_packs, b""
    else:
        head = row_cu + bytes(cu - rc - len(row_cu))
        mid = np.int32(T).tobytes() + bytes(pk - cu - 4 * (S + 1)) + after_packs
    if len(_WINDOW_FRAMES) > 4096:
        _WINDOW_FRAMES.clear()
    hit = _WINDOW_FRAMES[key] = (layout, head, mid, bytes(nbytes - tk - (T + R) * view.itemsize))
    return hit


def _widen(src: torch.Tensor) -> torch.Tensor:
    """int64 copy of stored ids (never a view of the batch's buffer). int16/int32 hold unsigned
    bit patterns: on the CPU a same-size unsigned view converts in one pass; elsewhere (CUDA)
    a cast plus mask, which needs no unsigned-dtype kernels."""
    w = _WIDEN.get(src.dtype)
    if w is None:
        return src.to(torch.int64, copy=True)
    if src.device.type in _UNSIGNED_VIEW_DEVICES:
        return src.view(w[0]).to(torch.int64)
    return src.to(torch.int64).bitwise_and_(w[1])


def _as_storage_tensor(x: Any) -> torch.Tensor:
    """Compact token ids as a tensor in a storable dtype (uint16 -> int16 bits, uint32 -> int32 bits)."""
    if isinstance(x, np.ndarray):
        dt = np.dtype(x.dtype)
        if dt in _STORAGE:
            storage, _ = _STORAGE[dt]
            return torch.from_numpy(np.ascontiguousarray(x).view(_NP_OF[storage]))
        if dt.kind not in "iu":
            raise TypeError(f"compact tokens must be integer ids, got {dt}")
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))
    t = torch.as_tensor(x)
    if t.dtype == torch.uint16:
        return t.view(torch.int16)
    if t.dtype == torch.uint32:
        return t.view(torch.int32)
    if t.dtype in (torch.int16, torch.int32, torch.int64):
        return t
    if t.is_floating_point() or t.dtype == torch.bool:
        raise TypeError(f"compact tokens must be integer ids, got {t.dtype}")
    return t.to(torch.int64)


class VarlenBatch:
    """Padding-free batch of flattened segments (see the module docstring for invariants and the
    eager/compact representations).

    Eager: ``VarlenBatch(input_ids, targets, position_ids, cu_seqlens, max_seqlen, pack_lengths)``.
    Compact: :meth:`from_compact`; in loaders :func:`alloc_compact` or :meth:`from_row_bytes`.

    Fields:
        input_ids: (T,) int64 token ids the model reads.
        targets: (T,) int64 next-token ids, IGNORE_INDEX where no in-document target exists.
        position_ids: (T,) int64 positions, restarting at 0 per segment.
        cu_seqlens: (segments + 1,) int32 cumulative segment lengths with a leading 0.
        max_seqlen: longest segment, in tokens (a Python int).
        pack_lengths: (packs,) int32 real tokens per pack (logical row); unused capacity excluded.
        segments: None, or an (segments, 3) int64 CPU tensor of ``(document index, start, length)``
            per segment: the split's document, the offset of the segment's first input inside it
            and its inputs, in tokens (``BestFitDataset(with_segments=True)`` sets it). Host
            metadata: ``.to()`` and ``pin_memory()`` leave it on the CPU, ``clone()`` copies it,
            pickling (DataLoader workers) carries it.
    """

    __slots__ = ("max_seqlen", "segments", "_own", "_lazy", "_buf", "_layout", "_T", "_R", "_row_len", "_seg_rows")

    def __init__(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        pack_lengths: torch.Tensor,
    ) -> None:
        self.max_seqlen = max_seqlen
        self.segments: torch.Tensor | None = None
        self._own: dict[str, torch.Tensor] = {
            "input_ids": input_ids,
            "targets": targets,
            "position_ids": position_ids,
            "cu_seqlens": cu_seqlens,
            "pack_lengths": pack_lengths,
        }
        self._lazy: dict[str, torch.Tensor] = {}
        self._buf: torch.Tensor | None = None
        self._layout: Layout = ()
        self._T = self._R = self._row_len = 0
        self._seg_rows = False

    # -- compact construction ---------------------------------------------------------------------
    @classmethod
    def _compact(
        cls, buf: torch.Tensor, layout: Layout, T: int, R: int, max_seqlen: int, row_len: int, seg_rows: bool
    ) -> VarlenBatch:
        self = cls.__new__(cls)
        self.max_seqlen = max_seqlen
        self.segments = None
        self._own, self._lazy = {}, {}
        self._buf, self._layout = buf, layout
        self._T, self._R, self._row_len, self._seg_rows = T, R, row_len, seg_rows
        return self

    @classmethod
    def from_compact(
        cls,
        tokens: Any,
        row_cu: Any,
        cu_seqlens: Any = None,
        max_seqlen: int | None = None,
        pack_lengths: Any = None,
        ignore: Any = None,
    ) -> VarlenBatch:
        """A compact batch from its parts (tensors or numpy arrays; copied into one buffer on the
        device of ``tokens``). Defaults: ``cu_seqlens = row_cu`` (rows are the segments),
        ``max_seqlen`` = longest segment, ``pack_lengths`` = one pack per row, ``ignore`` = none.
        Reads ``row_cu``/``cu_seqlens``/``ignore`` on the host to check them. Raises
        :class:`BatchError` (a ValueError) on parts that break the layout (see the module docstring)."""
        tok = _as_storage_tensor(tokens).reshape(-1)
        dev = tok.device
        rc = np.asarray(torch.as_tensor(row_cu).cpu(), dtype=np.int64).reshape(-1)
        R = rc.size - 1
        if R < 0 or rc[0] != 0 or (np.diff(rc) <= 0).any():
            raise BatchError("row_cu must start at 0 and strictly increase (every row has >= 1 input)")
        T = int(rc[-1])
        if T >= 2**31:
            raise BatchError(f"batch of {T:,} inputs is too large for int32 row_cu/cu_seqlens")
        if tok.numel() != T + R:
            raise BatchError(
                f"tokens hold {tok.numel():,} ids; {R} rows of {T:,} inputs need {T + R:,} (one lookahead per row)"
            )
        row_lens = np.diff(rc)
        row_len = int(row_lens[0]) if R and (row_lens == row_lens[0]).all() else 0
        seg_rows = cu_seqlens is None
        cu = rc if seg_rows else np.asarray(torch.as_tensor(cu_seqlens).cpu(), dtype=np.int64).reshape(-1)
        if not seg_rows:
            if cu.size < 1 or cu[0] != 0 or cu[-1] != T or (np.diff(cu) <= 0).any():
                raise BatchError("cu_seqlens must start at 0, strictly increase and end at T")
            if not np.isin(rc, cu).all():
                raise BatchError("every row start must be a segment start (segments never span rows)")
            seg_rows = cu.size == rc.size  # then equal to row_cu
        if max_seqlen is None:
            max_seqlen = int(np.diff(cu).max()) if cu.size > 1 else 0
        pk = torch.as_tensor(row_lens if pack_lengths is None else pack_lengths).reshape(-1).to(dev, torch.int32)
        ig = torch.zeros(0, dtype=torch.int64) if ignore is None else torch.as_tensor(ignore).reshape(-1)
        ig_host = ig.cpu().numpy()
        if ig_host.size and (ig_host.min() < 0 or ig_host.max() >= T or np.unique(ig_host).size != ig_host.size):
            raise BatchError(f"ignore must hold distinct input indices in [0, {T:,})")
        ig = ig.to(dev, torch.int64)
        return cls._assemble(
            tok,
            torch.from_numpy(rc.astype(np.int32)).to(dev),
            None if seg_rows else torch.from_numpy(cu.astype(np.int32)).to(dev),
            pk,
            ig,
            T,
            R,
            int(max_seqlen),
            row_len,
        )

    @classmethod
    def from_row_bytes(
        cls, rows: list[Any], row_ends: np.ndarray, pack_lengths: np.ndarray, token_dtype: Any, max_seqlen: int
    ) -> VarlenBatch:
        """A compact batch whose rows are its segments, assembled by one ``bytearray.join`` (a C loop
        of memcpys) of its header and ``rows``, and wrapped without a further copy.

        Args:
            rows: R >= 1 bytes-like objects (``memoryview`` slices of a memory map, numpy arrays);
                row r holds its ``n_r`` inputs plus one lookahead token, ``n_r + 1`` ids of
                ``token_dtype`` in native byte order.
            row_ends: (R,) int32 cumulative inputs after each row (``row_cu[1:]``; ``row_cu[0]`` is
                0); ``T = row_ends[-1]``.
            pack_lengths: (P,) int32 real inputs per pack, summing to T.
            token_dtype: the corpus's token dtype (uint16 or uint32; int64 for ids already widened).
            max_seqlen: the longest row, in inputs.

        Nothing is checked (this is a loader's hot path): the caller guarantees the sizes above;
        :meth:`check` verifies a result.
        """
        storage, view = _STORAGE[np.dtype(token_dtype)]
        R, P = len(rows), len(pack_lengths)
        T = int(row_ends[-1])
        layout, nbytes = _layout(R, T + R, storage, None, P, 0)
        rc, pk, tk = layout[_SLOT["row_cu"]][2], layout[_SLOT["pack_lengths"]][2], layout[_SLOT["tokens"]][2]
        z = _ZEROS
        data = bytearray().join(
            [
                z[: rc + 4],  # row_cu[0] = 0
                row_ends,
                z[: pk - rc - 4 - 4 * R],
                pack_lengths,
                z[: tk - pk - 4 * P],
                *rows,
                z[: nbytes - tk - (T + R) * view.itemsize],
            ]
        )
        return cls._compact(torch.frombuffer(data, dtype=torch.uint8), layout, T, R, int(max_seqlen), 0, True)

    @classmethod
    def from_window_rows(
        cls,
        rows: list[Any],
        row_len: int,
        token_dtype: Any,
        *,
        segment_starts: np.ndarray | None = None,
        ignore: np.ndarray | None = None,
        max_seqlen: int | None = None,
    ) -> VarlenBatch:
        """A compact batch of R equal rows (sliding windows: one pack per row), assembled like
        :meth:`from_row_bytes` by one ``bytearray.join`` of its header and ``rows``.

        Args:
            rows: R >= 1 bytes-like objects of ``row_len + 1`` ids of ``token_dtype`` each (native
                byte order): ``row_len`` inputs and one lookahead.
            row_len: inputs per row, U >= 1; ``T = R * U``, ``row_cu = [0, U, ..., T]``.
            segment_starts: None (each row is one segment, ``cu_seqlens`` is ``row_cu``), or (S,)
                C-contiguous int32 ascending segment starts holding every row start:
                ``cu_seqlens`` without its final T.
            ignore: None or (k,) C-contiguous int64 distinct input indices whose target is
                :data:`IGNORE_INDEX`.
            max_seqlen: the longest segment, in inputs (default U).

        Nothing is checked (a loader's hot path); :meth:`check` verifies a result.
        """
        R, U = len(rows), int(row_len)
        if segment_starts is None and ignore is None:
            layout, head, _, tail = _window_frame(R, U, token_dtype, None, 0)
            data = bytearray().join([head, *rows, tail])
            return cls._compact(torch.frombuffer(data, dtype=torch.uint8), layout, R * U, R, U, U, True)
        S = None if segment_starts is None else len(segment_starts)
        layout, head, mid, tail = _window_frame(R, U, token_dtype, S, 0 if ignore is None else len(ignore))
        data = bytearray().join(
            [b"" if ignore is None else ignore, head, b"" if S is None else segment_starts, mid, *rows, tail]
        )
        ms = U if max_seqlen is None else max_seqlen
        return cls._compact(torch.frombuffer(data, dtype=torch.uint8), layout, R * U, R, ms, U, S is None)

    @classmethod
    def _assemble(
        cls,
        tok: torch.Tensor,
        row_cu: torch.Tensor,
        cu: torch.Tensor | None,
        packs: torch.Tensor,
        ignore: torch.Tensor,
        T: int,
        R: int,
        max_seqlen: int,
        row_len: int,
    ) -> VarlenBatch:
        """Copy compact parts (tensors on one device, storage dtypes) into one fresh buffer there."""
        layout, nbytes = _layout(
            R, T + R, tok.dtype, None if cu is None else cu.numel() - 1, packs.numel(), ignore.numel()
        )
        buf = torch.empty(nbytes, dtype=torch.uint8, device=tok.device)
        b = cls._compact(buf, layout, T, R, max_seqlen, row_len, cu is None)
        for name, src in (
            ("tokens", tok),
            ("row_cu", row_cu),
            ("cu_seqlens", cu),
            ("pack_lengths", packs),
            ("ignore", ignore),
        ):
            if src is not None and src.numel():
                b._view(name).copy_(src.reshape(-1))
        return b

    # -- representation -----------------------------------------------------------------------------
    @property
    def is_compact(self) -> bool:
        """True if the int64 fields are derived from compact row storage (see the module docstring)."""
        return self._buf is not None

    def _view(self, name: str) -> torch.Tensor:
        _, dt, off, k = self._layout[_SLOT[name]]
        return self._buf[off : off + k * _ITEMSIZE[dt]].view(dt)  # type: ignore[index]

    def _compact_part(self, name: str) -> torch.Tensor | None:
        if self._buf is None:
            return None
        t = self._lazy.get(name)
        if t is None:
            t = self._lazy[name] = self._view(name)
        return t

    @property
    def tokens(self) -> torch.Tensor | None:
        """Compact: (T + R,) stored row tokens (int16/int32 bit patterns of unsigned ids, or
        int64). None for eager batches."""
        return self._compact_part("tokens")

    @property
    def row_cu(self) -> torch.Tensor | None:
        """Compact: (R + 1,) int32 cumulative inputs per row. None for eager batches."""
        return self._compact_part("row_cu")

    @property
    def ignore(self) -> torch.Tensor | None:
        """Compact: (k,) int64 input indices whose target is IGNORE_INDEX. None for eager batches."""
        return self._compact_part("ignore")

    @property
    def device(self) -> torch.device:
        return self._buf.device if self._buf is not None else self._own["input_ids"].device

    def _field(self, name: str) -> torch.Tensor:
        t = self._own.get(name)
        if t is not None:
            return t
        t = self._lazy.get(name)
        if t is None:
            if self._buf is None:
                raise AttributeError(f"VarlenBatch has no {name}")
            t = self._lazy[name] = self._materialize(name)
        return t

    def _set(self, name: str, value: torch.Tensor) -> None:
        self._own[name] = value
        self._lazy.clear()  # derived fields may depend on it (positions on cu_seqlens)
        if name == "cu_seqlens":
            self._seg_rows = False

    input_ids = property(
        lambda self: self._field("input_ids"),
        lambda self, v: self._set("input_ids", v),
        doc="(T,) int64 token ids the model reads.",
    )
    targets = property(
        lambda self: self._field("targets"),
        lambda self, v: self._set("targets", v),
        doc="(T,) int64 next-token ids, IGNORE_INDEX where no in-document target exists.",
    )
    position_ids = property(
        lambda self: self._field("position_ids"),
        lambda self, v: self._set("position_ids", v),
        doc="(T,) int64 positions, restarting at 0 per segment.",
    )
    cu_seqlens = property(
        lambda self: self._field("cu_seqlens"),
        lambda self, v: self._set("cu_seqlens", v),
        doc="(segments + 1,) int32 cumulative segment lengths with a leading 0.",
    )
    pack_lengths = property(
        lambda self: self._field("pack_lengths"),
        lambda self, v: self._set("pack_lengths", v),
        doc="(packs,) int32 real tokens per pack (logical row).",
    )

    # -- lazy materialization (torch ops on the buffer's device, no host-device sync) ------------------
    def _materialize(self, name: str) -> torch.Tensor:
        if name in ("cu_seqlens", "pack_lengths"):
            return self._view(name)
        if self._buf.device.type == "cpu" and _CPU_NUMPY:  # type: ignore[union-attr]
            return torch.from_numpy(self._materialize_np(name))
        if name == "position_ids":
            return self._positions()
        tok = self._compact_part("tokens")
        assert tok is not None
        R, T, U = self._R, self._T, self._row_len
        shift = 1 if name == "targets" else 0
        if U:  # equal rows: a reshape, no index
            out = _widen(tok.view(R, U + 1)[:, shift : shift + U]).reshape(-1)
        else:
            idx = self._lazy.get("_index")
            if idx is None:
                row_cu = self._compact_part("row_cu")
                assert row_cu is not None
                dev = tok.device
                idx = torch.arange(T, device=dev)
                idx += torch.repeat_interleave(torch.arange(R, device=dev), row_cu.diff(), output_size=T)
                self._lazy["_index"] = idx
            out = _widen(tok.index_select(0, idx + 1 if shift else idx))
        if shift:
            ig = self._compact_part("ignore")
            if ig is not None and ig.numel():
                out.index_fill_(0, ig, IGNORE_INDEX)
        return out

    def _positions(self) -> torch.Tensor:
        dev = self._buf.device  # type: ignore[union-attr]
        U, R = self._row_len, self._R
        if self._seg_rows and U:
            return torch.arange(U, device=dev).repeat(R)
        cu = self.cu_seqlens
        T = int(cu[-1]) if "cu_seqlens" in self._own else self._T
        return torch.arange(T, device=dev) - torch.repeat_interleave(cu[:-1].long(), cu.diff(), output_size=T)

    def _materialize_np(self, name: str) -> np.ndarray:
        """The same fields as :meth:`_materialize`, with numpy on CPU buffers (fewer, cheaper
        calls than torch's per-op dispatch at these sizes; identical values, tested)."""
        R, T, U = self._R, self._T, self._row_len
        if name == "position_ids":
            if self._seg_rows and U:
                tpl = _POS_TEMPLATES.get((U, R))
                if tpl is None:
                    if len(_POS_TEMPLATES) > 64:
                        _POS_TEMPLATES.clear()
                    tpl = _POS_TEMPLATES[(U, R)] = np.tile(np.arange(U, dtype=np.int64), R)
                return tpl.copy()
            cu = (self._own["cu_seqlens"].numpy() if "cu_seqlens" in self._own else self._np("cu_seqlens")).astype(
                np.int64
            )
            T = int(cu[-1])
            return np.arange(T, dtype=np.int64) - np.repeat(cu[:-1], np.diff(cu))
        tok = self._np("tokens")
        shift = 1 if name == "targets" else 0
        out = np.empty(T, dtype=np.int64)
        if U:
            np.copyto(out.reshape(R, U), tok.reshape(R, U + 1)[:, shift : shift + U])
        elif R and T >= 16 * R:  # long rows: one copy of per-row views (no per-token index)
            lo = (self._np("row_cu")[:-1] + np.arange(R) + shift).tolist()
            hi = (self._np("row_cu")[1:] + np.arange(R) + shift).tolist()
            np.concatenate([tok[a:b] for a, b in zip(lo, hi)], out=out)
        else:
            idx = np.arange(T, dtype=np.int64)
            idx += np.repeat(np.arange(R, dtype=np.int64) + shift, np.diff(self._np("row_cu")))
            out[:] = tok[idx]
        if shift:
            ig = self._np("ignore")
            if ig.size:
                out[ig] = IGNORE_INDEX
        return out

    def _np(self, name: str) -> np.ndarray:
        """numpy view of a compact part of a CPU buffer (tokens as their unsigned ids)."""
        _, dt, off, k = self._layout[_SLOT[name]]
        a = self._buf.numpy()[off : off + k * _ITEMSIZE[dt]]  # type: ignore[union-attr]
        return a.view(_NP_VIEW[dt] if name == "tokens" else _NP_OF[dt])

    def eager(self) -> VarlenBatch:
        """An eager batch with the same fields (materializes them; returns ``self`` if eager)."""
        if self._buf is None:
            return self
        out = VarlenBatch(
            self.input_ids, self.targets, self.position_ids, self.cu_seqlens, self.max_seqlen, self.pack_lengths
        )
        out.segments = self.segments
        return out

    # -- derived counts (never materialize) -----------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Real input tokens T (what the model computes over)."""
        t = self._own.get("input_ids")
        return int(t.numel()) if t is not None else self._T

    @property
    def num_targets(self) -> int:
        """Targets that count in the loss (not IGNORE_INDEX)."""
        if self._buf is not None and "targets" not in self._own:
            ig = self._compact_part("ignore")
            return self._T - int(ig.numel())  # type: ignore[union-attr]
        return int((self.targets != IGNORE_INDEX).sum())

    @property
    def num_segments(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def num_packs(self) -> int:
        return int(self.pack_lengths.numel())

    @property
    def num_rows(self) -> int:
        """Compact: stored rows R (windows, or packed segments). Eager: segments."""
        return self._R if self._buf is not None else self.num_segments

    @property
    def nbytes(self) -> int:
        """Bytes that pickling, ``pin_memory()`` and ``.to()`` move: the compact buffer plus any
        assigned fields (eager: its five tensors); lazily materialized fields are not counted."""
        own = sum(t.numel() * t.element_size() for t in self._own.values() if isinstance(t, torch.Tensor))
        return own + (0 if self._buf is None else int(self._buf.numel()))

    # -- Hugging Face padding-free names ---------------------------------------------------------
    @property
    def cu_seq_lens_q(self) -> torch.Tensor:
        """``cu_seqlens`` under the name transformers' flash-attention path reads."""
        return self.cu_seqlens

    @property
    def cu_seq_lens_k(self) -> torch.Tensor:
        """``cu_seqlens`` (keys span the same segments as queries)."""
        return self.cu_seqlens

    @property
    def max_length_q(self) -> int:
        """``max_seqlen`` under the name transformers' flash-attention path reads."""
        return self.max_seqlen

    @property
    def max_length_k(self) -> int:
        """``max_seqlen`` (keys span the same segments as queries)."""
        return self.max_seqlen

    def hf_kwargs(self, labels: bool = False) -> dict[str, Any]:
        """Keyword arguments that make a Hugging Face causal LM attend inside each segment only:
        ``model(**batch.hf_kwargs())`` gives the logits of every segment run on its own, as (1, T, V).

        * ``input_ids``, ``position_ids``: (1, T) int64; positions restart at 0 per segment. eager,
          sdpa and flex attention find the segments from these positions alone.
        * ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32, ``cu_seqlens``), ``max_length_q``/``max_length_k``
          (``max_seqlen``): the varlen metadata flash attention reads.
        * ``use_cache=False``: transformers derives the segments from ``position_ids`` only when no
          KV cache exists, and a model creates one by default (``config.use_cache``); with it,
          eager/sdpa/flex attend across segments, silently. Never add an ``attention_mask`` either:
          any 2-D mask switches that derivation off the same way.

        ``labels=True`` adds ``shift_labels`` (1, T) = ``targets``, with which the model's loss
        equals :func:`~h5corpus.loaders.attention.packed_loss` of its logits (mean cross-entropy over the
        targets that are not :data:`IGNORE_INDEX`; pass ``num_items_in_batch=N`` to the model for
        ``packed_loss(..., num_targets=N)``), and ``labels`` (1, T) = ``targets`` moved one place
        right (:data:`IGNORE_INDEX` first): transformers only computes a loss when ``labels`` is given,
        and code that shifts ``labels`` itself (``Trainer``'s label smoothing) then still pairs every
        logit but the batch's last with its true target. Details and measurements: docs/READING.md.
        """
        kw: dict[str, Any] = {
            "input_ids": self.input_ids.unsqueeze(0),
            "position_ids": self.position_ids.unsqueeze(0),
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
            "use_cache": False,
        }
        if labels:
            targets = self.targets
            moved = torch.full_like(targets, IGNORE_INDEX)
            moved[1:] = targets[:-1]
            kw["shift_labels"] = targets.unsqueeze(0)
            kw["labels"] = moved.unsqueeze(0)
        return kw

    # -- movement and pickling ------------------------------------------------------------------------
    def _map(self, fn) -> VarlenBatch:
        """A batch whose tensors are ``fn(tensor)``: the compact buffer and assigned/eager fields;
        lazily materialized fields are dropped (recomputed where the buffer now lives); the
        host-side ``segments`` table is shared as is."""
        new = VarlenBatch.__new__(VarlenBatch)
        new.max_seqlen = self.max_seqlen
        new.segments = self.segments
        new._own = {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in self._own.items()}
        new._buf = None if self._buf is None else fn(self._buf)
        new._layout, new._lazy = self._layout, {}
        new._T, new._R, new._row_len, new._seg_rows = self._T, self._R, self._row_len, self._seg_rows
        return new

    def clone(self) -> VarlenBatch:
        """A copy owning its memory (e.g. to keep batches received from DataLoader workers, whose
        shared-memory tensors each hold a file descriptor)."""
        new = self._map(lambda t: t.clone())
        if new.segments is not None:
            new.segments = new.segments.clone()
        return new

    def pin_memory(self) -> VarlenBatch:
        """Page-locked copy (DataLoader's ``pin_memory=True`` calls this); compact: the buffer only."""
        return self._map(lambda t: t.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = True) -> VarlenBatch:
        """Copy to ``device``; the single host-to-device copy site (asynchronous when pinned).
        Compact: one copy of the buffer (~2 bytes per token); fields materialize there on access."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def __getstate__(self) -> dict[str, Any]:
        # Never the lazy cache: a worker ships the compact buffer (and assigned fields) only. Small
        # CPU tensors travel by value (numpy arrays inside the pickle): below INLINE_PICKLE_BYTES
        # torch's shared-memory handover costs more per tensor (segment, file descriptor, mapping)
        # than the copy.
        return {
            "max_seqlen": self.max_seqlen,
            "segments": None if self.segments is None else _inline(self.segments),
            "own": {k: _inline(v) for k, v in self._own.items()},
            "buf": None if self._buf is None else _inline(self._buf),
            "layout": self._layout,
            "T": self._T,
            "R": self._R,
            "row_len": self._row_len,
            "seg_rows": self._seg_rows,
        }

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.max_seqlen = d["max_seqlen"]
        self.segments = _tensor(d.get("segments"))
        self._own = {k: _tensor(v) for k, v in d["own"].items()}
        self._buf = None if d["buf"] is None else _tensor(d["buf"])
        self._layout = d["layout"]
        self._T, self._R, self._row_len, self._seg_rows = d["T"], d["R"], d["row_len"], d["seg_rows"]
        self._lazy = {}

    def __repr__(self) -> str:
        kind = f"compact {self.tokens.dtype}, rows={self._R}" if self._buf is not None else "eager"  # type: ignore[union-attr]
        return (
            f"VarlenBatch({kind}, tokens={self.num_tokens:,}, segments={self.num_segments}, packs={self.num_packs}, "
            f"max_seqlen={self.max_seqlen}, device={self.device})"
        )

    # -- invariants -------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`BatchError` naming the first broken invariant (module docstring) and where
        it breaks; return None if every one holds. Materializes the fields. Real checks, not
        ``assert``: they run under ``python -O`` too."""
        T = self.num_tokens
        for name in ("input_ids", "targets", "position_ids"):
            t = getattr(self, name)
            if not (t.dim() == 1 and t.numel() == T and t.dtype == torch.int64):
                raise BatchError(f"{name}: shape {tuple(t.shape)} dtype {t.dtype}, expected ({T:,},) int64")
        cu = self.cu_seqlens.cpu()
        if cu.dtype != torch.int32:
            raise BatchError(f"cu_seqlens: dtype {cu.dtype}, expected int32")
        if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0:
            raise BatchError(f"cu_seqlens must be 1-D and start at 0, got shape {tuple(cu.shape)}, {cu[:1].tolist()}")
        if int(cu[-1]) != T:
            raise BatchError(f"cu_seqlens ends at {int(cu[-1]):,}, expected T = {T:,} inputs")
        cu64 = cu.numpy().astype(np.int64)
        lens = np.diff(cu64)
        if lens.size and lens.min() <= 0:
            k = int(np.argmax(lens <= 0))
            raise BatchError(
                f"cu_seqlens must strictly increase (no empty segments): segment {k} spans "
                f"[{int(cu64[k]):,}, {int(cu64[k + 1]):,})"
            )
        longest = int(lens.max()) if lens.size else 0
        if self.max_seqlen != longest:
            raise BatchError(f"max_seqlen is {self.max_seqlen:,}, the longest segment has {longest:,} tokens")
        pos = self.position_ids.cpu().numpy()
        want = np.arange(T, dtype=np.int64) - np.repeat(cu64[:-1], lens)
        if not np.array_equal(pos, want):
            i = int(np.argmax(pos != want))
            k = int(np.searchsorted(cu64, i, side="right")) - 1
            raise BatchError(
                f"position_ids must restart at 0 per segment: position_ids[{i:,}] = {int(pos[i]):,}, expected "
                f"{int(want[i]):,} (segment {k}, inputs [{int(cu64[k]):,}, {int(cu64[k + 1]):,}))"
            )
        packed = int(self.pack_lengths.sum())
        if packed != T:
            raise BatchError(f"pack_lengths sum to {packed:,}, expected T = {T:,} inputs")
        if self._buf is not None:
            self._check_compact(cu64)

    def _check_compact(self, cu: np.ndarray) -> None:
        """The compact parts' invariants (``cu``: cu_seqlens as int64)."""
        rc_t, tok, ig_t = (t.cpu() for t in (self.row_cu, self.tokens, self.ignore))  # type: ignore[union-attr]
        if rc_t.dtype != torch.int32:
            raise BatchError(f"row_cu: dtype {rc_t.dtype}, expected int32")
        rc = rc_t.numpy().astype(np.int64)
        R = rc.size - 1
        if R < 0 or rc[0] != 0:
            raise BatchError(f"row_cu must start at 0, got {rc[:1].tolist()}")
        if R and np.diff(rc).min() <= 0:
            r = int(np.argmax(np.diff(rc) <= 0))
            raise BatchError(f"row_cu must strictly increase: row {r} spans [{int(rc[r]):,}, {int(rc[r + 1]):,})")
        if int(rc[-1]) != self._T or R != self._R:
            raise BatchError(
                f"row_cu: {R} rows ending at {int(rc[-1]):,}, expected {self._R} rows ending at T = {self._T:,}"
            )
        if tok.numel() != self._T + R:
            raise BatchError(f"tokens hold {tok.numel():,} ids, expected T + R = {self._T + R:,} (n + 1 per row)")
        starts = np.isin(rc, cu)
        if not starts.all():
            r = int(np.argmax(~starts))
            raise BatchError(f"every row start must be a segment start: row {r} starts at input {int(rc[r]):,}")
        if ig_t.dtype != torch.int64:
            raise BatchError(f"ignore: dtype {ig_t.dtype}, expected int64")
        ig = ig_t.numpy()
        if np.unique(ig).size != ig.size:
            raise BatchError("ignore must hold distinct input indices")
        if ig.size and (ig.min() < 0 or ig.max() >= self._T):
            bad = int(ig[(ig < 0) | (ig >= self._T)][0])
            raise BatchError(f"ignore index {bad:,} outside [0, T = {self._T:,})")


#: CPU tensors up to this size, in bytes, pickle by value (see ``VarlenBatch.__getstate__``);
#: larger ones go through torch's shared memory (the measurements behind it: docs/READING.md,
#: "Batches").
INLINE_PICKLE_BYTES = 512 * 1024
_INLINE_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)


def _inline(t: Any) -> Any:
    if (
        isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and t.dtype in _INLINE_DTYPES
        and not t.requires_grad
        and t.numel() * t.element_size() <= INLINE_PICKLE_BYTES
    ):
        return t.numpy()
    return t


def _tensor(x: Any) -> Any:
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def make_batch(
    inputs: Sequence[np.ndarray],
    targets: Sequence[np.ndarray],
    pack_lengths: Sequence[int] | np.ndarray,
) -> VarlenBatch:
    """Build an eager :class:`VarlenBatch` from per-segment input and target arrays (equal lengths,
    in order). ``pack_lengths`` gives the real tokens of each pack/row, summing to all inputs."""
    seg_lens = np.fromiter((len(a) for a in inputs), dtype=np.int64, count=len(inputs))
    if (seg_lens <= 0).any():
        raise BatchError("segments must be non-empty")
    flat_in = np.concatenate(inputs).astype(np.int64, copy=False) if len(inputs) else np.zeros(0, np.int64)
    flat_tg = np.concatenate(targets).astype(np.int64, copy=False) if len(targets) else np.zeros(0, np.int64)
    if flat_in.shape != flat_tg.shape:
        raise BatchError(f"inputs ({flat_in.size}) and targets ({flat_tg.size}) differ in length")
    return from_flat(flat_in, flat_tg, seg_lens, np.asarray(pack_lengths, dtype=np.int64))


def from_flat(
    flat_inputs: np.ndarray, flat_targets: np.ndarray, seg_lens: np.ndarray, pack_lengths: np.ndarray
) -> VarlenBatch:
    """Build an eager :class:`VarlenBatch` from already flattened int64 arrays and segment lengths."""
    cu = np.zeros(seg_lens.size + 1, dtype=np.int64)
    np.cumsum(seg_lens, out=cu[1:])
    T = int(cu[-1])
    if T != flat_inputs.size:
        raise BatchError(f"segment lengths sum to {T}, inputs hold {flat_inputs.size}")
    if cu[-1] >= 2**31:
        raise BatchError("batch too large for int32 cu_seqlens")
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
    invariant preserved; ``cu_seqlens`` offset by the tokens before each part). Compact batches
    with the same storage dtype on one device stay compact (one new buffer); otherwise the
    result is eager. ``segments`` are concatenated when every part has them, else None."""
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    if len(batches) == 1:
        return batches[0]
    b0 = batches[0]
    if all(
        b._buf is not None and not b._own and b.tokens.dtype == b0.tokens.dtype and b.device == b0.device  # type: ignore[union-attr]
        for b in batches
    ):
        out = _concat_compact(batches)
    else:
        out = _concat_eager(batches)
    if all(b.segments is not None for b in batches):
        out.segments = torch.cat([b.segments for b in batches])  # type: ignore[misc]
    return out


def _concat_eager(batches: Sequence[VarlenBatch]) -> VarlenBatch:
    b0 = batches[0]
    cu = [b0.cu_seqlens]
    total = b0.num_tokens
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


def _concat_compact(batches: Sequence[VarlenBatch]) -> VarlenBatch:
    row_cu, cu, ign = [batches[0].row_cu[:1]], [batches[0].cu_seqlens[:1]], []  # type: ignore[index]
    off = 0
    for b in batches:
        row_cu.append(b.row_cu[1:] + off)  # type: ignore[index]
        cu.append(b.cu_seqlens[1:] + off)
        ign.append(b.ignore + off)  # type: ignore[operator]
        off += b._T
    seg_rows = all(b._seg_rows for b in batches)
    lens = {b._row_len for b in batches}
    return VarlenBatch._assemble(
        torch.cat([b.tokens for b in batches]),
        torch.cat(row_cu),
        None if seg_rows else torch.cat(cu),  # type: ignore[misc]
        torch.cat([b.pack_lengths for b in batches]),
        torch.cat(ign),
        off,
        sum(b._R for b in batches),
        max(b.max_seqlen for b in batches),
        lens.pop() if len(lens) == 1 else 0,
    )


def collate_varlen(items: VarlenBatch | Sequence[VarlenBatch]) -> VarlenBatch:
    """``collate_fn`` for a DataLoader over h5corpus datasets: passes a :class:`VarlenBatch`
    through (``batch_size=None``, the usual way) and concatenates a list of them
    (``batch_size=k``: k dataset items become one batch). Pinning (``pin_memory=True``) goes through
    :meth:`VarlenBatch.pin_memory`; move to the GPU with ``batch.to(device, non_blocking=True)``."""
    if isinstance(items, VarlenBatch):
        return items
    return concat_batches(list(items))
