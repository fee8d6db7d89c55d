"""The worker records each step's label at the forward; EngineCore checks its stamp against it.

Real vLLM output objects (`ModelRunnerOutput`, the shared empty output, pickling as the
multiprocessing executor sends them); a stand-in worker only where a model is not the point
(the lock between a forward and a swap). End to end, on real servers: test_inflight_update
(`worker_labelled`, `label_mismatches` in `/art/v1/engine`).
"""

from __future__ import annotations

import pickle
import threading
from types import SimpleNamespace

import pytest

from art_vllm_plugin import compat
from art_vllm_plugin.engine_core.batch_stamps import batch_label
from art_vllm_plugin.engine_core.state import EngineCoreState
from art_vllm_plugin.worker import forward_labels
from art_vllm_plugin.worker.state import WorkerState, worker_state

pytestmark = pytest.mark.serve


def _output(req: str = "r1"):
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(req_ids=[req], req_id_to_index={req: 0}, sampled_token_ids=[[7]])


def test_the_label_travels_with_the_pickled_output():
    out = forward_labels.with_label(_output(), "art:v1:policy=3")
    back = pickle.loads(pickle.dumps(out))
    assert forward_labels.label_of(back) == "art:v1:policy=3"


def test_vllms_shared_empty_output_is_never_labelled():
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    out = forward_labels.with_label(EMPTY_MODEL_RUNNER_OUTPUT, "L2")
    assert forward_labels.label_of(out) == "L2"
    assert forward_labels.label_of(EMPTY_MODEL_RUNNER_OUTPUT) is None
    assert out is not EMPTY_MODEL_RUNNER_OUTPUT


def test_no_swap_yet_means_no_label():
    out = _output()
    assert forward_labels.with_label(out, None) is out
    assert forward_labels.label_of(out) is None


def test_an_async_output_is_labelled_when_it_is_made():
    from vllm.v1.outputs import AsyncModelRunnerOutput

    made = _output()

    class Pending(AsyncModelRunnerOutput):
        def get_output(self):
            return made

    out = forward_labels.with_label(Pending(), "L5")
    assert forward_labels.label_of(out.get_output()) == "L5"


def _worker() -> SimpleNamespace:
    worker = SimpleNamespace(model_runner=SimpleNamespace())
    compat.attach_state(worker.model_runner, WorkerState())
    return worker


def test_a_swap_waits_for_the_forward_and_the_forward_keeps_its_label():
    """The forward holds the weights lock: a swap that arrives mid-forward (as a concurrent
    executor would send it) runs after it, and the forward's output names the old label."""
    worker = _worker()
    state = worker_state(worker)
    state.label = "old"
    in_forward, finish = threading.Event(), threading.Event()

    def forward(self, scheduler_output):
        in_forward.set()
        assert finish.wait(10)
        return _output()

    execute_model = forward_labels.label_forwards(forward)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("out", execute_model(worker, None)))
    t.start()
    assert in_forward.wait(10)

    def swap():
        with state.weights_lock:
            state.label = "new"

    s = threading.Thread(target=swap)
    s.start()
    s.join(0.2)
    assert s.is_alive(), "the swap ran inside the forward"
    finish.set()
    t.join(10)
    s.join(10)
    assert forward_labels.label_of(result["out"]) == "old"
    assert state.label == "new"
    assert forward_labels.label_of(execute_model(worker, None)) == "new"  # the next forward


def test_sampling_carries_the_label_of_its_forward():
    worker = _worker()
    state = worker_state(worker)
    state.label = "v1"
    execute_model = forward_labels.label_forwards(lambda self, so: None)
    sample_tokens = forward_labels.label_sampled(lambda self, grammar: _output())
    assert execute_model(worker, None) is None  # logits computed, sampling later
    state.label = "v2"  # a swap between the forward and its sampling
    assert forward_labels.label_of(sample_tokens(worker, None)) == "v1"


@pytest.mark.parametrize(
    ("stamp", "worker", "label", "mismatches"),
    [
        (("A", "A+lease"), None, "A+lease", 0),  # no swap yet: the stamp stands
        (("A", "A+lease"), "A", "A+lease", 0),  # agree: the stamp with its leases
        (None, None, None, 0),
    ],
)
def test_engine_label_when_worker_and_stamp_agree(stamp, worker, label, mismatches):
    state = EngineCoreState()
    assert batch_label(state, stamp, worker) == label
    assert state.stamps.label_mismatches == mismatches


def test_engine_takes_the_worker_label_when_they_differ_and_counts_it():
    from art_protocol.provenance import encode_versions

    state = EngineCoreState()
    state.leases.pinned = {9: 4}
    computed_on = encode_versions({1: 3})
    stamped = encode_versions({1: 2})
    got = batch_label(state, (stamped, state.leases.extend(stamped)), computed_on)
    assert got == encode_versions({1: 3, 9: 4})  # the worker's, with the pinned lease
    assert state.stamps.label_mismatches == 1
    assert state.stamps.worker_labelled == 1


def test_rides_run_before_the_forward_inside_the_lock_and_their_results_ride_back(monkeypatch):
    """A batch carrying rides (engine_core/step_rides.py): the worker runs them at the start of
    the step, holding the weights lock, before it reads the label; a commit's new label is the
    label of that very forward, and the rides' results go back with the step's sampled
    output (only that step's)."""
    worker = _worker()
    state = worker_state(worker)
    state.label = "old"
    ran = []

    def run(w, rides):
        assert state.weights_lock._is_owned(), "a ride ran outside the weights lock"
        ran.append(rides)
        state.label = "new"  # what a commit ride does
        return [{"ok": True}]

    monkeypatch.setattr(forward_labels.step_rides, "run", run)
    execute_model = forward_labels.label_forwards(lambda self, so: None)
    sample_tokens = forward_labels.label_sampled(lambda self, grammar: _output())
    batch = SimpleNamespace(**{forward_labels.RIDES_ATTR: [("commit", "t", ("new",))]})
    assert execute_model(worker, batch) is None
    out = sample_tokens(worker, None)
    assert ran == [[("commit", "t", ("new",))]]
    assert forward_labels.label_of(out) == "new"
    assert forward_labels.ride_results_of(out) == [{"ok": True}]
    back = pickle.loads(pickle.dumps(out))  # as the multiprocessing executor sends it
    assert forward_labels.ride_results_of(back) == [{"ok": True}]
    assert execute_model(worker, SimpleNamespace()) is None  # the next batch carries none
    assert forward_labels.ride_results_of(sample_tokens(worker, None)) is None
    assert len(ran) == 1


def test_abort_and_final_rides_free_what_the_worker_holds_for_an_update():
    """An ABORT ride drops the update's staged copies, a FINAL ride the undo copy its commit
    kept (engine_core/abandoned_updates.py sends them); other updates keep theirs."""
    from art_vllm_plugin.worker import step_rides
    from art_vllm_plugin.worker.state import StagedUpdate, Undo

    worker = _worker()
    state = worker_state(worker)
    state.staged.update(gone=StagedUpdate(1), kept=StagedUpdate(2))
    state.undo.update(final=Undo(1, None, None, "old"), open=Undo(2, None, None, "old"))
    results = step_rides.run(worker, [("abort", "gone", ()), ("final", "final", ())])
    assert results == [None, None]
    assert set(state.staged) == {"kept"} and set(state.undo) == {"open"}
