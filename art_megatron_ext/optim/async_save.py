"""Asynchronous checkpoint saves: the training loop waits only for an in-memory snapshot.

Why: a save writes, digests and fsyncs every byte of the state and then commits; done
inline, the training loop stalls for all of it. Here `save` copies the state into host
memory (the only part the caller waits for: afterwards the loop may change its tensors
freely) and hands the copy to one background thread, which runs the normal crash-atomic
save of `ShardedCheckpointer` (write + XXH3 digest in one pass, fsync, barrier, manifest
rename). Saves are strictly ordered: the next `save`, `wait` or `close` first waits for the
previous commit. A crash while a background save runs leaves the last committed generation,
exactly as a crash inside a synchronous save does (the commit protocol is the same code).

Multi-rank: the background thread's barrier and broadcast must not interleave with the
training loop's collectives on the same process group, so the background saves run on a
group of their own (a gloo group over the same ranks, created collectively when the
`AsyncCheckpointer` is built).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from art_megatron_ext.optim.checkpoint import ShardedCheckpointer
from art_megatron_ext.optim.manifest import Manifest

__all__ = ["AsyncCheckpointer", "snapshot_state"]

logger = logging.getLogger(__name__)


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


class AsyncCheckpointer:
    """Background saves into `checkpointer`'s directory, one at a time, in call order.

    Building one is collective when torch.distributed is initialized (it creates the
    background group). `save` and `wait` are collective like `ShardedCheckpointer.save`.
    """

    def __init__(self, checkpointer: ShardedCheckpointer) -> None:
        group = None
        if dist.is_available() and dist.is_initialized():
            ranks = None
            if checkpointer.group.group is not None:
                ranks = dist.get_process_group_ranks(checkpointer.group.group)
            group = dist.new_group(ranks=ranks, backend="gloo")
        self._writer = ShardedCheckpointer(checkpointer.config, group=group, io=checkpointer.io)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckpt-async")
        self._pending: Future[Manifest] | None = None
        self._pending_step: int | None = None

    @property
    def pending_step(self) -> int | None:
        """The step of a save that was queued and has not been waited for."""
        return self._pending_step

    def save(self, state: Any, *, step: int, objective: str) -> Future[Manifest]:
        """Snapshot `state` and commit it as `step` in the background.

        Waits for the previous save first and raises its error if it failed (nothing new is
        queued then; the last committed generation stays). Returns the save's future.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.wait()
        snapshot = snapshot_state(state)
        self._pending = self._executor.submit(
            self._writer.save, snapshot, step=step, objective=objective
        )
        self._pending_step = step
        return self._pending

    def wait(self) -> Manifest | None:
        """Wait for the queued save's commit; returns its manifest (None if none was queued).

        A failed save raises here, once.
        """
        pending, self._pending, self._pending_step = self._pending, None, None
        if pending is None:
            return None
        return pending.result()

    def close(self) -> Manifest | None:
        """Wait for the queued save and stop the background thread."""
        try:
            return self.wait()
        finally:
            self._executor.shutdown(wait=True)
