"""Provenance under async scheduling: a token's version is that of the weights computing it.

On a GPU vLLM 0.32 schedules the next batch before the previous one's output is back
(`EngineCore.step_with_batch_queue`, two batches in flight). Utility calls, so slot updates,
run between two `step_fn` calls, while one batch is still in flight. The CPU platform turns
async scheduling off in its config check; here the real EngineCore is built in-process with
`async_scheduling` switched back on after that check (AsyncScheduler, batch queue of 2, the
worker's async output thread: all of it runs on CPU), and the test drives the step loop as
`EngineCoreProc.run_busy_loop` does, calling the update's utility methods between two steps
while a batch is in flight.
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import Future

import pytest

from art_protocol.provenance import slot_version
from art_vllm_plugin import compat, staging
from art_vllm_plugin.adapters import read_adapter_files

PROMPT_IDS = [5, 6, 7, 8, 9, 10, 11, 12]
TOKENS = 16
LORA_ID = 1


@pytest.fixture(scope="module")
def core(tiny_model, tiny_adapters):
    """A real EngineCore with async scheduling (batch queue of 2) and the plugin active."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor import Executor

    from art_vllm_plugin import plugin_loader

    saved = os.environ.get("VLLM_PLUGINS")
    os.environ["VLLM_PLUGINS"] = "art"  # the worker process loads the plugin too
    try:
        plugin_loader.activate()
        config = EngineArgs(
            model=str(tiny_model),
            enable_lora=True,
            max_lora_rank=8,
            max_loras=1,
            dtype="bfloat16",
            max_model_len=512,
            gpu_memory_utilization=0.2,
            enforce_eager=True,
        ).create_engine_config()
        config.scheduler_config.async_scheduling = True  # the CPU platform switched it off
        assert config.max_concurrent_batches == 2
        engine = compat.engine_core_class()(config, Executor.get_class(config), log_stats=False)
        yield engine
        engine.shutdown()
    finally:
        if saved is None:
            os.environ.pop("VLLM_PLUGINS", None)
        else:
            os.environ["VLLM_PLUGINS"] = saved


def _add(core, tiny_adapters, request_id: str) -> None:
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    request = EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(PROMPT_IDS),
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True),
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=compat.lora_request(
            lora_name="policy", lora_int_id=LORA_ID, lora_path=str(tiny_adapters / "a")
        ),
        cache_salt=None,
        data_parallel_rank=None,
    )
    core.add_request(*core.preprocess_add_request(request))


def _collect(outputs, tokens: list[tuple[int, int]]) -> None:
    """Append (token, version of the slot) for every new token in a step's outputs."""
    for eco in (outputs or {}).values():
        for out in eco.outputs:
            for tok in out.new_token_ids:
                tokens.append((tok, slot_version(eco.weight_version, LORA_ID)))


def _run_to_end(core, tokens) -> None:
    for _ in range(10 * TOKENS):
        outputs, _ = core.step_fn()
        _collect(outputs, tokens)
        if not core.scheduler.has_requests() and not core.batch_queue:
            return
    raise AssertionError("the request did not finish")


def _stage(core, tiny_adapters, tmp_path, version: int, tokens) -> str:
    """Stage as the busy loop would: the stage rides the next step (one `step_fn`), then the
    workers read the files on their thread while the engine waits."""
    token = uuid.uuid4().hex
    stage_dir = staging.new_stage_dir(staging.StagingConfig(tmp_path), "policy", version)
    staging.write_files(stage_dir, read_adapter_files(tiny_adapters / "b").as_files())
    res = core.art_stage_lora_update(token, LORA_ID, "policy", str(stage_dir), version)
    assert res["ok"], res
    outputs, _ = core.step_fn()
    _collect(outputs, tokens)
    for _ in range(3000):
        ready, failed = staging.poll(stage_dir, res["ranks"])
        assert not failed, failed
        if len(ready) == len(res["ranks"]):
            return token
        time.sleep(0.01)
    raise AssertionError("workers did not stage the adapter")


