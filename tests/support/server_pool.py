"""Shared `vllm serve` processes for the serve suite: one per configuration, started once.

Why: a server start costs 30-60 s on two cores (minutes on a busy host), and most modules only
need "a plugin server with these flags". Starting one per module made server starts the bulk
of `make test-serve`.

How (a pytest plugin, loaded by `tests/conftest.py`):

- A *kind* (`KINDS`, in `tests/support/server_kinds.py`) is a named server configuration and
  the updatable slots it starts with. A module asks for one by using the fixture
  `<kind>_server` (module scope); that fixture hands over the running server in a known state
  and checks, when the module ends, that it left it clean.
- `pytest_collection_modifyitems` orders the collected modules by kind (each module keeps its
  own test order; modules that use no shared server run first) and counts, per kind, the tests
  that use it. A kind's server starts on first use and stops right after its last test, so
  one shared server lives at a time (memory: about 3 GB each, more for DP=2 and TP=2).
- Known state, handed to every module (`hand_over`): every slot re-published with its start
  adapter at a new version (versions only move forward: a module reads its base from the slots
  and never assumes version 0), the prefix cache reset where the kind runs vLLM's dev-mode
  routes, and then checked through `/art/v1/slots`: each slot at its new version with the
  start adapter's digest, no lease, no request running or waiting.
- When a module ends (`check_left_clean`): the server still runs, no lease is left, and no
  request is still running. A module that leaves a mess gets a teardown error naming it;
  a server that died is started again for the next module, with a line saying so.

Modules that need a server of their own (a restart, a refused start, a configuration that is
the subject of the test) keep starting it in their fixture, whose docstring says why.
Progress (which server starts, how long it took, when it stops) is printed to the terminal.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

#: Ceiling for "the previous module's requests have finished" (not a timed assertion: a
#: request still running after this long is a module that left work behind).
DRAIN_CEILING_S = 300.0


@dataclass(frozen=True)
class KindPaths:
    """Where a kind's server finds its model and adapters."""

    tiny_model: Path
    tiny_adapters: Path
    moe_model: Path
    root: Path  # this kind's own directory (an allowed adapter root where the kind says so)

    @property
    def start(self) -> Path:
        """Start adapters are copied here, one directory per slot."""
        return self.root / "start"


@dataclass(frozen=True)
class Kind:
    """A shared server configuration.

    `config` builds the ServeConfig (it may write files under `paths.root` first); `slots`
    maps each updatable slot to its start adapter (inside an allowed adapter root: the
    hand-over re-publishes it). `api_key` is sent on every hand-over request.
    `modules_dir` is where modules put their own adapters (inside an allowed root).
    `after_stop` ends what `config` started beside the server (the Ray kind's local cluster),
    once the server has stopped or failed to start.
    """

    name: str
    why: str
    config: Callable[[KindPaths], object]
    slots: Callable[[KindPaths], dict[str, Path]]
    api_key: str | None = None
    modules_dir: Callable[[KindPaths], Path] = lambda p: p.root / "modules"
    after_stop: Callable[[KindPaths], None] | None = None

    @property
    def fixture(self) -> str:
        return f"{self.name}_server"


@dataclass
class SharedServer:
    """What a module gets: the running server of its kind, in the known state.

    `scratch` is a fresh directory for the module's own adapters, inside an allowed adapter
    root of the server; `start_versions` are the slot versions handed over.
    """

    process: object  # art_vllm_plugin.serve_process.ServerProcess
    kind: Kind
    paths: KindPaths
    scratch: Path
    start_versions: dict[str, int]

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def proc(self):
        return self.process.proc

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    @property
    def config(self):
        return self.process.config

    def log_tail(self, lines: int = 60) -> str:
        return self.process.log_tail(lines)

    @property
    def headers(self) -> dict[str, str]:
        key = self.kind.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass
class _Live:
    process: object
    started_at: float
    start_s: float
    modules: list[str] = field(default_factory=list)


