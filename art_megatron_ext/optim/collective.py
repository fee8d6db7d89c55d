"""The two collectives a checkpoint needs, also usable without torch.distributed.

Why: trainers call the checkpointer the same way on one process and on many; a single
process (torch.distributed not initialized) is a group of one where collectives are local.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class RankGroup:
    """Rank, world size, all-gather and broadcast over `group` (or the lone process)."""

    def __init__(self, group: Any = None) -> None:
        self._distributed = dist.is_available() and dist.is_initialized()
        self._group = group
        if self._distributed:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        else:
            if group is not None:
                raise ValueError(
                    "a process group was given but torch.distributed is not initialized"
                )
            self.rank, self.world_size = 0, 1

    @property
    def group(self) -> Any:
        """The process group given (None: the default group, or no torch.distributed)."""
        return self._group

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, indexed by rank; also the barrier of a save."""
        if not self._distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def broadcast_from_first(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self._distributed:
            return obj
        box = [obj]
        src = dist.get_global_rank(self._group, 0) if self._group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self._group)
        return box[0]
