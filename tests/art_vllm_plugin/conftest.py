"""Fixtures for the serving side: the tiny model and log locations for real servers."""

from __future__ import annotations

import pytest
from support.vllm_server import tiny_paths


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_paths()[0]


@pytest.fixture(scope="session")
def tiny_adapters():
    return tiny_paths()[1]


@pytest.fixture(scope="module")
def server_log(request, tmp_path_factory):
    """A log file per module for the server it starts (shown when start-up fails)."""
    return tmp_path_factory.mktemp("vllm-logs") / f"{request.module.__name__.split('.')[-1]}.log"