class HandOverError(RuntimeError):
    """The shared server is not in the state a module may rely on; the message says why."""


class ServerPool:
    """Starts each kind's server on first use and stops it after the kind's last test."""

    def __init__(self, kinds: dict[str, Kind], base: Path | None, say: Callable[[str], None]):
        self.kinds = kinds
        self.base = base
        self.say = say
        self.live: dict[str, _Live] = {}
        self.failed: dict[str, str] = {}  # kind -> why its start failed (not tried again)
        self.remaining: Counter[str] = Counter()
        self.modules: dict[str, list[str]] = {}
        self.summary: list[tuple[str, float, float, int]] = []  # kind, start s, alive s, mods

    # -- collection -------------------------------------------------------------------------
    def kinds_of(self, item) -> list[str]:
        names = set(getattr(item, "fixturenames", ()))
        return [k.name for k in self.kinds.values() if k.fixture in names]

    def plan(self, items: Iterable) -> None:
        self.remaining.clear()
        self.modules.clear()
        for item in items:
            for kind in self.kinds_of(item):
                self.remaining[kind] += 1
                mods = self.modules.setdefault(kind, [])
                mod = _module(item)
                if mod not in mods:
                    mods.append(mod)

    # -- lifetime ---------------------------------------------------------------------------
    def paths(self, name: str) -> KindPaths:
        from support.vllm_server import TINY, tiny_paths

        model, adapters = tiny_paths()
        root = self.base / name
        root.mkdir(parents=True, exist_ok=True)
        return KindPaths(model, adapters, TINY / "moe", root)

    def acquire(self, name: str):
        from art_vllm_plugin import serve_process

        live = self.live.get(name)
        if live is not None and live.process.proc.poll() is None:
            return live.process
        kind = self.kinds[name]
        if name in self.failed:
            raise HandOverError(f"the shared {name} server failed to start: {self.failed[name]}")
        if live is not None:
            self.say(
                f"[servers] {name}: exited with code {live.process.proc.returncode}; "
                f"starting it again (log {live.process.log_path})"
            )
            self.live.pop(name)
        paths = self.paths(name)
        config = kind.config(paths)
        if config.log_path is None:
            config.log_path = self.base / "logs" / f"{name}.log"
        n = len(self.modules.get(name, ()))
        self.say(f"[servers] {name}: starting for {n} module(s) ({kind.why})")
        t0 = time.monotonic()
        try:
            process = serve_process.start(config)
        except Exception as exc:
            self.failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            self.say(f"[servers] {name}: failed to start; its modules fail without trying again")
            self._after_stop(name)
            raise
        took = time.monotonic() - t0
        self.say(
            f"[servers] {name}: ready in {took:.1f} s at {process.url} (log {config.log_path})"
        )
        self.live[name] = _Live(process, time.monotonic(), took)
        return process

    def test_done(self, item, nextitem) -> None:
        """Count `item` done; once a kind's last test ran, stop its server when that test's
        module has ended (the module's fixture checks the server on its way out)."""
        for name in self.kinds_of(item):
            self.remaining[name] -= 1
        module_ended = nextitem is None or _module(nextitem) != _module(item)
        if module_ended:
            for name in list(self.live):
                if self.remaining[name] <= 0:
                    self.stop(name, "after its last module")

    def stop(self, name: str, why: str) -> None:
        live = self.live.pop(name, None)
        if live is None:
            return
        code = live.process.stop()
        self._after_stop(name)
        alive = time.monotonic() - live.started_at
        self.summary.append((name, live.start_s, alive, len(live.modules)))
        self.say(
            f"[servers] {name}: stopped {why} (exit {code}; served {len(live.modules)} "
            f"module(s) for {alive:.0f} s)"
        )

    def _after_stop(self, name: str) -> None:
        kind = self.kinds[name]
        if kind.after_stop is not None:
            kind.after_stop(self.paths(name))

    def stop_all(self, why: str) -> None:
        for name in list(self.live):
            self.stop(name, why)

    # -- hand-over --------------------------------------------------------------------------
    def hand_over(self, name: str, module: str) -> SharedServer:
        import httpx

        from art_protocol.digest import digest_dir

        kind = self.kinds[name]
        process = self.acquire(name)
        self.live[name].modules.append(module)
        paths = self.paths(name)
        scratch = kind.modules_dir(paths) / module.rsplit(".", 1)[-1]
        scratch.mkdir(parents=True, exist_ok=False)
        shared = SharedServer(process, kind, paths, scratch, {})
        starts = kind.slots(paths)
        with httpx.Client(base_url=process.url, headers=shared.headers, timeout=300) as http:
            _drain(http, name)
            before = _slots(http, name)
            if set(before) != set(starts):
                raise HandOverError(
                    f"{name} server: slots {sorted(before)}, expected {sorted(starts)}"
                )
            for slot, path in starts.items():
                version = before[slot]["version"] + 1
                resp = http.post(
                    "/art/v1/lora/update",
                    json={"slot": slot, "path": str(path), "version": version},
                )
                if resp.status_code != 200:
                    raise HandOverError(
                        f"{name} server: re-publishing the start adapter of slot {slot!r} "
                        f"failed before {module}: {resp.status_code} {resp.text}"
                    )
            if "VLLM_SERVER_DEV_MODE" in process.config.env:
                resp = http.post("/reset_prefix_cache")
                if resp.status_code != 200:
                    raise HandOverError(f"{name} server: /reset_prefix_cache: {resp.text}")
            after = _slots(http, name)
            for slot, path in starts.items():
                s = after[slot]
                want = (before[slot]["version"] + 1, digest_dir(path))
                if (s["version"], s["digest"]) != want or s.get("leases"):
                    raise HandOverError(f"{name} server: slot {slot} is {s}, expected {want}")
                for engine in s.get("engines") or ():
                    if (engine["version"], engine["digest"]) != want:
                        raise HandOverError(f"{name} server: slot {slot} engines {s['engines']}")
                shared.start_versions[slot] = s["version"]
            if starts:
                leases = http.get("/art/v1/leases").json()
                if leases:
                    raise HandOverError(f"{name} server: leases left over: {leases}")
        return shared

    def check_left_clean(self, shared: SharedServer, module: str) -> None:
        import httpx

        name = shared.kind.name
        if shared.proc.poll() is not None:
            raise HandOverError(
                f"{module} left the shared {name} server dead (exit {shared.proc.returncode}); "
                f"log {shared.log_path}:\n{shared.log_tail()}"
            )
        with httpx.Client(base_url=shared.url, headers=shared.headers, timeout=300) as http:
            _drain(http, name, module)
            leases = http.get("/art/v1/leases").json() if shared.start_versions else []
            for lease in leases:  # released, so that the next module is not poisoned too
                http.delete(f"/art/v1/leases/{lease['id']}")
            if leases:
                raise HandOverError(
                    f"{module} left leases on the shared {name} server: {leases}; a module "
                    "releases what it takes"
                )


