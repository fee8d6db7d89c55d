"""`serve_process.start` starts again on a new port when the port it picked was taken before
vLLM bound it ("Address already in use": a CI run lost a module to it), at most
`PORT_ATTEMPTS` starts, and raises any other start failure at once.

A unit test of that policy: each start (`_start_once`, which picks a free port and runs
`vllm serve`) is replaced by one that fails as vLLM does, so the race happens on every run
instead of when another process happens to take the port.
"""

from __future__ import annotations

import pytest

from art_vllm_plugin import serve_process
from art_vllm_plugin.serve_process import PORT_ATTEMPTS, ServeConfig, ServerStartError

TAKEN = "vllm serve exited (1):\nOSError: [Errno 98] Address already in use"


def starts(monkeypatch, outcomes: list) -> list[int]:
    """Each start returns or raises the next of `outcomes`; returns the list of starts made."""
    made: list[int] = []

    def once(config):
        made.append(len(made) + 1)
        outcome = outcomes[len(made) - 1]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(serve_process, "_start_once", once)
    return made


CONFIG = ServeConfig(model="tiny")


def test_a_port_taken_before_vllm_bound_it_is_started_again(monkeypatch, capsys):
    made = starts(monkeypatch, [ServerStartError(TAKEN), "server"])
    assert serve_process.start(CONFIG) == "server"
    assert made == [1, 2]
    assert "port taken before vLLM bound it; starting again" in capsys.readouterr().out


def test_it_gives_up_after_port_attempts(monkeypatch):
    made = starts(monkeypatch, [ServerStartError(TAKEN)] * PORT_ATTEMPTS)
    with pytest.raises(ServerStartError, match="Address already in use"):
        serve_process.start(CONFIG)
    assert len(made) == PORT_ATTEMPTS


def test_any_other_start_failure_is_raised_at_once(monkeypatch):
    made = starts(monkeypatch, [ServerStartError("vllm serve exited (1): bad --dtype"), "server"])
    with pytest.raises(ServerStartError, match="bad --dtype"):
        serve_process.start(CONFIG)
    assert made == [1]
