"""A stand-in EngineCore for tests of the plugin's engine-side bookkeeping (rides, abandoned
updates): a scheduler that has requests or not, an executor that records every worker RPC and
answers ride lists as the workers would, one pipeline stage, a stamped scheduler. Where the real
engine matters, tests start one (test_async_provenance.py) or a server."""

from __future__ import annotations

from types import SimpleNamespace

from art_vllm_plugin.engine_core.state import engine_state


def stand_in_engine(has_requests: bool):
    """(engine, sent): `sent` lists each `collective_rpc` as (method, args)."""
    sent = []

    def collective_rpc(method, args=()):
        sent.append((method, args))
        return [[{"ok": True, "swap_ms": 0.1} if r[0] == "commit" else None for r in args[0]]]

    core = SimpleNamespace(
        scheduler=SimpleNamespace(has_requests=lambda: has_requests),
        model_executor=SimpleNamespace(collective_rpc=collective_rpc),
        vllm_config=SimpleNamespace(
            parallel_config=SimpleNamespace(pipeline_parallel_size=1, world_size=1)
        ),
    )
    engine_state(core).stamps.scheduler_stamped = True
    return core, sent