def _module(item) -> str:
    return item.nodeid.split("::")[0]


def _slots(http, name: str) -> dict[str, dict]:
    resp = http.get("/art/v1/slots")
    if resp.status_code != 200:
        raise HandOverError(f"{name} server: /art/v1/slots: {resp.status_code} {resp.text}")
    return {s["slot"]: s for s in resp.json()}


def _queued(http, name: str) -> tuple[float, float]:
    """(running, waiting) requests summed over every engine, from vLLM's own per-engine gauges
    (`/metrics`). Not `/art/metrics`: with data parallelism each API server answers from the
    feed of whichever engine stepped last, so an idle engine's last busy figures can stand
    there indefinitely (seen: `num_running` 3 with both engines idle)."""
    resp = http.get("/metrics")
    if resp.status_code != 200:
        raise HandOverError(f"{name} server: /metrics: {resp.status_code} {resp.text[:200]}")
    totals = {"running": 0.0, "waiting": 0.0}
    for line in resp.text.splitlines():
        for what in totals:
            if line.startswith(f"vllm:num_requests_{what}{{"):
                totals[what] += float(line.rsplit(" ", 1)[1])
    return totals["running"], totals["waiting"]


def _drain(http, name: str, module: str | None = None) -> None:
    """Wait until no request runs or waits (a module's last responses may still be in flight
    on the server side when its client returned, e.g. a cancelled stream)."""
    deadline = time.monotonic() + DRAIN_CEILING_S
    while True:
        running, waiting = _queued(http, name)
        if running == 0 and waiting == 0:
            return
        if time.monotonic() > deadline:
            who = f"{module} left" if module else "the previous module left"
            raise HandOverError(
                f"{who} requests running on the shared {name} server after "
                f"{DRAIN_CEILING_S:.0f} s: running {running:g}, waiting {waiting:g}"
            )
        time.sleep(0.2)


