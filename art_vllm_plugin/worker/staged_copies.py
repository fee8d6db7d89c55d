"""Device copies of a staged update, and how long they must live.

Staging copies this rank's shards to the GPU on a side stream (`copy_to_device`), so the
commit's writes are device-to-device copies. Those writes are only queued: they run on the
stream the commit runs on, after whatever that stream had queued before. The staged tensors
were allocated on the side stream, so PyTorch's caching allocator would hand their blocks to
the next allocation on that stream as soon as the last reference is dropped, which may be
before the queued copy has read them (a corrupted slot, with no error anywhere).

The rule, in one place (`CopiesInFlight`): a commit hands the staged tensors to the worker's
`IN_FLIGHT` with a marker recorded on its stream after the writes were queued (a CUDA event,
`copies_done_marker`); they are released only once the marker says the copies ran
(`release_done`, called at the start of every update call). Until then they hold their device
memory: at most the shards of the updates committed since the last call.

On CPU nothing is copied (the commit reads the host tensors of the staged model, which the
model keeps alive) and nothing is held.
"""

from __future__ import annotations

from typing import Any, Protocol

from art_vllm_plugin.worker import slot_writes


class DoneMarker(Protocol):
    def query(self) -> bool:
        """True once every copy queued before the marker has run (`torch.cuda.Event.query`)."""
        ...


class CopiesInFlight:
    """Tensors that queued copies still read, each group held until its marker is done."""

    def __init__(self) -> None:
        self._held: list[tuple[DoneMarker, list]] = []

    def hold(self, tensors, done: DoneMarker) -> None:
        tensors = list(tensors)
        if tensors:
            self._held.append((done, tensors))

    def release_done(self) -> int:
        """Drop every group whose copies have run; returns how many groups were released."""
        before = len(self._held)
        self._held = [(done, ts) for done, ts in self._held if not done.query()]
        return before - len(self._held)

    def __len__(self) -> int:
        return len(self._held)


#: This worker process's copies in flight (a worker process drives one device).
IN_FLIGHT = CopiesInFlight()


def copies_done_marker(device) -> Any:
    """A CUDA event recorded on `device`'s current stream: done once every copy queued there
    before it has run."""
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def copy_to_device(writes, device):
    """`slot_writes.to_device` on a side stream of `device`, waited for before returning (the
    staging thread waits, the step loop does not)."""
    import torch

    stream = torch.cuda.Stream(device=device)
    with torch.cuda.stream(stream):
        moved = slot_writes.to_device(writes, lambda t: t.to(device, non_blocking=True))
    stream.synchronize()
    return moved
