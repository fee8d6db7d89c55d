"""DP modes in which an API server does not manage every engine are refused at start.

With external or hybrid DP load balancing, each API server talks to its own (local) engines
only, so an update through it could not commit on every engine. The decision is made from
vLLM's own `ParallelConfig` (built here as `vllm serve` builds it) when the art API state is
created, which makes the server exit during start-up with the message.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from art_vllm_plugin import compat
from art_vllm_plugin.api_server.state import (
    UnsupportedDataParallelMode,
    refuse_partial_data_parallel,
)


def mode(**kwargs) -> str | None:
    from vllm.config import ParallelConfig

    return compat.dp_load_balancing_mode(SimpleNamespace(parallel_config=ParallelConfig(**kwargs)))


def test_single_engine_and_internal_load_balancing_are_accepted():
    assert mode() is None
    assert mode(data_parallel_size=2) == "internal"
    refuse_partial_data_parallel(None)
    refuse_partial_data_parallel("internal")


@pytest.mark.parametrize("lb", ["external", "hybrid"])
def test_external_and_hybrid_load_balancing_are_refused_naming_the_mode(lb):
    found = mode(data_parallel_size=2, **{f"data_parallel_{lb}_lb": True})
    assert found == lb
    with pytest.raises(UnsupportedDataParallelMode, match=f"--data-parallel-{lb}-lb") as info:
        refuse_partial_data_parallel(found)
    assert f"{lb} data-parallel load balancing" in str(info.value)
    assert "Fleet" in str(info.value)
