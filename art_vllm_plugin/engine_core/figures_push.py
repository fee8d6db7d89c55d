"""Each engine's figures, sent to every API server: what `/art/metrics` reports per engine.

Why here: vLLM hands a step's stats to one API server only (`compat/figures.py`). With one API
server that one sees every step, and its stat logger adds them up; with several, an API server
sees only some steps of each engine (and none of an engine that drained while serving another
API server's requests: it kept reporting the running requests it last saw). So when an engine
answers several API servers it adds its own steps up (`EngineFigures`) and sends the record to
every API server that subscribed (`art_figures_subscribe`, called once by each):

- at most every `PUSH_INTERVAL_S` while it steps, and at once on the step that leaves it idle,
  so an idle engine is reported as it drained (0 running);
- at once when its slot registry's generation changes (an update committed, reverted or
  finished, a slot registered): the push carries the generation, so an API server answers
  `/art/metrics` from its cached registry until engine 0 says it changed.

Cost on the busy loop, only with several API servers: per step one pass over the step's
outputs (token counts, as vLLM's client-side `IterationStats` counts them) and a few field
writes; a push is one small message per subscriber, sent by vLLM's output thread. With one
API server nothing here runs but a dictionary lookup per step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from art_vllm_plugin.compat import figures as vllm_figures
from art_vllm_plugin.engine_core.state import engine_state
from art_vllm_plugin.engine_figures import EngineFigures

#: Longest interval between two pushes while the engine steps (the autotuner polls ~1/s).
PUSH_INTERVAL_S = 0.1


@dataclass
class FiguresPusher:
    """One engine's running figures and what it last sent."""

    figures: EngineFigures
    subscribers: set[int] = field(default_factory=set)  # API servers' client indexes
    pushed_at: float = -math.inf  # time.monotonic()
    pushed_idle: bool = False
    pushed_generation: int = -1


def pusher_of(core) -> FiguresPusher | None:
    """The engine's pusher (on its state), or None when it answers one API server (nothing
    to add up). Only the engine's busy loop reads or writes it."""
    state = engine_state(core)
    if not state.figures_decided:
        if vllm_figures.engine_client_count(core) > 1:
            state.figures = FiguresPusher(EngineFigures(vllm_figures.engine_dp_rank(core)))
        state.figures_decided = True
    return state.figures


def push(core, pusher: FiguresPusher) -> None:
    figures = pusher.figures
    vllm_figures.push_to_clients(core, sorted(pusher.subscribers), figures.row())
    pusher.pushed_at = time.monotonic()
    pusher.pushed_idle = figures.idle
    pusher.pushed_generation = figures.registry_generation


def on_step(core, outputs) -> None:
    """One step's outputs: add them up, push when due."""
    pusher = pusher_of(core)
    if pusher is None:
        return
    stats, tokens, preempted = vllm_figures.step_outputs_values(outputs)
    figures = pusher.figures
    if stats is not None:
        figures.add_step(time.time(), *vllm_figures.scheduler_stats_values(stats))
    figures.generation_tokens += tokens
    figures.preemptions += preempted
    if not pusher.subscribers:
        return
    figures.registry_generation = engine_state(core).registry.generation
    if (
        time.monotonic() - pusher.pushed_at >= PUSH_INTERVAL_S
        or (figures.idle and not pusher.pushed_idle)
        or figures.registry_generation != pusher.pushed_generation
    ):
        push(core, pusher)


def after_client_request(core) -> None:
    """After a client request (a utility call may have changed the registry): push a new
    registry generation at once."""
    pusher = engine_state(core).figures
    if pusher is None or not pusher.subscribers:
        return
    generation = engine_state(core).registry.generation
    if generation != pusher.pushed_generation:
        pusher.figures.registry_generation = generation
        push(core, pusher)


def art_figures_subscribe(self, client_index: int) -> list | None:
    """Utility call: API server `client_index` receives this engine's figures from now on;
    returns them as they are now (None: this engine answers one API server, whose stat
    logger sees every step)."""
    pusher = pusher_of(self)
    if pusher is None:
        return None
    pusher.subscribers.add(int(client_index))
    pusher.figures.registry_generation = engine_state(self).registry.generation
    return pusher.figures.row()


# --- wrappers (applied by art_vllm_plugin.install) ------------------------------------------
def figures_on_outputs(attach_weight_version):
    """Wrapper for `EngineCore._attach_weight_version`: called once per step's outputs."""

    def _attach_weight_version(self, outputs):
        attach_weight_version(self, outputs)
        on_step(self, outputs)

    return _attach_weight_version


def push_registry_changes(handle_client_request):
    """Wrapper for `EngineCoreProc._handle_client_request` (utility calls run in it)."""

    def _handle_client_request(self, request_type, request):
        handle_client_request(self, request_type, request)
        after_client_request(self)

    return _handle_client_request
