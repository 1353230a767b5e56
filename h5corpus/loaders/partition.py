"""Who reads what: DDP rank x DataLoader worker, and which global microbatches each one yields.

Both loaders define, per epoch, one sequence of **microbatches** (the *global sequence*): a pure
function of the corpus, the loader settings, the seed and the epoch, never of the cluster shape. On
``world_size`` ranks a training step consumes one microbatch per rank (a *global batch* = ``world_size``
consecutive microbatches of the sequence), so rank ``r`` yields microbatches ``r, r + W, r + 2W, ...``
and DataLoader worker ``w`` of ``K`` yields every K-th of its rank's share: rank-local item ``j`` is
worker ``j % K``'s, so the DataLoader's round robin over workers hands them over in rank order.

**Remainder rule** (:class:`Schedule`): an epoch of ``M`` microbatches does not fill whole steps
when ``M % W != 0``. ``drop_last=False`` (the default) wraps around: the last step is completed with
the epoch's first microbatches again (``g >= M`` yields microbatch ``g mod M``), so every rank
yields ``ceil(M / W)`` and every microbatch is yielded at least once. ``drop_last=True`` drops the
``M % W`` microbatches of the incomplete step: ``floor(M / W)`` each, none repeated. Either way every
rank yields the same count, so no collective waits for a rank that ran out.

**Positions.** A *global position* counts microbatches consumed by all ranks together: after ``s``
steps of an iteration that started at position ``P``, it is ``P + s * W``. An iteration resumed at
``P`` on any world size gives rank ``r`` microbatch ``P + r`` first; the remainder rule then applies
to the ``M - P`` microbatches left.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import get_worker_info


def distinct_sorted(values: np.ndarray) -> np.ndarray:
    """The distinct values of an int array, ascending (``np.unique`` without its import of
    ``numpy.ma``, ~1 MB in every reading process)."""
    s = np.sort(values)
    return s[np.concatenate(([True], s[1:] != s[:-1]))] if s.size else s


def integer_arg(name: str, value: Any, lo: int = 0, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi]`` (``hi`` None: unbounded), or ValueError naming ``name``.

    The one rule for every count, index and epoch the loaders take (arguments and state fields
    alike): an ``int`` or numpy integer, not a bool, float, string, None, NaN or infinity."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    v = int(value)
    if v < lo or (hi is not None and v > hi):
        span = f">= {lo:,}" if hi is None else f"in [{lo:,}, {hi:,}]"
        raise ValueError(f"{name} must be an integer {span}, got {v:,}")
    return v


@dataclass(frozen=True)
class Consumer:
    """One reader of the epoch: DataLoader worker ``worker_id`` of ``num_workers`` on DDP rank
    ``rank`` of ``world_size``; ``index`` in ``[0, count)``."""

    rank: int
    world_size: int
    worker_id: int
    num_workers: int

    @property
    def index(self) -> int:
        return self.rank * self.num_workers + self.worker_id

    @property
    def count(self) -> int:
        return self.world_size * self.num_workers


def distributed_initialized() -> bool:
    """Whether this process belongs to an initialized ``torch.distributed`` process group."""
    return bool(dist.is_available() and dist.is_initialized())


def resolve_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world_size): explicit values win, else ``torch.distributed`` if initialized, else (0, 1)."""
    if (rank is None or world_size is None) and distributed_initialized():
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    world_size = 1 if world_size is None else integer_arg("world_size", world_size, 1)
    rank = 0 if rank is None else integer_arg("rank", rank)
    if rank >= world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    return rank, world_size


def current_consumer(rank: int | None = None, world_size: int | None = None) -> Consumer:
    """The consumer this process is, inside or outside a DataLoader worker."""
    r, w = resolve_rank(rank, world_size)
    info = get_worker_info()
    if info is None:
        return Consumer(r, w, 0, 1)
    return Consumer(r, w, int(info.id), int(info.num_workers))


@dataclass(frozen=True)
class Schedule:
    """Which microbatches of the global sequence one consumer yields in one iteration.

    ``start``: the global position the iteration starts at; ``skip``: items this consumer already
    yielded of that iteration (a DataLoader worker resumed from its own state, same cluster
    shape). Rank-local item ``j`` (``j = worker, worker + K, ...``, from ``worker + K * skip``) is
    global microbatch :meth:`global_index` ``(j)``; it is yielded while :meth:`needed` ``(j)``
    microbatches exist (the remainder rule, module docstring)."""

    consumer: Consumer
    start: int = 0
    skip: int = 0
    drop_last: bool = False

    def local_items(self) -> Iterator[int]:
        """This consumer's rank-local items, in yield order (unbounded; stop at :meth:`needed`)."""
        c = self.consumer
        j = c.worker_id + c.num_workers * self.skip
        while True:
            yield j
            j += c.num_workers

    def global_index(self, j: int) -> int:
        """The global microbatch rank-local item ``j`` is, before wrapping (``mod M``)."""
        return self.start + self.consumer.rank + j * self.consumer.world_size

    def needed(self, j: int) -> int:
        """How many microbatches the epoch must hold for item ``j`` to be yielded: its whole step
        (``drop_last``), or the step's first microbatch (wrap-around)."""
        W = self.consumer.world_size
        return self.start + (j + 1) * W if self.drop_last else self.start + j * W + 1

    def position_after(self, j: int) -> int:
        """The global position once the step holding item ``j`` is consumed by every rank."""
        return self.start + (j + 1) * self.consumer.world_size

    def steps(self, total: int) -> int:
        """Items every rank yields in this iteration of an epoch of ``total`` microbatches."""
        left = max(int(total) - self.start, 0)
        W = self.consumer.world_size
        return left // W if self.drop_last else -(-left // W)

    def first_wanted(self) -> tuple[int, int]:
        """(first global microbatch this consumer yields, stride to its next ones) before wrapping."""
        c = self.consumer
        return self.global_index(c.worker_id + c.num_workers * self.skip), c.world_size * c.num_workers
