"""A worker's state: one object per worker, the same from the worker, its model runner and
(once an update committed) its LoRA manager, where vLLM's loader finds the committed weights.
Each test builds fresh stand-ins; nothing is shared between workers."""

from __future__ import annotations

from types import SimpleNamespace

from art_vllm_plugin import compat
from art_vllm_plugin.worker.lora_slot_writer import load_committed_adapter
from art_vllm_plugin.worker.state import WorkerState, worker_state


def _worker() -> SimpleNamespace:
    return SimpleNamespace(model_runner=SimpleNamespace(lora_manager=SimpleNamespace()))


def test_the_worker_and_its_runner_share_one_state():
    worker = _worker()
    state = worker_state(worker)
    assert isinstance(state, WorkerState)
    assert worker_state(worker.model_runner) is state
    assert worker_state(_worker()) is not state


def test_the_loader_returns_the_committed_model_for_an_updated_id_only():
    loaded = []

    def vllm_load(manager, request):
        loaded.append(request.lora_int_id)
        return f"read from {request.lora_path}"

    load = load_committed_adapter(vllm_load)
    manager = SimpleNamespace()
    old_path = SimpleNamespace(lora_int_id=1, lora_path="/adapters/v0")
    assert load(manager, old_path) == "read from /adapters/v0"  # no update: vLLM's loader

    state = WorkerState(committed={1: "committed v3"})
    compat.attach_state(manager, state)
    assert load(manager, old_path) == "committed v3"  # whatever path the request carries
    other = SimpleNamespace(lora_int_id=2, lora_path="/adapters/other")
    assert load(manager, other) == "read from /adapters/other"
    assert loaded == [1, 2]
