"""Who am I among the consumers of an epoch? DDP rank x DataLoader worker, resolved once.

Both loaders split an epoch's shuffled items among ``world_size * num_workers`` consumers:
consumer ``c = rank * num_workers + worker_id`` takes items ``c, c + n, c + 2n, ...``. Consumers
see disjoint items whose union is the epoch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Consumer:
    """One reader of the epoch: ``index`` in ``[0, count)``."""

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


def resolve_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world_size): explicit values win, else ``torch.distributed`` if initialized, else (0, 1)."""
    if rank is None or world_size is None:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank() if rank is None else rank
                world_size = dist.get_world_size() if world_size is None else world_size
        except ImportError:  # pragma: no cover
            pass
    rank = 0 if rank is None else int(rank)
    world_size = 1 if world_size is None else int(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    return rank, world_size


def current_consumer(rank: int | None = None, world_size: int | None = None) -> Consumer:
    """The consumer this process is, inside or outside a DataLoader worker."""
    r, w = resolve_rank(rank, world_size)
    try:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
    except ImportError:  # pragma: no cover
        info = None
    if info is None:
        return Consumer(r, w, 0, 1)
    return Consumer(r, w, int(info.id), int(info.num_workers))
