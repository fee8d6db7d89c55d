"""`--servers shared|own`: run only the modules that use a shared server, or only the others.

Why: the serve suite is one pytest process, and a vLLM server's worker keeps about one core
busy, so on two cores the serve side used one core while the train side ran beside it and
left the other idle once the train side was done (a clean-clone `make test` measured 44 min
of CPU in 52 min of wall time). `make test` runs the serve suite as two processes, split
along the line that keeps server starts the same: the modules that use a shared server
(`tests/support/server_pool.py`; each kind still starts once, in that process) and the
modules that start their own server or need none. The two halves took about the same time
in the last whole run (shared kinds: ~1200 s with their starts; the rest: ~1370 s).

Without the option every collected module runs (what a user running one file expects).
Loaded by `tests/conftest.py`, after `support.server_pool`.
"""

from __future__ import annotations

SHARED = "shared"
OWN = "own"


def pytest_addoption(parser):
    parser.addoption(
        "--servers",
        choices=(SHARED, OWN),
        default=None,
        help=(
            "run only the modules that use a shared vLLM server (shared) or only those that "
            "do not (own); default: all"
        ),
    )


def _uses_shared_server(module_items) -> bool:
    from support.server_kinds import KINDS

    fixtures = {kind.fixture for kind in KINDS.values()}
    return any(fixtures & set(getattr(item, "fixturenames", ())) for item in module_items)


def pytest_collection_modifyitems(session, config, items):
    which = config.getoption("servers")
    if which is None:
        return
    by_module: dict[str, list] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::")[0], []).append(item)
    keep, drop = [], []
    for module_items in by_module.values():
        wanted = _uses_shared_server(module_items) == (which == SHARED)
        (keep if wanted else drop).extend(module_items)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
