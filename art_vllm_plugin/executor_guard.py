"""Refuse, at start, the vLLM executors whose ordering the plugin's labels are not exact on.

Why: a token's policy label must name the weights that computed it. A slot update rides the
step's own input (`SchedulerOutput.art_rides`, `engine_core/step_rides.py`), or goes as one
`collective_rpc` when the engine is idle; each worker runs it inside `Worker.execute_model`,
before the forward, under the weights lock, and reads the label there (`forward_labels`). The
label is exact by construction on an executor that hands every worker its steps and RPCs in
the order EngineCore sent them, through `Worker.execute_model`:
- `uni` (vLLM's default for one GPU): EngineCore's own thread; the CPU build turns it into `mp`
  (`platforms/cpu.py`), so here it is exercised as `mp`;
- `mp`: one broadcast queue that each worker runs in order (the serve suite's TP, DP, PP);
- `ray` (vLLM 0.32's default Ray executor, `RayExecutorV2`, the only one from 0.34): a
  subclass of `mp`'s executor that only places the workers on Ray actors (on other nodes the
  queue runs over TCP) and keeps its step and RPC methods; tested with two tensor-parallel
  workers on two Ray nodes (`tests/art_vllm_plugin/engine_core/test_ray_executor.py`).
Any executor class is judged the same way (`compat.executors.keeps_one_ordered_queue`).

Refused, naming the flag and why:
- Ray's compiled-graph executor (`RayDistributedExecutor`, chosen only by
  `VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0` on vLLM 0.32, gone in 0.34): its forwards call
  `model_runner.execute_model` on the compiled graph's thread, around `Worker.execute_model`,
  so no ride would run and no label be read, and its RPCs (`execute_method.remote`) run
  concurrently with that thread, so a swap could land between two layers of a forward;
- `external_launcher` (each rank is an engine of its own: a commit would land on each at its
  own step) and executor classes that replace the step or RPC methods: untested.
Serving wrong labels silently is worse than not starting.

The check runs where vLLM turns arguments into its config (`EngineArgs.create_engine_config`),
before anything starts: once on the argument as given, once on the backend vLLM resolved (it
picks Ray by itself for a multi-node world).
"""

from __future__ import annotations

import functools

from art_vllm_plugin.compat import executors as compat_executors

OPTION = "--distributed-executor-backend"
#: What vLLM 0.32 reads to pick Ray's compiled-graph executor instead of its default one.
RAY_V2_ENV = "VLLM_USE_RAY_V2_EXECUTOR_BACKEND"
#: The backends a user can name whose ordering keeps labels exact (see the module docstring).
EXACT = ("mp", "uni", "ray")


def _name(backend) -> str:
    if isinstance(backend, type):
        return f"{backend.__module__}.{backend.__qualname__}"
    return str(backend)


def check_executor(backend) -> None:
    """Raise ValueError unless `backend` (None: vLLM will choose) runs on an executor that
    keeps every worker's steps and RPCs in EngineCore's order (see the module docstring)."""
    if backend is None:
        return
    try:
        cls = compat_executors.executor_class(backend)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        cls, unresolved = None, f"{type(exc).__name__}: {exc}"
    if cls is not None and compat_executors.keeps_one_ordered_queue(cls):
        return
    name = _name(backend)
    if cls is None:
        why = (
            f"vLLM cannot resolve it to an executor ({unresolved}), so its ordering is "
            f"unknown. Use {OPTION} mp, uni or ray"
        )
    elif name == "ray":
        why = (
            f"{RAY_V2_ENV}=0 picks Ray's compiled-graph executor ({cls.__name__}), whose "
            "forwards bypass the worker step where slot updates are applied and labelled, and "
            "whose RPCs run concurrently with them, so a batch could compute on two policy "
            f"versions. Unset {RAY_V2_ENV} (vLLM's default Ray executor keeps one ordered queue)"
        )
    else:
        why = (
            f"its executor ({_name(cls)}) does not keep the workers' steps and RPCs in one "
            f"ordered queue, or its ordering is untested. Use {OPTION} mp, uni or ray"
        )
    raise ValueError(
        f"{OPTION} {name}: the art plugin labels every token with the policy version that "
        f"computed it, and serves only on executors where that label is exact "
        f"({', '.join(EXACT)}); {why}, or start without the plugin."
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
