"""What both loaders share: one global sequence of microbatches per epoch, its schedule over ranks
and workers (:mod:`~h5corpus.loaders.partition`), ``len()``, ``set_epoch()``, ``seek()`` and the
checkpoint state (:mod:`~h5corpus.loaders.state`).

A subclass defines the sequence (:meth:`GlobalSequenceDataset._num_microbatches`,
:meth:`~GlobalSequenceDataset._tokens_at`, its settings and fingerprint) and iterates a
:class:`~h5corpus.loaders.partition.Schedule` from :meth:`~GlobalSequenceDataset._begin`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from .partition import Consumer, Schedule, current_consumer, distributed_initialized, integer_arg, resolve_rank
from .state import (
    LoaderState,
    LoaderStateError,
    Writer,
    check_identity,
    merge_dataloader_state,
    parse_state,
)


def check_epoch(epoch: Any, name: str = "epoch") -> int:
    """``epoch`` as an int >= 0, or ValueError naming ``name`` (bools, floats, strings, None,
    NaN, infinities and negatives refused alike)."""
    return integer_arg(name, epoch, 0)


TokensAt = Callable[[int], tuple[int, tuple[int, ...]]]


@dataclass
class _Pending:
    """Where the next iteration starts: global ``start``; for a DataLoader worker's own state,
    its ``writer`` (the iteration's start and the items it yielded: only that worker of the same
    shape continues it); ``tokens`` at the position when known."""

    epoch: int
    start: int
    writer: Writer | None = None
    tokens: tuple[int, tuple[int, ...]] | None = None


@dataclass
class _Live:
    """The iteration running in this process."""

    epoch: int
    schedule: Schedule
    tokens_at: TokensAt | None = None
    """Set by the subclass once its plan exists."""
    yielded: int = 0


class GlobalSequenceDataset(IterableDataset):
    """Base of the loaders: an ``IterableDataset`` over one global sequence of microbatches per epoch.

    ``rank`` / ``world_size`` override ``torch.distributed``; ``drop_last`` picks the remainder rule
    (module docstring of :mod:`~h5corpus.loaders.partition`); ``epoch`` is the first epoch."""

    LOADER = "GlobalSequenceDataset"

    def __init__(self, *, rank: int | None, world_size: int | None, drop_last: bool, epoch: int) -> None:
        super().__init__()
        epoch = check_epoch(epoch)
        if rank is not None or world_size is not None:
            resolve_rank(0 if rank is None else rank, world_size)  # validates what was given
        self.rank, self.world_size = rank, world_size
        if not isinstance(drop_last, (bool, np.bool_)):
            raise ValueError(f"drop_last must be a bool, got {type(drop_last).__name__} {drop_last!r}")
        self.drop_last = bool(drop_last)
        self.epoch = epoch
        self._pending: _Pending | None = None
        self._live: _Live | None = None

    # -- what a subclass defines ----------------------------------------------------------------
    @property
    def fingerprint(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def settings_dict(self) -> dict[str, Any]:  # pragma: no cover - abstract
        """The settings the sequence depends on, as plain values (what a state records)."""
        raise NotImplementedError

    @property
    def num_sources(self) -> int:
        return 1

    def _num_microbatches(self, epoch: int) -> int:  # pragma: no cover - abstract
        """M, the length of ``epoch``'s global sequence."""
        raise NotImplementedError

    def _tokens_at(self, epoch: int, position: int) -> tuple[int, tuple[int, ...]]:  # pragma: no cover
        """Input tokens (total, per source) of the microbatches before global ``position``."""
        raise NotImplementedError

    # -- sizes and epochs -----------------------------------------------------------------------
    def num_microbatches(self, epoch: int | None = None) -> int:
        """Microbatches in the global sequence of ``epoch`` (default: the current one), all ranks."""
        return self._num_microbatches(self.epoch if epoch is None else check_epoch(epoch))

    def __len__(self) -> int:
        """Microbatches this rank yields in a whole epoch (the current one): ``ceil(M / W)``, or
        ``floor(M / W)`` with ``drop_last``; the same on every rank. Plans the epoch if needed."""
        r, w = resolve_rank(self.rank, self.world_size)
        return Schedule(Consumer(r, w, 0, 1), drop_last=self.drop_last).steps(self._num_microbatches(self.epoch))

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration plays (call before each epoch, as with
        ``DistributedSampler``; with ``persistent_workers=True`` workers keep the epoch they started
        with). A loaded state or :meth:`seek` of the same epoch is kept, of another one dropped."""
        epoch = check_epoch(epoch)
        if self._pending is not None and self._pending.epoch != epoch:
            self._pending = None
        if epoch != self.epoch:
            self._live = None
        self.epoch = epoch

    def seek(self, position: int, *, epoch: int | None = None) -> None:
        """Start the next iteration at global microbatch ``position`` of ``epoch`` (default: the
        current one) without reading the ones before it: rank ``r`` then yields microbatch
        ``position + r`` first. A step ``s`` of a ``W``-rank run starts at position ``s * W``."""
        e = self.epoch if epoch is None else check_epoch(epoch)
        integer_arg("position", position, 0)
        M = self._num_microbatches(e)
        p = integer_arg(f"position (microbatches of epoch {e})", position, 0, M)
        self.set_epoch(e)
        self._pending = _Pending(e, p)
        self._live = None

    def _with_consumed(self, epoch: int, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Mixture summary rows plus ``tokens_consumed``: each source's input tokens before the
        current position (:meth:`state_dict`) when it is in ``epoch``, else 0."""
        st = self.state_dict()
        done = st["source_tokens"] if st["epoch"] == epoch else [0] * len(rows)
        for row, t in zip(rows, done):
            row["tokens_consumed"] = t
        return rows

    # -- iteration ------------------------------------------------------------------------------
    def _begin(self) -> _Live:
        """The schedule of this process's next iteration (a pending resume applied once)."""
        consumer = current_consumer(self.rank, self.world_size)
        p, self._pending = self._pending, None
        if p is None or p.epoch != self.epoch:
            sched = Schedule(consumer, 0, 0, self.drop_last)
        elif p.writer is None:
            sched = Schedule(consumer, p.start, 0, self.drop_last)
        else:
            w = p.writer
            if (consumer.world_size, consumer.num_workers, consumer.worker_id) != (
                w.world_size,
                w.num_workers,
                w.worker,
            ):
                raise LoaderStateError(
                    f"loader state field 'writer': written by DataLoader worker {w.worker} of {w.num_workers} on "
                    f"{w.world_size} rank(s); one worker's state does not fix the rank's position on another shape "
                    f"(this is worker {consumer.worker_id} of {consumer.num_workers} on {consumer.world_size}): load "
                    "the whole StatefulDataLoader.state_dict() with dataset.load_state_dict() and build a fresh DataLoader"
                )
            sched = Schedule(consumer, w.start, w.yielded, self.drop_last)
        live = _Live(self.epoch, sched)
        self._live = live
        return live

    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["_live"] = None  # an iteration never travels into a worker; a pending resume does
        # a spawned DataLoader worker has no process group: it gets the rank this process resolved
        # (only from a live group, so a copy made before init_process_group still resolves later)
        if distributed_initialized():
            d["rank"], d["world_size"] = resolve_rank(self.rank, self.world_size)
        return d

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the global sequence stands (:mod:`~h5corpus.loaders.state`): after the last
        microbatch this process yielded (its step), or where the next iteration starts."""
        live = self._live
        if live is not None:
            c, s = live.schedule.consumer, live.schedule
            writer = Writer(c.rank, c.world_size, c.worker_id, c.num_workers, s.start, s.skip + live.yielded)
            pos = writer.position()
            epoch = live.epoch
            tokens = live.tokens_at(pos) if live.tokens_at is not None else self._tokens_at(epoch, pos)
        else:
            r, w = resolve_rank(self.rank, self.world_size)
            p = self._pending if self._pending is not None else _Pending(self.epoch, 0)
            writer = p.writer if p.writer is not None else Writer(r, w, 0, 1, p.start, 0)
            if p.tokens is None:
                pos = writer.position()
                p.tokens = self._tokens_at(p.epoch, pos) if pos else (0, (0,) * self.num_sources)
            epoch, tokens = p.epoch, p.tokens
        st = LoaderState(
            self.LOADER, self.fingerprint, self.settings_dict(), epoch, writer.position(), tokens[0], tokens[1], writer
        )
        return st.as_dict()

    def load_state_dict(self, state: dict[str, Any], *, allow_mismatch: Iterable[str] = ()) -> None:
        """Continue from a :meth:`state_dict` (or a whole ``StatefulDataLoader.state_dict()``) on
        any world size and worker count: the next iteration starts at the saved global position,
        in the saved epoch (restored). Every field is checked (:class:`LoaderStateError`, a
        ``ValueError``, names the first bad one). A state of another corpus or other settings is
        refused unless each differing field ("fingerprint" or a setting's name) is in
        ``allow_mismatch``; then the iteration starts at the first microbatch of the new sequence
        after which as many tokens are consumed as the state records."""
        st = parse_state(merge_dataloader_state(state), loader=self.LOADER, num_sources=self.num_sources)
        changed = check_identity(st, self.fingerprint, self.settings_dict(), allow_mismatch)
        M = self._num_microbatches(st.epoch)
        if changed:
            pending = _Pending(st.epoch, self._position_for_tokens(st.epoch, st.tokens, M))
        else:
            self._check_position(st, M)
            exact = st.exact
            if st.position >= M:  # the epoch is complete (its last step may have wrapped past M)
                pending = _Pending(st.epoch, M)
                self.epoch, self._pending, self._live = st.epoch, pending, None
                return
            pending = _Pending(
                st.epoch,
                st.position if exact else st.writer.start,
                None if exact else st.writer,
                (st.tokens, st.source_tokens),
            )
        self.epoch = st.epoch
        self._pending = pending
        self._live = None

    def _check_position(self, st: LoaderState, M: int) -> None:
        w = st.writer
        if w.start > M:
            raise LoaderStateError(
                f"loader state field 'writer.start': {w.start:,} is past the end of epoch {st.epoch} ({M:,} microbatches)"
            )
        end = w.start + w.world_size * Schedule(Consumer(0, w.world_size, 0, 1), w.start, 0, self.drop_last).steps(M)
        if st.position > end:
            raise LoaderStateError(
                f"loader state field 'position': {st.position:,} is past the end of epoch {st.epoch} "
                f"({M:,} microbatches; on {w.world_size} rank(s) from {w.start:,} the epoch ends at {end:,})"
            )
        tokens, per = self._tokens_at(st.epoch, st.position)
        if tokens != st.tokens:
            raise LoaderStateError(
                f"loader state field 'tokens': {st.tokens:,}, but the first {st.position:,} microbatches of epoch "
                f"{st.epoch} hold {tokens:,} input tokens (a garbled state, or one of another plan)"
            )
        if per != st.source_tokens:
            raise LoaderStateError(
                f"loader state field 'source_tokens': {list(st.source_tokens)}, the plan has {list(per)} "
                f"at position {st.position:,}"
            )

    def _position_for_tokens(self, epoch: int, tokens: int, M: int) -> int:
        """The first position whose preceding microbatches hold at least ``tokens`` input tokens
        (M if the epoch holds fewer): a bisection over :meth:`_tokens_at`."""
        lo, hi = 0, M
        while lo < hi:
            mid = (lo + hi) // 2
            if self._tokens_at(epoch, mid)[0] >= tokens:
                hi = mid
            else:
                lo = mid + 1
        return lo
