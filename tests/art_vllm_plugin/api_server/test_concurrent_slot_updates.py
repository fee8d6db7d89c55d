"""Updates of different slots run at the same time; updates of one slot stay one at a time.

The overlap is made by ordering, not timing. Update A (slot `policy`) names an adapter whose
weights file is a FIFO: the API server admits A (its reservation is held), then blocks reading
the file until the test writes into it. The test opens the FIFO's write end, which succeeds
only once A's reader has opened it (so A is admitted and in progress), and then runs update B
(slot `other`) to the end: staged, committed, answered 200, while A still waits for its bytes
and so cannot have ended. Only then are A's bytes written, and A commits too. Before, one
update at a time across every slot made B wait for A, which waited for the test: B timed out.

Also sent while A is held: A2, a second update of `policy`. It must wait for A: it answers 200
with `previous_version` A's version (had it run beside A, one of them would have found the
other's version and been refused as stale). A2's request is sent before B, so it reaches the
server while A is held unless B's whole update is faster than one HTTP round trip; if it
arrived later it would pass as well, never fail.

The shared plain plugin server (`lora`: slots policy and other on adapter a).
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from art_protocol.digest import digest_dir

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
#: Ceiling for the server to open the FIFO / answer an update (not a timed assertion).
CEILING_S = 300.0


@pytest.fixture(scope="module")
def server(lora_server):
    """The shared plain plugin server (`lora` in tests/support/server_kinds.py)."""
    return lora_server


def post_update(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/art/v1/lora/update", json=body, timeout=CEILING_S)


def slots(url: str) -> dict[str, dict]:
    return {s["slot"]: s for s in httpx.get(url + "/art/v1/slots", timeout=60).json()}


def held_adapter(root: Path, source: Path) -> Path:
    """A copy of `source` whose weights file is a FIFO: reading it waits for the writer."""
    held = root / "held"
    held.mkdir()
    shutil.copy(source / CONFIG, held / CONFIG)
    os.mkfifo(held / WEIGHTS)
    return held


def open_writer(fifo: Path, update) -> int:
    """The FIFO's write end, opened once the server has opened it for reading (ENXIO until
    then): from that moment update A is admitted and reading its adapter."""
    deadline = time.monotonic() + CEILING_S
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            if update.done():
                pytest.fail(f"update A ended before reading its adapter: {update.result().text}")
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not open {fifo} within {CEILING_S:.0f} s")
            time.sleep(0.01)
            continue
        os.set_blocking(fd, True)
        return fd


def release(fd: int, data: bytes) -> None:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def test_two_slots_update_at_once_and_one_slot_waits_for_itself(server, tiny_adapters):
    url = server.url
    before = slots(url)
    vp, vo = before["policy"]["version"], before["other"]["version"]
    held = held_adapter(server.scratch, tiny_adapters / "b")
    weights_b = (tiny_adapters / "b" / WEIGHTS).read_bytes()
    digest_a, digest_b = digest_dir(tiny_adapters / "a"), digest_dir(tiny_adapters / "b")

    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(post_update, url, slot="policy", path=str(held), version=vp + 1)
        fd = open_writer(held / WEIGHTS, a)
        try:
            a2 = pool.submit(
                post_update, url, slot="policy", path=str(tiny_adapters / "a"), version=vp + 2
            )
            b = post_update(url, slot="other", path=str(tiny_adapters / "b"), version=vo + 1)
            assert b.status_code == 200, b.text
            # B staged and committed while A was admitted and still reading its adapter.
            assert not a.done(), a.result().text
            during = slots(url)
            assert (during["other"]["version"], during["other"]["digest"]) == (vo + 1, digest_b)
            assert during["policy"]["version"] == vp
        finally:
            release(fd, weights_b)
        ra, ra2 = a.result(), a2.result()

    assert ra.status_code == 200, ra.text
    assert (ra.json()["version"], ra.json()["previous_version"]) == (vp + 1, vp)
    assert ra.json()["digest"] == digest_b  # the bytes written into the FIFO
    assert ra2.status_code == 200, ra2.text
    assert (ra2.json()["version"], ra2.json()["previous_version"]) == (vp + 2, vp + 1)
    after = slots(url)
    assert (after["policy"]["version"], after["policy"]["digest"]) == (vp + 2, digest_a)
    assert (after["other"]["version"], after["other"]["digest"]) == (vo + 1, digest_b)
