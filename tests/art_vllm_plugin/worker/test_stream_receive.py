"""Where and on which device a worker receives a full-weight stream (`worker/stager.py`,
`worker/base_weights.stage`).

Why: a thread does not inherit the current device of the thread that started it; a CUDA call
on it would create a context on device 0 (vLLM's own worker threads set the worker's device
first: `MultiprocExecutor`'s output thread). And the stream's collectives must not run while
the forward's tensor-parallel collectives run on another communicator (a known NCCL deadlock
pattern, when two ranks issue them in different orders): an engine of several workers
receives between steps, in the stage ride every worker runs at the same step before the
forward; an engine of one worker has no such collectives and receives on its own thread while
serving goes on.

The worker here is a stand-in (a device, a runner config, a weight-transfer engine that
records the thread it receives on); vLLM's platform is the real one, its `set_device` recorded.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from art_vllm_plugin import compat, stage_progress, staging
from art_vllm_plugin.worker import base_weights, step_rides
from art_vllm_plugin.worker.stager import STREAM, stage_in_background
from art_vllm_plugin.worker.state import worker_state

pytestmark = pytest.mark.serve

#: Ceiling for a staging thread to run a job it was handed (not a timed assertion).
THREAD_CEILING_S = 60.0
PLAN = {"round": "r1", "names": ["w"], "dtypes": ["float32"], "shapes": [[2]]}


class _Engine:
    """A weight-transfer engine that delivers one tensor to its target and records where."""

    update_info_cls = SimpleNamespace  # takes no `round` or `digest`

    def __init__(self):
        self.threads: list[str] = []
        self.received = threading.Event()
        self.target = None

    def set_weight_update_target(self, target, model_config) -> None:
        self.target = target

    def reset_weight_update_target(self) -> None:
        self.target = None

    def parse_update_info(self, info: dict) -> dict:
        return info

    def receive_weights(self, info: dict) -> None:
        self.threads.append(threading.current_thread().name)
        self.target.load_weights([("w", torch.ones(2))])
        self.received.set()


class _Model(torch.nn.Module):
    """One parameter `w`, loaded as a vLLM model loads (the worker stages its shard by running
    `load_weights` on a shadow of the model: `worker/shard_stage.py`)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2), requires_grad=False)

    def load_weights(self, weights):
        for name, tensor in weights:
            getattr(self, name).data.copy_(tensor)
        return {name for name, _ in weights}


def _worker(workers_per_engine: int) -> SimpleNamespace:
    parallel = SimpleNamespace(world_size=workers_per_engine)
    config = SimpleNamespace(model_config=None, parallel_config=parallel)
    model = _Model()
    return SimpleNamespace(
        rank=0,
        device=torch.device("cpu"),
        weight_transfer_engine=_Engine(),
        model_runner=SimpleNamespace(vllm_config=config, get_model=lambda: model),
    )


@pytest.fixture
def device_calls(monkeypatch) -> list:
    """(thread name, device) of every `current_platform.set_device` call."""
    calls: list = []
    platform = compat.load(compat.names.CURRENT_PLATFORM)

    def set_device(device) -> None:
        calls.append((threading.current_thread().name, device))

    monkeypatch.setattr(platform, "set_device", set_device)
    return calls


def test_a_staging_thread_uses_the_workers_device_before_its_first_job(device_calls):
    worker = _worker(1)
    ran = threading.Event()
    seen: list = []

    def job() -> None:
        seen.append((threading.current_thread().name, list(device_calls)))
        ran.set()

    stage_in_background(worker, job, STREAM)
    assert ran.wait(THREAD_CEILING_S)
    thread = f"art-{STREAM}"
    assert seen == [(thread, [(thread, worker.device)])]


def _stage_ride(worker, marker_dir) -> list:
    """The stream's stage ride, run as a step runs it: under the weights lock, before the
    forward."""
    ride = (step_rides.BASE_STAGE, "t1", (PLAN, str(marker_dir), None))
    with worker_state(worker).weights_lock:
        return step_rides.run(worker, [ride])


def test_an_engine_of_several_workers_receives_between_steps(tmp_path, device_calls):
    worker = _worker(2)
    _stage_ride(worker, tmp_path)
    # received on the step's own thread, before the ride returned (so before the forward)
    assert worker.weight_transfer_engine.threads == [threading.current_thread().name]
    assert staging.poll(tmp_path, [0]) == ([0], {})
    assert worker_state(worker).staged_base["t1"].shard.names == {"w"}


def test_an_engine_of_one_worker_receives_on_its_own_thread(tmp_path, device_calls):
    worker = _worker(1)
    _stage_ride(worker, tmp_path)
    engine = worker.weight_transfer_engine
    assert engine.received.wait(THREAD_CEILING_S)
    assert engine.threads == [f"art-{STREAM}"]
    assert (f"art-{STREAM}", worker.device) in device_calls


def test_a_stream_stage_counts_what_arrived_in_the_workers_progress_record(tmp_path):
    """The API server's stall deadline and `GET /art/v1/weights` read this record
    (`stage_progress`): the sink counts each checkpoint tensor as it arrives."""
    worker = _worker(2)
    _stage_ride(worker, tmp_path)
    (record,) = stage_progress.read(tmp_path).values()
    assert (record.rank, record.bytes, record.tensors) == (0, 8, 1)  # one float32 tensor of 2


def test_a_files_stage_counts_what_it_read_in_the_workers_progress_record(tmp_path):
    from safetensors.torch import save_file

    stage_dir, marker_dir = tmp_path / "stage", tmp_path / "markers"
    stage_dir.mkdir()
    marker_dir.mkdir()
    save_file(
        {"w": torch.ones(2), "b": torch.zeros(3, dtype=torch.bfloat16)},
        stage_dir / "model.safetensors",
    )
    worker = _worker(1)
    base_weights.stage(worker, "t1", str(stage_dir), str(marker_dir))
    deadline = time.monotonic() + THREAD_CEILING_S
    while staging.poll(marker_dir, [0]) == ([], {}) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert staging.poll(marker_dir, [0]) == ([0], {})
    (record,) = stage_progress.read(marker_dir).values()
    assert (record.bytes, record.tensors) == (2 * 4 + 3 * 2, 2)
