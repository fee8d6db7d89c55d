"""CPU core layout on small CPU hosts: EngineCore shares the worker's core, the API server
keeps one for itself.

Why: on the CPU platform vLLM binds each worker's OpenMP threads to its cores (worker 0 takes
CPU 0 on a 2-core host) and leaves EngineCore unpinned. EngineCore's busy loop waits for the
worker's output by spinning on the shared-memory broadcast queue with `sched_yield`, so on the
one core left it competes with the API server all through a generation: `/health` and
`/art/v1/lora/update` requests wait up to seconds, and a short generation ends before an update
is even sent. EngineCore mostly waits for the worker, so the place where its spin costs least
is the worker's own core: there `sched_yield` hands the core to the worker it is waiting for,
and the remaining core is the API server's.

When: only where it helps. The layout is applied in the EngineCore process (the general plugin
wraps `EngineCoreProc.run_busy_loop`; workers are started and bound by then) when all hold:

- the mode is `auto` (`--art-cpu-layout {auto,off}`, default `auto`; the flag sets
  `ART_VLLM_CPU_LAYOUT` for the processes vLLM starts);
- the platform is CPU;
- the workers are bound to a strict subset of the CPUs EngineCore may use (not `nobind`);
- fewer than two of EngineCore's CPUs are left outside the workers' cores, i.e. EngineCore and
  the API server would otherwise share one core. With two or more spare cores nothing changes.

Then every EngineCore thread (existing ones, and so every thread they start) is confined to
the workers' cores. Turning the spin off instead loses wake-ups (tokens/s collapses), so the
spin stays and only its place changes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from art_vllm_plugin import compat
from art_vllm_plugin.engine_core.state import engine_state

logger = logging.getLogger("vllm.art_plugin.cpu_layout")

ENV_VAR = "ART_VLLM_CPU_LAYOUT"
MODES = ("auto", "off")


@dataclass(frozen=True)
class CpuLayoutConfig:
    """How the plugin lays out EngineCore's threads: `auto` (where it helps) or `off`."""

    mode: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"art CPU layout mode must be one of {', '.join(MODES)}, got {self.mode!r} "
                f"(--art-cpu-layout / {ENV_VAR})"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> CpuLayoutConfig:
        return cls(mode=environ.get(ENV_VAR, "auto").strip() or "auto")


def plan(
    allowed: Iterable[int], worker_cpus: Iterable[int], config: CpuLayoutConfig
) -> frozenset[int] | None:
    """The CPUs to confine EngineCore to, or None to leave it where vLLM put it.

    `allowed` are the CPUs EngineCore may run on; `worker_cpus` the union of the workers'
    bindings.
    """
    allowed, workers = frozenset(allowed), frozenset(worker_cpus)
    if config.mode == "off" or not workers or not workers < allowed:
        return None  # switched off, or workers unbound / on every core: nothing to keep free
    if len(allowed - workers) >= 2:
        return None  # EngineCore and the API server each find a core of their own
    return workers


def thread_ids(pid: int | str = "self") -> list[int]:
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))


def process_cpus(pid: int) -> frozenset[int]:
    """Union of the CPU affinities of every thread of process `pid`."""
    cpus: set[int] = set()
    for tid in thread_ids(pid):
        try:
            cpus |= os.sched_getaffinity(tid)
        except OSError:
            continue  # thread ended meanwhile
    return frozenset(cpus)


def pin_this_process(cpus: frozenset[int]) -> int:
    """Confine every thread of this process to `cpus`; returns how many threads were moved."""
    moved = 0
    for tid in thread_ids():
        try:
            os.sched_setaffinity(tid, cpus)
            moved += 1
        except OSError:
            continue
    return moved


def apply(engine_core, config: CpuLayoutConfig | None = None) -> frozenset[int] | None:
    """Apply the layout in this EngineCore process; returns the CPUs chosen, or None."""
    config = config or CpuLayoutConfig.from_env()
    if config.mode == "off" or not compat.is_cpu_platform():
        return None
    pids = compat.worker_pids(engine_core)
    if not pids:
        return None
    workers = frozenset().union(*(process_cpus(p) for p in pids))
    allowed = frozenset(os.sched_getaffinity(0))
    cpus = plan(allowed, workers, config)
    if cpus is None:
        logger.info(
            "art CPU layout: EngineCore left on CPUs %s (workers on %s, mode %s)",
            sorted(allowed),
            sorted(workers),
            config.mode,
        )
        return None
    moved = pin_this_process(cpus)
    logger.info(
        "art CPU layout: %d EngineCore threads share the workers' CPUs %s; CPUs %s stay free "
        "for the API server (--art-cpu-layout off to disable)",
        moved,
        sorted(cpus),
        sorted(allowed - cpus),
    )
    return cpus


def apply_once(engine_core) -> None:
    """Apply the layout the first time the busy loop starts in this EngineCore."""
    state = engine_state(engine_core)
    if state.cpu_layout_applied:
        return
    config = CpuLayoutConfig.from_env()  # a bad value is an error, not a silent default
    cpus = None
    try:
        cpus = apply(engine_core, config)
    except Exception:  # a layout problem must not take the engine down
        logger.exception("art CPU layout could not be applied; EngineCore left unpinned")
    state.cpu_layout = sorted(cpus) if cpus is not None else None
    state.cpu_layout_applied = True


def art_cpu_layout(self) -> list[int] | None:
    """Utility call: the CPUs EngineCore was confined to, or None if left alone."""
    return engine_state(self).cpu_layout


def layout_before_busy_loop(run_busy_loop):
    """Wrapper for `run_busy_loop`: apply the layout when it starts.

    Not in `__init__`: EngineCore loads the general plugins inside its own `__init__`, after
    the process's `EngineCoreProc` was already being constructed. The busy loop starts after
    construction, with every worker started and bound.
    """

    def run_busy_loop_laid_out(self):
        apply_once(self)
        return run_busy_loop(self)

    return run_busy_loop_laid_out