#: What every step sends the workers (the multiprocessing executor sends it as an RPC too).
STEP_METHODS = {"execute_model", "sample_tokens"}


def _count_worker_rpcs(core) -> list[str]:
    """Worker RPCs other than the steps themselves, from now on (filled as they are sent)."""
    executor = compat.engine_executor(core)
    sent: list[str] = []
    rpc = executor.collective_rpc

    def counted(method, *args, **kwargs):
        if method not in STEP_METHODS:
            sent.append(method if isinstance(method, str) else repr(method))
        return rpc(method, *args, **kwargs)

    executor.collective_rpc = counted
    return sent


def _answer(core, answer: Future, tokens) -> dict:
    """Step as the busy loop does until the utility's answer is there."""
    for _ in range(10):
        if answer.done():
            return answer.result()
        outputs, _ = core.step_fn()
        _collect(outputs, tokens)
    raise AssertionError("the commit was not answered within 10 steps")


def test_engine_core_runs_a_batch_queue_of_two_on_cpu(core):
    assert core.batch_queue is not None and core.batch_queue_size == 2
    assert core.step_fn.__name__ == "step_with_batch_queue"


def test_inflight_batch_keeps_the_version_it_was_scheduled_with(core, tiny_adapters, tmp_path):
    reference: list[tuple[int, int]] = []
    _add(core, tiny_adapters, "reference")
    _run_to_end(core, reference)
    assert [v for _, v in reference] == [0] * TOKENS

    tokens: list[tuple[int, int]] = []
    _add(core, tiny_adapters, "updated")
    for _ in range(5):  # a few steps of the request, then one more batch in flight
        outputs, _ = core.step_fn()
        _collect(outputs, tokens)
    rpcs = _count_worker_rpcs(core)
    # Between two steps, as the busy loop runs utility calls: stage (it rides the next step;
    # the worker reads the files on its thread while the in-flight batch computes) ...
    token = _stage(core, tiny_adapters, tmp_path, 1, tokens)
    returned = len(tokens)
    inflight = len(core.batch_queue)
    assert 0 < returned < TOKENS // 2 and inflight == 1, (returned, inflight)
    # ... then commit: it rides the next batch scheduled, so it is answered with that
    # batch's output, and the batch in flight is never drained.
    answer = core.art_commit_lora_update(token)
    assert isinstance(answer, Future) and not answer.done()
    result = _answer(core, answer, tokens)
    assert result["ok"], result
    assert result["inflight_batches"] == 1
    assert rpcs == [], f"the update sent worker RPCs {rpcs} (each drains the batch queue)"
    _run_to_end(core, tokens)

    assert len(tokens) == TOKENS
    versions = [v for _, v in tokens]
    k = versions.index(1)
    # The batch in flight at the commit was scheduled before it: labelled with version 0 ...
    assert k == returned + inflight, (versions, returned, inflight)
    assert versions == [0] * k + [1] * (TOKENS - k)
    # ... and computed by the old weights, as its label says; the next tokens by the new.
    ids = [t for t, _ in tokens]
    ref = [t for t, _ in reference]
    assert ids[:k] == ref[:k]
    assert ids[k : k + 6] != ref[k : k + 6], "the new weights must change the next tokens"


def test_waiting_requests_reads_the_schedulers_real_queues(core, tiny_adapters):
    scheduler = compat.engine_scheduler(core)
    for name in compat.WAITING_QUEUES:
        assert hasattr(scheduler, name), name
    _add(core, tiny_adapters, "waiting-probe")
    assert [r.request_id for r in compat.waiting_requests(scheduler)] == ["waiting-probe"]
    _run_to_end(core, [])

    class Renamed:
        waiting = ()

    with pytest.raises(RuntimeError, match="kv_holding_waiting"):
        list(compat.waiting_requests(Renamed()))
