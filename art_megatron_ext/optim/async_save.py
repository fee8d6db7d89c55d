"""Background saves for both layouts: the training loop waits only for an in-memory snapshot.

Why: a save writes, digests and fsyncs every byte of the state and then commits; done
inline, the training loop stalls for all of it. `Checkpointer.save_async` copies what will
be written into host memory (`snapshot_state`; the only part the caller waits for) and
hands the rest of the save, the same crash-atomic code a synchronous save runs, to a
background thread. A crash while it runs leaves the last committed generation, exactly as a
crash inside a synchronous save does.

The background thread's collectives (the barrier and broadcasts of the commit, Megatron's
finalize on the dist layout) must never interleave with the training loop's, so they run on
a gloo group of their own. One lane (a gloo group and the one thread that uses it) exists
per set of ranks and is shared by every checkpointer in the process: the resident store
makes a new checkpointer on each reload, and neither groups nor threads pile up; and since
one thread runs every background save of a group in the order the saves were queued (the
same order on every rank), two checkpointers' collectives cannot cross either.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from art_megatron_ext.optim.collective import RankGroup

__all__ = ["AsyncCheckpointer", "Lane", "checkpoint_lane", "snapshot_state"]


def snapshot_state(state: Any) -> Any:
    """A deep copy of `state` whose tensors live in (unshared) host memory.

    Dicts, lists and tuples are rebuilt; tensors are copied (a view is copied as just its
    own elements, not its whole storage); every other leaf (numbers, strings, dtypes) is
    immutable and kept.
    """
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return type(state)((k, snapshot_state(v)) for k, v in state.items())
    if isinstance(state, list):
        return [snapshot_state(v) for v in state]
    if isinstance(state, tuple):
        return tuple(snapshot_state(v) for v in state)
    return state


@dataclass
class Lane:
    """A checkpoint-only process group and the one thread that runs collectives on it."""

    group: RankGroup
    executor: ThreadPoolExecutor
    world: object  # the default group it was made under (a new default group: a new lane)

    def submit(self, fn: Any, *args: Any) -> Future:
        return self.executor.submit(fn, *args)


_LANES: dict[tuple[int, ...] | None, Lane] = {}
_LANES_LOCK = threading.Lock()


def _forget_lanes() -> None:
    # A forked child has neither the parent's thread nor a usable copy of its group.
    _LANES.clear()


os.register_at_fork(after_in_child=_forget_lanes)


def checkpoint_lane(ranks: tuple[int, ...] | None) -> Lane:
    """The lane over `ranks` (global ranks; None: the world), made on first use.

    Making one is collective over the world when torch.distributed is initialized
    (`new_group`), so every rank must ask for the same lanes in the same order.
    """
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.group.WORLD if distributed else None
    with _LANES_LOCK:
        lane = _LANES.get(ranks)
        if lane is not None and lane.world is world:
            return lane
        if lane is not None:
            lane.executor.shutdown(wait=False)
        group = None
        if distributed:
            group = dist.new_group(ranks=None if ranks is None else list(ranks), backend="gloo")
        lane = Lane(RankGroup(group), ThreadPoolExecutor(1, thread_name_prefix="ckpt-save"), world)
        _LANES[ranks] = lane
        return lane


class AsyncCheckpointer:
    """A checkpointer's `save_async` under the earlier API: `save` queues a background save
    and returns its future; `wait` and `close` are the checkpointer's."""

    def __init__(self, checkpointer: Any) -> None:
        self.checkpointer = checkpointer

    @property
    def pending_step(self) -> int | None:
        """The step of a save that was queued and has not been waited for."""
        return self.checkpointer.pending_step

    def save(self, state: Any, *, step: int, objective: str) -> Future:
        """Snapshot `state` and commit it as `step` in the background (see
        `Checkpointer.save_async`)."""
        return self.checkpointer.save_async(state, step=step, objective=objective)

    def wait(self) -> Any:
        return self.checkpointer.wait()

    def close(self) -> Any:
        return self.checkpointer.close()
