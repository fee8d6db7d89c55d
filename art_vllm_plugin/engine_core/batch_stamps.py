"""Provenance under async scheduling: each batch carries the versions in force when scheduled.

vLLM 0.32 stamps a step's outputs with `EngineCore._weight_version` when the outputs are made
(`_attach_weight_version`, right after `scheduler.update_from_output`). With async scheduling
(the GPU default: `step_with_batch_queue`, two batches in flight) the engine loop runs utility
calls, and so slot updates, while a batch scheduled *before* the update is still computing; its
output comes back *after* the update, and stamping it then would label tokens computed by the
old weights with the new version.

The rule here: a batch's label is the one in force when the scheduler produced it. This
module wraps the engine's scheduler so `schedule()` records the label for its
`SchedulerOutput` and `update_from_output()` hands that label to `_attach_weight_version`.
The weights match the label because a commit is ordered after every batch already launched:
the commit is a worker RPC sent after those batches' `execute_model`/`sample_tokens` on the
same ordered channel (the multiprocess executor's broadcast queue; the uniprocess executor's
single thread), and on a GPU its copies run on the stream that computes them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from art_vllm_plugin import compat
from art_vllm_plugin.engine_core import lease_versions

#: Batches whose output has not come back; more than a few means outputs were dropped.
_MAX_PENDING = 64


@dataclass
class BatchStamps:
    """Per-engine bookkeeping of scheduled batches and their labels."""

    scheduled: int = 0  # batches scheduled so far
    completed: int = 0  # batches whose outputs were made
    pending: OrderedDict[int, str] = field(default_factory=OrderedDict)  # id(output) -> label
    output_label: str | None = None
    last_output_t: float | None = None
    busy_step_s: float = 0.0  # sum of intervals between consecutive outputs while busy
    busy_steps: int = 0

    def mean_step_ms(self) -> float | None:
        return self.busy_step_s / self.busy_steps * 1000.0 if self.busy_steps else None


#: An interval between two outputs longer than this is idle time, not a step.
_IDLE_S = 0.5


def stamps(core) -> BatchStamps:
    s = core.__dict__.get("_art_batch_stamps")
    if s is None:
        s = core.__dict__["_art_batch_stamps"] = BatchStamps()
        _wrap_scheduler(core, s)
    return s


def _wrap_scheduler(core, s: BatchStamps) -> None:
    scheduler = compat.engine_scheduler(core)
    schedule, update_from_output = scheduler.schedule, scheduler.update_from_output

    def stamped_schedule(*args, **kwargs):
        output = schedule(*args, **kwargs)
        s.scheduled += 1
        s.pending[id(output)] = lease_versions.extend(core, compat.engine_weight_label(core))
        while len(s.pending) > _MAX_PENDING:
            s.pending.popitem(last=False)
        return output

    def labelled_update_from_output(scheduler_output, *args, **kwargs):
        s.output_label = s.pending.pop(id(scheduler_output), None)
        return update_from_output(scheduler_output, *args, **kwargs)

    scheduler.schedule = stamped_schedule
    scheduler.update_from_output = labelled_update_from_output


def on_outputs(core, outputs) -> None:
    """After vLLM stamped `outputs` with the current label: use the batch's own label."""
    s = stamps(core)
    s.completed += 1
    now = time.perf_counter()
    if s.last_output_t is not None and now - s.last_output_t < _IDLE_S:
        s.busy_step_s += now - s.last_output_t
        s.busy_steps += 1
    s.last_output_t = now
    label, s.output_label = s.output_label, None
    if label is None:  # unrecorded batch: vLLM's stamp, plus pinned leases if any
        label = lease_versions.current_if_pinned(core)
    if label is not None:
        compat.set_output_weight_label(outputs, label)


def install(engine_core_cls) -> None:
    """Wrap `_attach_weight_version`; the scheduler is wrapped per engine on first use."""
    lease_versions.install(engine_core_cls)

    def make(original):
        def _attach_weight_version(self, outputs):
            original(self, outputs)
            on_outputs(self, outputs)

        return _attach_weight_version

    compat.wrap_engine_attach_weight_version(engine_core_cls, make)
