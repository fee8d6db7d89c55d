"""The API server waits for the workers' staging markers without spending its event loop.

The markers are files (`art_vllm_plugin.staging`); reading them is a `stat()` per worker every
few milliseconds while an update stages. On the event loop that is time no other request gets.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from art_vllm_plugin import staging
from art_vllm_plugin.api_server import slot_publish

pytestmark = pytest.mark.serve


def test_markers_are_read_off_the_event_loop(tmp_path, monkeypatch):
    engines = [slot_publish.Engine(0, b"\x00\x00"), slot_publish.Engine(1, b"\x01\x00")]
    threads = []
    real_poll = staging.poll

    def poll(marker_dir, ranks):
        threads.append(threading.get_ident())
        return real_poll(marker_dir, ranks)

    monkeypatch.setattr(staging, "poll", poll)

    async def wait() -> int:
        loop_thread = threading.get_ident()
        task = asyncio.create_task(
            slot_publish.wait_staged(
                None, tmp_path, engines, [[0], [0, 1]], "the adapter", "keeps", "t"
            )
        )
        await asyncio.sleep(0.05)  # a few polls with nothing ready
        for engine, ranks in ((0, [0]), (1, [0, 1])):
            for rank in ranks:
                staging.mark(staging.marker_dir(tmp_path, engine), rank, ok=True)
        await asyncio.wait_for(task, 10)
        return loop_thread

    loop_thread = asyncio.run(wait())
    assert threads, "the markers were never read"
    assert loop_thread not in threads
