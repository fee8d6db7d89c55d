"""Route capture in the V1 worker (the CPU build), feeding vLLM's native routed-experts output.

Why here: vLLM 0.32 records routed experts only in Model Runner V2, which the CPU build cannot
run (no Triton). Everything around the worker is runner-agnostic and is reused as is: the
scheduler's AuxOutput connector tells the worker, per step, the first row each request must
emit (`routed_experts_prompt_start` and the emit cursor), takes the rows the step produced
(`take_output`), and the output processor concatenates them into
`CompletionOutput.routed_experts`, shape `[prompt_len + gen_len - 1 - prompt_start, layers,
topk]`. This module supplies the one missing piece, `ModelRunnerOutput.aux_output_connector_
output`:

1. vLLM's `bind_routed_experts_capturer` attaches our `capture(layer_id, topk_ids)` to every
   MoE router; the router calls it with the ids it actually selected for this forward's tokens.
2. After the forward, the rows are written into a `RouteSlotStore` at the KV slots of the
   tokens they belong to (`store.py` says why: cached prefix rows survive with their KV).
3. Each scheduled request emits rows `[emit_start, computed_end)` read from the store, so a
   prompt partly served from the prefix cache gets the rows of the forward that computed it.

Rows are kept only for the MoE layers (dense layers route nothing), in the model's MoE layer
order, as the trainer's route bundle expects.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from art_protocol.route_bundle import route_dtype_for
from art_vllm_plugin import compat
from art_vllm_plugin.routes.store import RouteSlotStore
from art_vllm_plugin.worker.state import worker_state

logger = logging.getLogger(__name__)


class RouterCapture:
    """The per-forward buffer the routers write (`[max_tokens, moe_layers, topk]`)."""

    def __init__(self, layer_ids: list[int], max_tokens: int, topk: int, dtype: np.dtype):
        self.index = {layer_id: i for i, layer_id in enumerate(layer_ids)}
        torch_dtype = torch.uint8 if dtype == np.uint8 else torch.int32
        self.buffer = torch.zeros((max_tokens, len(layer_ids), topk), dtype=torch_dtype)

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        self.buffer[: topk_ids.shape[0], self.index[layer_id]] = topk_ids

    def rows(self, num_tokens: int) -> np.ndarray:
        return self.buffer[:num_tokens].numpy()


class WorkerRouteCapture:
    """Capture state of one V1 model runner."""

    def __init__(self, runner) -> None:
        config = runner.vllm_config
        num_experts = compat.num_experts(config)
        self.topk = config.model_config.get_num_experts_per_tok()
        self.dtype = route_dtype_for(num_experts)  # the bundle's rule, defined once
        self.runner = runner
        self.layer_ids: list[int] = []
        self.capture: RouterCapture | None = None
        self.store: RouteSlotStore | None = None
        self.pending: dict = {}

    def bind(self, model) -> None:
        max_tokens = self.runner.scheduler_config.max_num_batched_tokens
        holder: list[RouterCapture] = []

        def capture(layer_id, topk_ids):
            holder[0].capture(layer_id, topk_ids)

        class _Capturer:  # bind_routed_experts_capturer takes `capturer.capture`
            pass

        capturer = _Capturer()
        capturer.capture = capture
        self.layer_ids = compat.bind_route_capture(model, capturer)
        if not self.layer_ids:
            raise ValueError("--art-routes: the model has no MoE layers to capture")
        self.capture = RouterCapture(self.layer_ids, max_tokens, self.topk, self.dtype)
        holder.append(self.capture)
        logger.info(
            "art routes: capturing MoE layers %s (top-%d) in the worker", self.layer_ids, self.topk
        )

    def _store(self) -> RouteSlotStore:
        if self.store is None:
            groups, num_blocks, block_size = compat.runner_kv_layout(self.runner)
            if groups != 1:
                raise ValueError(
                    f"--art-routes in the CPU worker needs one KV cache group, got {groups}"
                )
            self.store = RouteSlotStore(
                num_blocks, block_size, len(self.layer_ids), self.topk, self.dtype
            )
        return self.store

    def after_forward(self, scheduler_output) -> None:
        """Store this forward's rows by KV slot; stage each request's rows to emit."""
        self.pending = {}
        num_tokens = scheduler_output.total_num_scheduled_tokens
        metadata = compat.aux_output_metadata(scheduler_output)
        if not num_tokens or metadata is None or self.capture is None:
            return
        store = self._store()
        rows = self.capture.rows(num_tokens)
        req_ids, computed = compat.runner_batch(self.runner)
        offset = 0
        for index, req_id in enumerate(req_ids):
            count = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if not count:
                continue
            start = int(computed[index])
            block_ids = compat.runner_request_block_ids(self.runner, req_id)
            store.write(block_ids, start, rows[offset : offset + count])
            offset += count
            emit_start = metadata.requests.get(req_id)
            if emit_start is not None and emit_start < start + count:
                self.pending[req_id] = compat.aux_request_output(
                    emit_start, store.read(block_ids, emit_start, start + count)
                )
        if offset != num_tokens:
            raise RuntimeError(
                f"art routes: batch layout mismatch ({offset} rows placed of {num_tokens})"
            )

    def attach(self, output) -> None:
        if self.pending and hasattr(output, "aux_output_connector_output"):
            compat.set_aux_output(output, self.pending)
        self.pending = {}


def _enabled(runner) -> bool:
    return bool(runner.vllm_config.aux_output_config.enabled)


def bind_on_load(load_model):
    """Wrapper for the runner's `load_model`: bind the capture to the loaded model."""

    @functools.wraps(load_model)
    def load_model_with_capture(self, *args, **kwargs):
        result = load_model(self, *args, **kwargs)
        if _enabled(self):
            capture = worker_state(self).routes = WorkerRouteCapture(self)
            capture.bind(self.model)
        return result

    return load_model_with_capture


def store_after_forward(execute_model):
    """Wrapper for the runner's `execute_model`: store this forward's rows."""

    @functools.wraps(execute_model)
    def execute_model_with_capture(self, scheduler_output, *args, **kwargs):
        result = execute_model(self, scheduler_output, *args, **kwargs)
        capture = worker_state(self).routes
        if capture is not None:
            capture.after_forward(scheduler_output)
            if result is not None:  # returned without sampling (nothing to emit)
                capture.attach(result)
        return result

    return execute_model_with_capture


def emit_after_sampling(sample_tokens):
    """Wrapper for the runner's `sample_tokens`: attach the rows to emit to its output."""

    @functools.wraps(sample_tokens)
    def sample_tokens_with_capture(self, *args, **kwargs):
        result = sample_tokens(self, *args, **kwargs)
        capture = worker_state(self).routes
        if capture is not None:
            capture.attach(result)
        return result

    return sample_tokens_with_capture
