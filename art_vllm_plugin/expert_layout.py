"""Whether a mixture-of-experts model's experts span several data-parallel engines.

Why it matters: a label names one set of weights, and an update's two-phase commit over the DP
engines lands on each engine at that engine's next step (`engine_core/step_rides.py`). That is
exact where the engines compute independently (a dense model: each engine's tokens meet only
its own weights). It is not for an MoE model: vLLM spreads its experts over every DP engine.
With `--enable-expert-parallel` each engine holds some experts and a token goes to the engine
that holds its expert; without it the experts are tensor-parallel over all DP x TP ranks
(`FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp`), so every token passes through a shard
on every engine. Either way one engine's forward computes with the other engines' expert
weights, in lock step (`DPEngineCoreProc` runs a dummy batch when an engine has no work).

Such a server commits every update inside a pause of every engine at one step of their group
(`api_server/expert_cut.py`); until issue 36 item 5 it was refused at start.
"""

from __future__ import annotations

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
