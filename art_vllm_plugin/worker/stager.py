"""The worker's one staging thread: LoRA and full-weight stages run there, off the step loop.

Why one thread fed through a queue, not a thread per update: `Thread.start()` blocks the
caller until the new thread runs, and the new thread then holds the GIL for up to the switch
interval (5 ms) while it reads the update: the stage call, and so the engine's step loop,
would wait for it. A `put` on a queue returns at once. Stages run one after another, in the
order they were asked for.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from art_vllm_plugin.worker.state import worker_state


def stage_in_background(worker, job: Callable[[], None]) -> None:
    """Run `job` on the worker's staging thread (started on first use). `job` must not
    raise: it reports its outcome itself (a marker)."""
    state = worker_state(worker)
    jobs = state.stage_jobs
    if jobs is None:
        jobs = state.stage_jobs = queue.SimpleQueue()

        def run():
            while True:
                jobs.get()()

        threading.Thread(target=run, name="art-stager", daemon=True).start()
    jobs.put(job)
