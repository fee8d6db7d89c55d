"""The worker's staging threads: LoRA and full-weight stages run there, off the step loop.

Why a thread fed through a queue, not a thread per update: `Thread.start()` blocks the caller
until the new thread runs, and the new thread then holds the GIL for up to the switch
interval (5 ms) while it reads the update: the stage call, and so the engine's step loop,
would wait for it. A `put` on a queue returns at once. Stages of one lane run one after
another, in the order they were asked for.

Two lanes: `FILES` reads stages from disk (LoRA and full-weight files), `STREAM` receives a
full-weight stream (on an engine of one worker: `base_weights.stage`). A stream waits on the
trainer for as long as it sends (or until its group times out when the trainer died): on the
files lane it would hold every LoRA update of the server behind it.

Each thread first makes the worker's device its own (`compat.set_thread_device`), as vLLM's
worker threads do: a thread does not inherit the current device, and a CUDA call on it (a
LoRA stage's copy to the device, a transfer engine's receive) would otherwise create a
context on device 0.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from art_vllm_plugin import compat
from art_vllm_plugin.worker.state import worker_state

logger = logging.getLogger(__name__)

FILES = "stager"
STREAM = "stream-receiver"


def stage_in_background(worker, job: Callable[[], None], lane: str = FILES) -> None:
    """Run `job` on the worker's thread for `lane` (started on first use). `job` must not
    raise: it reports its outcome itself (a marker)."""
    lanes = worker_state(worker).stage_jobs
    jobs = lanes.get(lane)
    if jobs is None:
        jobs = lanes[lane] = queue.SimpleQueue()

        def run():
            _use_worker_device(worker)
            while True:
                jobs.get()()

        threading.Thread(target=run, name=f"art-{lane}", daemon=True).start()
    jobs.put(job)


def _use_worker_device(worker) -> None:
    device = compat.worker_device(worker)
    if device is None:
        return
    try:
        compat.set_thread_device(device)
    except Exception:  # the jobs still run and report; their tensors name their devices
        logger.exception("art: a staging thread could not set the worker's device %s", device)
