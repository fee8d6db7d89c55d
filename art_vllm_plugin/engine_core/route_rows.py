"""Route rows hold the MoE layers only, in the model's MoE layer order, on every runner.

Why: the trainer's route bundle and `docs/formats.md` have one row per token of shape
`(moe_layers, topk)`. The plugin's V1-runner capture (`worker/route_capture.py`) records the
MoE layers only; vLLM's native capture (Model Runner V2, what GPUs run) records a row slot for
every hidden layer, leaving dense layers' slots unwritten (the tiny Qwen3-MoE, layer 0 dense,
gave `(n, 3, 2)` there against `(n, 2, 2)`). Here, in EngineCore, each step's rows are cut to
the MoE layers before they leave the engine, so the stock `/v1` field and `/art` bundles agree,
whatever captured them.

The MoE layer ids come from the worker (`worker/route_layers.py`), asked once before the
busy loop starts (every worker is loaded then).
"""

from __future__ import annotations

import logging

from art_vllm_plugin import compat
from art_vllm_plugin.engine_core.state import engine_state
from art_vllm_plugin.routes import config as routes_config

logger = logging.getLogger(__name__)


def learn_layers(core) -> None:
    """Ask the workers for the MoE layer ids once (routes on, `--art-routes` given)."""
    state = engine_state(core)
    config = compat.engine_vllm_config(core)
    if state.route_layers is not None or not (
        routes_config.selected() and compat.routes_enabled(config)
    ):
        return
    replies = compat.engine_executor(core).collective_rpc("art_route_layer_ids")
    layers = list(replies[0])
    if any(list(r) != layers for r in replies):
        raise RuntimeError(f"art routes: workers disagree on the MoE layer ids: {replies}")
    if not layers:
        raise ValueError("--art-routes: the model has no MoE layers to capture")
    state.route_layers = layers
    state.route_total_layers = compat.total_layers(config)
    logger.info("art routes: rows hold MoE layers %s of %d", layers, state.route_total_layers)


def moe_rows_only(state, outputs) -> None:
    """Cut every output's rows of all layers down to the MoE layers (in place)."""
    layers = state.route_layers
    if layers is None or len(layers) == state.route_total_layers:
        return
    for out, rows in compat.output_routed_experts(outputs):
        if rows.ndim == 3 and rows.shape[1] == state.route_total_layers:
            compat.set_output_routed_experts(out, rows[:, layers, :])
        elif rows.ndim != 3 or rows.shape[1] != len(layers):
            raise RuntimeError(
                f"art routes: a row block of shape {rows.shape} is neither all "
                f"{state.route_total_layers} layers nor the {len(layers)} MoE layers"
            )


def layers_before_busy_loop(run_busy_loop):
    """Wrapper for `run_busy_loop`: learn the MoE layer ids when the loop starts."""

    def run_busy_loop_with_route_layers(self):
        learn_layers(self)
        return run_busy_loop(self)

    return run_busy_loop_with_route_layers


def cut_rows_on_outputs(attach_weight_version):
    """Wrapper for `EngineCore._attach_weight_version`: every step's outputs pass here."""

    def _attach_weight_version(self, outputs):
        attach_weight_version(self, outputs)
        moe_rows_only(engine_state(self), outputs)

    return _attach_weight_version
