"""A step's policy label, recorded by the worker at the forward that used the weights.

Why here and not in EngineCore: EngineCore knows which label was in force when it *scheduled*
a batch; only the worker knows which weights the forward *computed* with. They agree when the
executor orders a slot swap after every forward already sent (the multiprocessing executor's
queue, the in-process thread), but not in general (Ray runs RPCs concurrently with forwards;
pipeline stages and async scheduling overlap steps). So the worker holds the current label
beside its weights and changes both together: a swap (`lora_slot_writer` commit and rollback)
and a forward (`Worker.execute_model`) take the same lock, so neither runs inside the other.
The label read at the start of the forward rides back on that step's `ModelRunnerOutput`
(`art_weight_label`); EngineCore takes it as the batch's label and checks it against its own
stamp (`engine_core/batch_stamps.py`).

A worker that never saw a swap reports no label: the start weights, EngineCore's own label.

Slot updates ride the step (`step_rides`): the rides attached to a `SchedulerOutput` run at
the start of `execute_model`, inside the same lock and before the label is read, and their
results go back on the step's output (`art_ride_results`) beside the label.
"""

from __future__ import annotations

import copy
import functools

from art_vllm_plugin import compat
from art_vllm_plugin.worker import step_rides
from art_vllm_plugin.worker.state import worker_state

#: The attribute of `ModelRunnerOutput` that carries the label (pickled with the output).
LABEL_ATTR = "art_weight_label"
#: The attribute of `SchedulerOutput` that carries the step's rides (EngineCore sets it).
RIDES_ATTR = "art_rides"
#: The attribute of `ModelRunnerOutput` that carries the rides' results.
RIDE_RESULTS_ATTR = "art_ride_results"


def with_label(output, label: str | None, ride_results: list | None = None):
    """`output` carrying `label` (and the step's ride results); an async output gets them
    when its result is made."""
    if output is None or (label is None and ride_results is None):
        return output
    if compat.is_async_runner_output(output):
        get_output = output.get_output

        def get_output_labelled():
            return with_label(get_output(), label, ride_results)

        output.get_output = get_output_labelled
        return output
    if compat.is_shared_empty_runner_output(output):
        output = copy.copy(output)  # never label vLLM's shared empty output
    if label is not None:
        setattr(output, LABEL_ATTR, label)
    if ride_results is not None:
        setattr(output, RIDE_RESULTS_ATTR, ride_results)
    return output


def label_of(output) -> str | None:
    return getattr(output, LABEL_ATTR, None)


def ride_results_of(output) -> list | None:
    return getattr(output, RIDE_RESULTS_ATTR, None)


def label_forwards(execute_model):
    """Wrapper for `Worker.execute_model`: the forward runs under the weights lock and
    records the label in force."""

    @functools.wraps(execute_model)
    def execute_model_labelled(self, scheduler_output, *args, **kwargs):
        state = worker_state(self)
        rides = getattr(scheduler_output, RIDES_ATTR, None)
        with state.weights_lock:
            ridden = step_rides.run(self, rides) if rides else None
            label = state.forward_label = state.label
            output = execute_model(self, scheduler_output, *args, **kwargs)
        if output is None:  # sampled later: that output carries the ride results
            state.forward_rides = ridden
            return None
        return with_label(output, label, ridden)

    return execute_model_labelled


def label_sampled(sample_tokens):
    """Wrapper for `Worker.sample_tokens`: the output of a forward that returned none itself
    carries that forward's label (sampling reads the logits the forward computed)."""

    @functools.wraps(sample_tokens)
    def sample_tokens_labelled(self, *args, **kwargs):
        output = sample_tokens(self, *args, **kwargs)
        state = worker_state(self)
        ridden, state.forward_rides = state.forward_rides, None
        return with_label(output, state.forward_label, ridden)

    return sample_tokens_labelled
