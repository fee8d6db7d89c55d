"""The worker's staging threads: LoRA and full-weight stages run there, off the step loop.

Why a thread fed through a queue, not a thread per update: `Thread.start()` blocks the caller
until the new thread runs, and the new thread then holds the GIL for up to the switch
interval (5 ms) while it reads the update: the stage call, and so the engine's step loop,
would wait for it. A `put` on a queue returns at once. Stages of one lane run one after
another, in the order they were asked for.

Two lanes: `FILES` reads stages from disk (LoRA and full-weight files), `STREAM` receives a
full-weight stream. A stream waits on the trainer for as long as it sends (or until its group
times out when the trainer died): on the files lane it would hold every LoRA update of the
server behind it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from art_vllm_plugin.worker.state import worker_state

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
            while True:
                jobs.get()()

        threading.Thread(target=run, name=f"art-{lane}", daemon=True).start()
    jobs.put(job)
