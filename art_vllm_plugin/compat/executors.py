"""Which executor class vLLM runs an engine on, and whether it keeps steps and RPCs in order.

Why here: the answer reads vLLM's executor classes (`Executor.get_class`, `MultiprocExecutor`,
`UniProcExecutor`), private names that live in `compat/` with the versions they hold for.
"""

from __future__ import annotations

from types import SimpleNamespace

from art_vllm_plugin.compat import names
from art_vllm_plugin.compat.patching import load

#: The executor methods whose order the labels rest on: a step and the RPCs between steps.
ORDERING_METHODS = ("execute_model", "sample_tokens", "collective_rpc")


def executor_class(backend) -> type:
    """The class vLLM runs for `distributed_executor_backend=backend` ("ray", "mp", a class,
    a qualified name), resolved by vLLM itself (for "ray" it reads
    VLLM_USE_RAY_V2_EXECUTOR_BACKEND)."""
    config = SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend))
    return load(names.EXECUTOR_GET_CLASS)(config)


def keeps_one_ordered_queue(cls: type) -> bool:
    """True for the executors whose steps and RPCs reach every worker in the order EngineCore
    sent them: `UniProcExecutor` (one thread), `MultiprocExecutor` (one broadcast queue, each
    worker runs it in order) and any subclass of `MultiprocExecutor` that keeps its step and
    RPC methods (vLLM's Ray executor, `RayExecutorV2`, which only places the workers on Ray
    actors)."""
    uni = load(names.UNIPROC_EXECUTOR)
    mp = load(names.MULTIPROC_EXECUTOR)
    if cls is uni or cls is mp:
        return True
    if not (isinstance(cls, type) and issubclass(cls, mp)):
        return False
    return all(getattr(cls, m) is getattr(mp, m) for m in ORDERING_METHODS)
