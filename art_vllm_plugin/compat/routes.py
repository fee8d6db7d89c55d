"""vLLM names the route-row normaliser reaches, in the worker and in EngineCore.

vLLM 0.32's native routed-experts capture (Model Runner V2,
`fused_moe/routed_experts_capturer.py`) sizes its rows by `get_total_num_hidden_layers()` and
writes each MoE layer at its global `layer_id`, so a model with dense layers gets rows for
layers that route nothing. The plugin's rows hold the MoE layers only, in layer order.
"""

from __future__ import annotations

from art_vllm_plugin.compat import names
from art_vllm_plugin.compat.patching import load


def moe_layer_ids(model) -> list[int]:
    """Global layer ids of the model's MoE layers (`MoERunner.layer_id`), ascending."""
    moe_runner = load(names.MOE_RUNNER)
    return sorted({m.layer_id for m in model.modules() if isinstance(m, moe_runner)})


def worker_model(worker):
    """The worker's loaded model (`WorkerBase.get_model`)."""
    return worker.get_model()


def total_layers(vllm_config) -> int:
    """Layers the native capture has a row slot for."""
    return int(vllm_config.model_config.get_total_num_hidden_layers())


def routes_enabled(vllm_config) -> bool:
    """`--enable-return-routed-experts` (set by `--art-routes`) is on."""
    aux = getattr(vllm_config, "aux_output_config", None)
    return bool(aux is not None and aux.enabled)


def engine_vllm_config(core):
    return core.vllm_config


def output_routed_experts(outputs):
    """(engine output, its routed-experts rows) of one step's `EngineCoreOutputs` by client,
    for the outputs that carry rows (`EngineCoreOutput.routed_experts`)."""
    for eco in outputs.values():
        for out in eco.outputs:
            rows = getattr(out, "routed_experts", None)
            if rows is not None:
                yield out, rows


def set_output_routed_experts(output, rows) -> None:
    output.routed_experts = rows
