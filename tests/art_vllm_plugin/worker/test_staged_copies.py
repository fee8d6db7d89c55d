"""Staged device tensors outlive the queued copies that read them (`worker/staged_copies.py`).

A commit queues device-to-device copies from tensors staged on a side stream; if those tensors
were dropped at once, the caching allocator could hand their blocks to the next allocation on
that stream before the copies ran. The rule: the writer holds them until a marker recorded
after the copies says they ran.

- CPU twin: the hold itself, with a stand-in marker (there are no streams on CPU): a held
  tensor stays alive while the marker is pending, is released once it is done, and every
  update call of the worker releases what is done.
- GPU (`gpu`): the race itself. The consuming stream is kept busy (`torch.cuda._sleep`) so the
  copy cannot have run when the staged tensor is dropped; a same-sized allocation on the side
  stream then overwrites whatever block it gets. With the tensor held, the copy still reads
  the staged values.
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from art_vllm_plugin.worker import lora_slot_writer, staged_copies
from art_vllm_plugin.worker.staged_copies import CopiesInFlight


class PendingMarker:
    """Stands in for a CUDA event where there is no device: done when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def _staged(n: int = 3) -> list[torch.Tensor]:
    return [torch.full((4,), float(i)) for i in range(n)]


def test_held_tensors_are_released_only_after_their_copies_ran():
    held = CopiesInFlight()
    first, second = PendingMarker(), PendingMarker()
    tensors = _staged()
    refs = [weakref.ref(t) for t in tensors]
    held.hold(tensors, first)
    later = _staged(1)
    later_ref = weakref.ref(later[0])
    held.hold(later, second)
    del tensors, later
    gc.collect()

    assert held.release_done() == 0
    assert all(r() is not None for r in refs), "released while its copies were pending"

    first.done = True
    assert held.release_done() == 1
    gc.collect()
    assert all(r() is None for r in refs)
    assert later_ref() is not None and len(held) == 1  # its own marker is still pending

    second.done = True
    assert held.release_done() == 1 and len(held) == 0
    gc.collect()
    assert later_ref() is None


def test_nothing_to_hold_holds_nothing():
    held = CopiesInFlight()
    held.hold([], PendingMarker())
    assert len(held) == 0


def test_every_update_call_releases_what_has_run(monkeypatch):
    """The worker's stage, commit, rollback and abort calls each release finished copies first
    (abort shown: it needs nothing staged)."""
    held = CopiesInFlight()
    monkeypatch.setattr(staged_copies, "IN_FLIGHT", held)
    marker = PendingMarker()
    held.hold(_staged(), marker)
    worker = SimpleNamespace(model_runner=SimpleNamespace())
    assert lora_slot_writer.art_abort_lora_update(worker, "no-such-update") is False
    assert len(held) == 1
    marker.done = True
    lora_slot_writer.art_abort_lora_update(worker, "no-such-update")
    assert len(held) == 0


@pytest.mark.gpu
def test_gpu_staged_tensor_is_read_by_its_copy_after_the_writer_dropped_it():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the CPU twin above checks the hold itself)")
    device = torch.device("cuda", torch.cuda.current_device())
    n = 1 << 20
    side = torch.cuda.Stream(device=device)
    with torch.cuda.stream(side):  # staged as `copy_to_device` stages: on a side stream
        staged = torch.full((n,), 7.0, device=device)
    side.synchronize()
    slot = torch.zeros(n, device=device)
    held = CopiesInFlight()

    torch.cuda._sleep(200_000_000)  # the commit's stream is busy: the copy waits behind it
    slot.copy_(staged, non_blocking=True)
    held.hold([staged], staged_copies.copies_done_marker(device))
    del staged  # the writer drops its own reference (the staged update is gone)
    with torch.cuda.stream(side):  # the next staging allocates on the side stream
        reused = torch.full((n,), -1.0, device=device)
    torch.cuda.synchronize(device)

    assert torch.equal(slot, torch.full_like(slot, 7.0)), "the copy read a reused block"
    assert held.release_done() == 1
    del reused
