"""The slowest test modules of a run (25), and its slowest tests (25), printed at its end.

CI has a time limit and `make test` a budget (README); which modules spend it is the first
thing to know when it grows, and which tests in them the next. A module's time is the sum of
its tests' set-up, call and tear-down (a module-scoped fixture's set-up, e.g. a server start,
counts to its first test).
Loaded by `tests/conftest.py`.
"""

from __future__ import annotations

from collections import defaultdict

SHOWN = 25

_seconds: dict[str, float] = defaultdict(float)
_test_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _seconds[report.nodeid.split("::")[0]] += report.duration
    _test_seconds[report.nodeid] += report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _seconds:
        return
    terminalreporter.section(f"slowest {SHOWN} test modules")
    total = sum(_seconds.values())
    for module, seconds in sorted(_seconds.items(), key=lambda kv: -kv[1])[:SHOWN]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {100 * seconds / total:5.1f} %  {module}")
    terminalreporter.section(f"slowest {SHOWN} tests")
    for test, seconds in sorted(_test_seconds.items(), key=lambda kv: -kv[1])[:SHOWN]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {100 * seconds / total:5.1f} %  {test}")
