"""A full-weight update of a mixture-of-experts model on the CPU build: the experts' prepack.

Why: vLLM (0.32 to 0.34) processes a fused-MoE layer's weights in two steps: the quant method's
(`UnquantizedFusedMoEMethod.process_weights_after_loading`), then, on the first call only, the
experts' own (`moe_kernel.fused_experts.process_weights_after_loading`); a later call (an RL
weight update, which re-triggers processing) skips the second, since on CUDA it is a no-op by
default. On CPU it is not: `CPUUnquantizedExperts` prepacks `w13_weight` / `w2_weight` into the
grouped-GEMM layout its kernel reads. An update written without it serves the loaded layout as
if packed. Measured on the tiny Qwen3-MoE (vLLM 0.32, CPU): writing back the very weights it
served changed its greedy tokens from the first MoE layer on, by vLLM's layerwise reload (a
files update) and by the shard commit (a stream) alike.

So on the CPU platform (`install.install_worker`), every processing of such a layer that
vLLM treats as an update (its kernel exists) also runs the experts' step. Both write paths
start the layer from its loaded form, as a first load does (`compat.shard_forms`,
`compat.reload_weights_in_place`), so the step packs exactly what a first load would.
"""

from __future__ import annotations

import functools

from art_vllm_plugin import compat


def prepack_on_updates(process_weights_after_loading):
    """Wrapper for `UnquantizedFusedMoEMethod.process_weights_after_loading`."""

    @functools.wraps(process_weights_after_loading)
    def process_and_prepack_on_updates(self, layer):
        updating = getattr(self, "moe_kernel", None) is not None
        result = process_weights_after_loading(self, layer)
        experts = compat.cpu_prepacking_experts(self) if updating else None
        if experts is not None:
            experts.process_weights_after_loading(layer)
        return result

    return process_and_prepack_on_updates
