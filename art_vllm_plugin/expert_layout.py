"""Refuse, at start, a mixture-of-experts model served by several data-parallel engines.

Why: a label names one set of weights, and an update's two-phase commit over the DP engines is
exact per engine: each engine swaps at its own next step (`engine_core/step_rides.py`). That
is enough where the engines compute independently (a dense model: each engine's tokens meet
only its own weights). It is not for an MoE model: vLLM 0.32 spreads its experts over every
DP engine. With `--enable-expert-parallel` each engine holds some experts and a token goes to
the engine that holds its expert; without it the experts are tensor-parallel over all DP x TP
ranks (`FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp`), so every token passes through
a shard on every engine. Either way one engine's forward computes with the other engines'
expert weights, in lock step (`DPEngineCoreProc` runs a dummy batch when an engine has no
work). Between the first engine's commit and the last one's, a batch labelled with the new
version passes through old experts on another engine (or the reverse), and a commit that
fails on one engine after another committed leaves both computing on mixed experts until the
revert. Labels there would lie, and a lie is worse than not starting (`executor_guard`).

What would make it exact (not built): cut every engine over at one step of the DP group. vLLM
has the step for it: its DP pause (`pause_scheduler` on every engine; `DPEngineCoreProc`
stops all engines at the same wave step once every engine asked, a consensus all-reduce over
the engines' DP group) leaves no forward running anywhere; committing on every engine then,
and resuming only after every engine committed (or reverted), puts every forward before the
cut on the old experts everywhere and every one after on the new. That costs a pause of the
whole DP group per update and must not resume a pause a client asked for; it needs a DP=2 MoE
server of its own to prove it, which the CPU suite does not run yet (docs/scale-out.md).

The check runs where vLLM turns arguments into its config (`EngineArgs.create_engine_config`),
once the model's config says whether it has routed experts.
"""

from __future__ import annotations

import functools

EP_FLAG = "--enable-expert-parallel"


def experts_across_engines(vllm_config) -> str | None:
    """Why the experts of this configuration span several DP engines, or None."""
    parallel, model = vllm_config.parallel_config, vllm_config.model_config
    if parallel.data_parallel_size <= 1 or not model.is_moe:
        return None
    how = (
        f"{EP_FLAG}: each engine holds some experts and tokens go to the engine holding theirs"
        if parallel.enable_expert_parallel
        else "the experts are tensor-parallel over every engine's ranks"
    )
    return (
        f"--data-parallel-size {parallel.data_parallel_size} with a mixture-of-experts model "
        f"({model.model!r}): {how}"
    )


def check_expert_layout(vllm_config) -> None:
    """Raise ValueError when one engine's forward computes with other engines' experts."""
    why = experts_across_engines(vllm_config)
    if why is None:
        return
    raise ValueError(
        f"{why}. The art plugin commits an update on each data-parallel engine at that "
        "engine's next step, so for a moment a batch would compute with experts of two "
        "versions under one label. Serve MoE models with one engine per server (tensor or "
        "pipeline parallel inside it) and several servers behind your balancer, published "
        "with the fleet (docs/scale-out.md), or start without the plugin."
    )


def refuse_experts_across_engines(create_engine_config):
    """Wrapper for `EngineArgs.create_engine_config` (applied by `install`)."""

    @functools.wraps(create_engine_config)
    def create_engine_config_with_experts_in_one_engine(self, *args, **kwargs):
        config = create_engine_config(self, *args, **kwargs)
        check_expert_layout(config)
        return config

    return create_engine_config_with_experts_in_one_engine
