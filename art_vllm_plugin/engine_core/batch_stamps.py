"""Each step's outputs carry the label of the weights that computed them.

The source is the worker (`worker/forward_labels.py`): it records the label of its weights at
the forward, under the lock a slot swap also takes, and returns it with the step's
`ModelRunnerOutput`. What follows is EngineCore's own stamp, which is now the check: where the
two differ the worker's label is used and the mismatch counted (`label_mismatches` in
`/art/v1/engine`); on the executors the plugin serves on (`executor_guard`) they never do.
Outputs of a worker that has not swapped yet carry no label: the stamp stands.

Provenance under async scheduling: each batch carries the versions in force when scheduled.

vLLM 0.32 stamps a step's outputs with `EngineCore._weight_version` when the outputs are made
(`_attach_weight_version`, right after `scheduler.update_from_output`). With async scheduling
(the GPU default: `step_with_batch_queue`, two batches in flight) the engine loop runs utility
calls, and so slot updates, while a batch scheduled *before* the update is still computing; its
output comes back *after* the update, and stamping it then would label tokens computed by the
old weights with the new version.

The rule here: a batch's label is the one in force when the scheduler produced it. The
engine's scheduler is wrapped (per engine, before its first request) so `schedule()` records
the label for its `SchedulerOutput` and `update_from_output()` hands that label to
`_attach_weight_version`. The weights match the label because a commit rides the first batch
scheduled after it (`step_rides`): its engine side takes effect right before that batch is
scheduled, and every worker swaps at the start of that batch's step, after every batch
before it (the executor's channel to the workers is ordered), and on a GPU its copies run on
the stream that computes them. The wrappers are applied by `art_vllm_plugin.install`.
"""

from __future__ import annotations

import logging
import time

from art_vllm_plugin import compat
from art_vllm_plugin.engine_core import step_rides
from art_vllm_plugin.engine_core.state import EngineCoreState, engine_state
from art_vllm_plugin.worker.forward_labels import label_of

logger = logging.getLogger(__name__)

#: Batches whose output has not come back; more than a few means outputs were dropped.
_MAX_PENDING = 64
#: An interval between two outputs longer than this is idle time, not a step.
_IDLE_S = 0.5


def stamp_schedule(core, state: EngineCoreState):
    """Wrapper maker for one engine's `scheduler.schedule`: record each batch's label."""

    def make(schedule):
        s = state.stamps

        def stamped_schedule(*args, **kwargs):
            step_rides.before_schedule(state)  # a commit riding this batch takes effect
            output = schedule(*args, **kwargs)
            step_rides.after_schedule(state, output)
            s.scheduled += 1
            label = compat.engine_weight_label(core)
            s.pending[id(output)] = (label, state.leases.extend(label))
            while len(s.pending) > _MAX_PENDING:
                s.pending.popitem(last=False)
            return output

        return stamped_schedule

    return make


def label_update_from_output(state: EngineCoreState):
    """Wrapper maker for one engine's `scheduler.update_from_output`: the batch's label."""

    def make(update_from_output):
        s = state.stamps

        def labelled_update_from_output(scheduler_output, model_runner_output, *args, **kwargs):
            # First the rides this batch carried: a failed commit corrects pending stamps.
            step_rides.on_output(state, scheduler_output, model_runner_output)
            stamp = s.pending.pop(id(scheduler_output), None)
            s.output_label = batch_label(state, stamp, label_of(model_runner_output))
            return update_from_output(scheduler_output, model_runner_output, *args, **kwargs)

        return labelled_update_from_output

    return make


def batch_label(
    state: EngineCoreState, stamp: tuple[str | None, str | None] | None, worker: str | None
) -> str | None:
    """The batch's label: the worker's, checked against the engine's stamp `(label, label
    with leases)`; the stamp where the worker recorded none."""
    s = state.stamps
    if worker is None:
        return stamp[1] if stamp is not None else None
    s.worker_labelled += 1
    if stamp is not None and stamp[0] == worker:
        return stamp[1]
    s.label_mismatches += 1
    if s.label_mismatches == 1 or s.label_mismatches % 1000 == 0:
        logger.warning(
            "art: a batch stamped %r at scheduling was computed on %r (worker-recorded; "
            "used); %d such batches so far",
            stamp[0] if stamp is not None else None,
            worker,
            s.label_mismatches,
        )
    return state.leases.extend(worker)


def restamp(state: EngineCoreState, wrong: str | None, right: str | None) -> None:
    """Batches stamped `wrong` whose outputs are not back yet were computed on `right`'s
    weights (a commit that rode a step failed on the workers): stamp them `right`."""
    s = state.stamps
    for key, (label, _) in list(s.pending.items()):
        if label == wrong:
            s.pending[key] = (right, state.leases.extend(right))


def before_first_request(stamp_scheduler):
    """Wrapper maker for `EngineCore.add_request`: `stamp_scheduler(core)` once per engine,
    before its first request can be scheduled."""

    def make(add_request):
        def add_request_stamped(self, request, request_wave: int = 0):
            if not engine_state(self).stamps.scheduler_stamped:
                stamp_scheduler(self)
            return add_request(self, request, request_wave)

        return add_request_stamped

    return make


def on_outputs(core, state: EngineCoreState, outputs) -> None:
    """After vLLM stamped `outputs` with the current label: use the batch's own label."""
    s = state.stamps
    s.completed += 1
    now = time.perf_counter()
    if s.last_output_t is not None and now - s.last_output_t < _IDLE_S:
        s.busy_step_s += now - s.last_output_t
        s.busy_steps += 1
    s.last_output_t = now
    label, s.output_label = s.output_label, None
    if label is None:  # unrecorded batch: vLLM's stamp, plus pinned leases if any
        label = state.leases.current_if_pinned(compat.engine_weight_label(core))
    if label is not None:
        compat.set_output_weight_label(outputs, label)
    if state.hold_at_step is not None and s.completed >= state.hold_at_step:
        state.hold_at_step = None
        compat.freeze_running_requests(core)


def attach_batch_label(attach_weight_version):
    """Wrapper for `EngineCore._attach_weight_version`."""

    def _attach_weight_version(self, outputs):
        attach_weight_version(self, outputs)
        on_outputs(self, engine_state(self), outputs)

    return _attach_weight_version