# -- the pytest plugin ----------------------------------------------------------------------
_POOL: ServerPool | None = None


def _kinds() -> dict[str, Kind]:
    from support.server_kinds import KINDS

    return KINDS


def pytest_configure(config):
    global _POOL

    def say(line: str) -> None:
        """A line on the terminal, also while a test's output is being captured."""
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        capture = config.pluginmanager.get_plugin("capturemanager")
        if reporter is None:
            print(line, flush=True)
            return
        if capture is None:
            reporter.write_line(line)
            return
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)

    _POOL = ServerPool(_kinds(), None, say)


@pytest.fixture(scope="session")
def server_pool(tmp_path_factory) -> ServerPool:
    """The pool of shared servers (its directory: `<basetemp>/shared-servers`)."""
    assert _POOL is not None
    if _POOL.base is None:
        _POOL.base = tmp_path_factory.mktemp("shared-servers", numbered=False)
    return _POOL


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Modules that use no shared server first, then the modules of each kind together (in
    `KINDS` order), a module marked `changes_base_weights` after the kind's other modules
    (a full-weight update moves the base version every later module's spans and salts would
    carry); every module keeps its own test order."""
    names = [k.fixture for k in _kinds().values()]
    by_module: dict[str, list] = {}
    for item in items:
        by_module.setdefault(_module(item), []).append(item)

    def rank(module_items) -> int:
        used = {f for item in module_items for f in getattr(item, "fixturenames", ())}
        return min((i + 1 for i, n in enumerate(names) if n in used), default=0)

    def last(module_items) -> bool:
        return any(item.get_closest_marker("changes_base_weights") for item in module_items)

    ordered = sorted(
        enumerate(by_module.values()),
        key=lambda pair: (rank(pair[1]), last(pair[1]), pair[0]),
    )
    items[:] = [item for _, module_items in ordered for item in module_items]


def pytest_collection_finish(session):
    _POOL.plan(session.items)
    for name, modules in _POOL.modules.items():
        _POOL.say(
            f"[servers] plan: {name} server for {len(modules)} module(s), "
            f"{_POOL.remaining[name]} test(s)"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    _POOL.test_done(item, nextitem)


def pytest_sessionfinish(session, exitstatus):
    _POOL.stop_all("at the end of the session")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _POOL.summary:
        return
    terminalreporter.section("shared vLLM servers")
    for name, start_s, alive_s, modules in _POOL.summary:
        terminalreporter.write_line(
            f"{name:<12} start {start_s:6.1f} s   alive {alive_s:6.0f} s   modules {modules}"
        )


def _kind_fixture(kind: Kind):
    @pytest.fixture(scope="module", name=kind.fixture)
    def fixture(request, server_pool):
        module = request.module.__name__
        shared = server_pool.hand_over(kind.name, module)
        yield shared
        server_pool.check_left_clean(shared, module)

    fixture.__doc__ = f"The shared `{kind.name}` server ({kind.why}), handed over in a known state."
    return fixture


for _kind in _kinds().values():
    globals()[f"_fixture_{_kind.name}"] = _kind_fixture(_kind)
