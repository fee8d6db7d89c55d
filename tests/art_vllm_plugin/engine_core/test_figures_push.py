"""An engine that answers several API servers adds its steps up and pushes them to all.

vLLM's real step outputs (`EngineCoreOutputs` with `SchedulerStats` and token events), its
msgpack encoding and its client-side `_process_utility_output` carry the pushes here; the
engine is a stand-in with the attributes the plugin reads (output sockets, output queue, DP
rank). The served behaviour (two API servers, two engines) is
`tests/art_vllm_plugin/api_server/test_dp_metrics.py`.
"""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
from vllm.v1.engine import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
)
from vllm.v1.engine.core_client import _process_utility_output
from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from art_vllm_plugin.api_server.metrics_feed import MetricsFeed
from art_vllm_plugin.compat import figures as vllm_figures
from art_vllm_plugin.engine_core import figures_push
from art_vllm_plugin.engine_core.state import engine_state
from art_vllm_plugin.engine_figures import EngineFigures


class StandInEngine:
    """What the plugin reads of an `EngineCoreProc`: one output socket per API server, the
    output queue its output thread sends from, its DP rank."""

    def __init__(self, api_servers: int, dp_rank: int):
        self.addresses = SimpleNamespace(outputs=[f"ipc://client-{i}" for i in range(api_servers)])
        self.output_queue = queue.Queue()
        self.engine_index = dp_rank


def engine(api_servers: int, dp_rank: int = 1) -> StandInEngine:
    return StandInEngine(api_servers, dp_rank)


def step(running: int, waiting: int = 0, tokens_per_request: int = 1, preempted: int = 0):
    """One step's outputs: `running` requests of client 0 each get tokens; stats attached to
    client 0 only, as vLLM does."""
    prefix = PrefixCacheStats()
    prefix.queries, prefix.hits = 8, 4
    outs = [
        EngineCoreOutput(
            request_id=f"r{i}",
            new_token_ids=[1] * tokens_per_request,
            events=[EngineCoreEvent.new_event(EngineCoreEventType.PREEMPTED)]
            if i < preempted
            else None,
        )
        for i in range(running)
    ]
    stats = SchedulerStats(
        num_running_reqs=running, num_waiting_reqs=waiting, prefix_cache_stats=prefix
    )
    return {0: EngineCoreOutputs(outputs=outs, scheduler_stats=stats)}


def queued(core) -> list[tuple[int, EngineCoreOutputs]]:
    out = []
    while not core.output_queue.empty():
        out.append(core.output_queue.get_nowait())
    return out


def test_with_one_api_server_nothing_is_added_up_or_pushed():
    core = engine(api_servers=1)
    figures_push.on_step(core, step(3))
    assert figures_push.pusher_of(core) is None
    assert figures_push.art_figures_subscribe(core, 0) is None
    assert queued(core) == []


def test_steps_are_added_up_and_a_subscriber_gets_them_at_once():
    core = engine(api_servers=2)
    figures_push.on_step(core, step(3, tokens_per_request=2, preempted=1))
    figures_push.on_step(core, step(3))
    assert queued(core) == [], "nobody subscribed yet"
    row = figures_push.art_figures_subscribe(core, 1)
    figures = EngineFigures.from_row(row)
    assert (figures.engine, figures.steps, figures.num_running) == (1, 2, 3)
    assert (figures.generation_tokens, figures.preemptions) == (9, 1)
    assert (figures.prefix_queries, figures.prefix_hits) == (16, 8)


def test_pushes_go_to_every_subscriber_when_due_and_at_once_on_draining():
    core = engine(api_servers=2)
    figures_push.art_figures_subscribe(core, 0)
    figures_push.art_figures_subscribe(core, 1)
    queued(core)
    figures_push.on_step(core, step(2))  # first push: due at once
    first = queued(core)
    assert [client for client, _ in first] == [0, 1]
    figures_push.on_step(core, step(2))  # within PUSH_INTERVAL_S of the last push
    assert queued(core) == []
    figures_push.on_step(core, step(0))  # drained: pushed at once
    drained = queued(core)
    assert [client for client, _ in drained] == [0, 1]
    rows = {c: EngineFigures.from_row(m.utility_output.result.result) for c, m in drained}
    assert rows[0] == rows[1] and rows[0].num_running == 0 and rows[0].steps == 3


def test_a_registry_change_in_a_utility_call_is_pushed_at_once():
    core = engine(api_servers=2)
    figures_push.art_figures_subscribe(core, 0)
    figures_push.after_client_request(core)
    queued(core)
    figures_push.after_client_request(core)  # nothing changed
    assert queued(core) == []
    engine_state(core).registry.generation += 1  # e.g. a commit
    figures_push.after_client_request(core)
    ((client, message),) = queued(core)
    pushed = EngineFigures.from_row(message.utility_output.result.result)
    assert client == 0 and pushed.registry_generation == engine_state(core).registry.generation


def test_a_push_reaches_the_api_servers_feed_through_vllms_own_client_path():
    """Encoded and decoded as vLLM's sockets carry it, handed over by vLLM's client code to
    the receiver, which stays in place for the next push."""
    core = engine(api_servers=2, dp_rank=1)
    figures_push.art_figures_subscribe(core, 1)
    queued(core)
    figures_push.on_step(core, step(2, tokens_per_request=3))
    (_, message), *_ = queued(core)
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(message))

    feed = MetricsFeed()
    client = SimpleNamespace(engine_core=SimpleNamespace(utility_results={}, client_index=1))
    vllm_figures.listen_for_pushes(client, feed.apply_row)
    for _ in range(2):
        _process_utility_output(decoded.utility_output, client.engine_core.utility_results)
    assert vllm_figures.PUSH_CALL_ID in client.engine_core.utility_results
    entry = feed.snapshot([], 0)["engines"][0]
    assert (entry["engine"], entry["num_running"], entry["generation_tokens_total"]) == (1, 2, 6)
    assert feed.registry_generation(1) == 0


@pytest.mark.parametrize("api_servers", [1, 2])
def test_the_output_wrapper_keeps_vllms_stamp(api_servers):
    core = engine(api_servers)
    stamped = []
    wrapped = figures_push.figures_on_outputs(lambda self, outputs: stamped.append(outputs))
    outputs = step(1)
    wrapped(core, outputs)
    assert stamped == [outputs]
