"""Refuse, at start, the vLLM executors whose ordering the plugin's labels have not been
proven on.

Why: a token's policy label must name the weights that computed it. A slot update swaps
weights in every worker through a `collective_rpc`; the label is exact when no forward runs
while a swap does. The multiprocessing executor (`mp`, one ordered broadcast queue per
worker; the serve suite's TP=2 and DP=2 servers) keeps that order. The in-process executor
(`uni`, vLLM's default for one GPU) runs the swap on EngineCore's own thread, between two
steps, by construction; the CPU build turns `uni` into `mp` (`platforms/cpu.py`), so here it
is exercised as `mp`.
Ray does not: its forwards run through the compiled graph while `collective_rpc` goes through
`execute_method.remote`, which Ray runs concurrently (vLLM 0.32 `v1/executor/ray_executor.py`),
so a swap can land between two layers of one forward. `external_launcher` and executor
classes of the user's own are untested. Serving wrong labels silently is worse than not
starting, so those are refused with the flag that fixes it.

The check runs where vLLM turns arguments into its config (`EngineArgs.create_engine_config`),
before anything starts: once on the argument as given (vLLM's own Ray check would otherwise
fail first, with a message about Ray), once on the backend vLLM resolved (it picks Ray by
itself for a multi-node world).
"""

from __future__ import annotations

import functools

OPTION = "--distributed-executor-backend"
#: The executors whose ordering keeps labels exact (see the module docstring).
TESTED = ("mp", "uni")


def _name(backend) -> str:
    if isinstance(backend, type):
        return f"{backend.__module__}.{backend.__qualname__}"
    return str(backend)


def check_executor(backend) -> None:
    """Raise ValueError unless `backend` (None: vLLM will choose) is a tested executor."""
    if backend is None or (isinstance(backend, str) and backend in TESTED):
        return
    name = _name(backend)
    why = (
        "Ray runs slot-update RPCs concurrently with the compiled-graph forward, so a batch "
        "could compute on two policy versions"
        if name == "ray"
        else "its ordering of slot-update RPCs against forwards is untested"
    )
    raise ValueError(
        f"{OPTION} {name}: the art plugin labels every token with the policy version that "
        f"computed it, and serves only on executors where that label is proven exact "
        f"({', '.join(TESTED)}); {why}. Use {OPTION} mp (one host) or start without the "
        f"plugin."
    )


def refuse_untested_executor(create_engine_config):
    """Wrapper for `EngineArgs.create_engine_config` (applied by `install`)."""

    @functools.wraps(create_engine_config)
    def create_engine_config_on_tested_executor(self, *args, **kwargs):
        check_executor(self.distributed_executor_backend)
        config = create_engine_config(self, *args, **kwargs)
        check_executor(config.parallel_config.distributed_executor_backend)
        return config

    return create_engine_config_on_tested_executor
