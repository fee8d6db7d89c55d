"""One HTTP client per API-server process of a server started with several API servers.

Why: with `--data-parallel-size 2` vLLM runs two API-server processes behind one port, and
the kernel hands each new connection to one of them. A test that must talk to each (every
API server answers `/art/metrics`, sees an update) opens single-connection clients until it
holds one per process, told apart by the pid `/art/v1/capabilities` reports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx

#: Persistent connections opened at most while looking for one to each API server.
MAX_CONNECTIONS = 64


@contextlib.contextmanager
def one_client_per_api_server(url: str, count: int = 2) -> Iterator[list[httpx.Client]]:
    clients, by_pid = [], {}
    try:
        while len(by_pid) < count and len(clients) < MAX_CONNECTIONS:
            c = httpx.Client(base_url=url, timeout=300, limits=httpx.Limits(max_connections=1))
            clients.append(c)
            pid = c.get("/art/v1/capabilities").json()["api_server"]["pid"]
            by_pid.setdefault(pid, c)
        assert len(by_pid) == count, (
            f"{len(clients)} connections all reached API server(s) {sorted(by_pid)}"
        )
        yield list(by_pid.values())
    finally:
        for c in clients:
            c.close()
