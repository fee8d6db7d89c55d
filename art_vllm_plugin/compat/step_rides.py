"""vLLM names a slot update riding the step loop reaches (`engine_core/step_rides.py`,
`worker/step_rides.py`).

vLLM 0.32: `EngineCore.step` / `step_with_batch_queue` call `scheduler.schedule()` and send
the `SchedulerOutput` (a plain dataclass, pickled to every worker by the multiprocessing
executor, so an extra attribute travels with it) only while `scheduler.has_requests()`;
otherwise the busy loop waits for input without stepping. One engine's workers are the grid
pipeline stage x prefill-context rank x tensor-parallel rank (`parallel_config.world_size`;
`initialize_model_parallel` lays ranks out as DP x PP x PCP x TP); along each axis they share
a group (`get_tp_group()`, `get_pcp_group()`, `get_pp_group()`), whose `cpu_group` is a gloo
group on every platform. No group spans exactly one engine (the world group spans every
data-parallel engine), so an agreement over the engine goes along the three axes in turn.
"""

from __future__ import annotations

from art_vllm_plugin.compat import names
from art_vllm_plugin.compat.patching import load


def engine_will_step(core) -> bool:
    """Whether the busy loop's next step schedules a batch and sends it to the workers."""
    return bool(core.scheduler.has_requests())


def engine_worker_count(core) -> int:
    """Workers of this engine (tensor x pipeline parallel), numbered from 0."""
    return int(core.vllm_config.parallel_config.world_size)


def engine_pipeline_stages(core) -> int:
    return int(core.vllm_config.parallel_config.pipeline_parallel_size)


def worker_tp_cpu_group():
    """The CPU group of this worker's tensor-parallel ranks; None when it is alone."""
    group = load(names.GET_TP_GROUP)()
    return group.cpu_group if group.world_size > 1 else None


def worker_engine_cpu_groups() -> list:
    """The CPU groups along which this worker's engine spans several workers, innermost axis
    first (tensor parallel, prefill context parallel, pipeline stages): an all-reduce along
    each in turn sums over every worker of the engine, and over no other engine's."""
    groups = [worker_tp_cpu_group()]
    for name in (names.GET_PCP_GROUP, names.GET_PP_GROUP):
        group = load(name)()
        groups.append(group.cpu_group if group.world_size > 1 else None)
    return [g for g in groups if g is not None]


def count_across(group, n: int) -> int:
    """Sum of `n` over the ranks of `group` (a collective: every rank calls it)."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(total, group=group)
    return int(total.item())


def gather_across(group, obj) -> list:
    """`obj` of every rank of `group`, in rank order (a collective)."""
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
