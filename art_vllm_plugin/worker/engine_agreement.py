"""One agreement over every worker of an engine: tensor x prefill-context x pipeline parallel.

Why: a commit is all or nothing across the engine's workers before any forward uses it
(`step_rides._commit_everywhere`). The workers used to agree over the tensor-parallel group
only, so with pipeline stages each stage decided alone: a commit failing on the last stage
restored that stage while stage 0 kept the new weights, and EngineCore, reading one rank's
result, recorded the update as committed (issue 36, item 4).

vLLM has no process group of exactly one engine (its world group spans every data-parallel
engine, which commit at their own steps), but it has one along each axis of the engine's grid
(`compat.step_rides.worker_engine_cpu_groups`). Reducing along each axis in turn reduces over
the whole grid: after the tensor-parallel all-reduce every rank holds the sum of its
(stage, context rank), after the context-parallel one that of its stage, after the pipeline
one that of the engine; every rank ends with the same number. Gathering the same way hands
every rank every rank's object, in the engine's rank order (vLLM numbers them
stage-major, tensor-parallel rank innermost). Every rank must call these, in the same order,
or the others wait for it forever.
"""

from __future__ import annotations

from art_vllm_plugin.compat import count_across, gather_across


def count(groups: list, n: int) -> int:
    """Sum of `n` over every worker of the engine (`groups`: its axes, innermost first)."""
    for group in groups:
        n = count_across(group, n)
    return n


def gather(groups: list, obj) -> list:
    """`obj` of every worker of the engine, in engine rank order."""
    items = [obj]
    for group in groups:
        items = [item for part in gather_across(group, items) for item in part]
    return items
