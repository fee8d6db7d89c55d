"""The CPU core layout: when EngineCore shares the workers' cores, and how it is applied.

`plan` is a pure function of the CPUs EngineCore may use and the workers' bindings; pinning
itself is checked on real threads of a child process (it changes the caller's affinity).
The layout on a real server is checked in `api_server/test_capabilities.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from art_vllm_plugin.engine_core.core_pinning import ENV_VAR, CpuLayoutConfig, plan

AUTO, OFF = CpuLayoutConfig("auto"), CpuLayoutConfig("off")


def test_two_core_host_engine_core_shares_the_worker_core():
    assert plan({0, 1}, {0}, AUTO) == {0}


def test_three_cores_two_for_workers_leaves_one_core_for_the_api_server():
    assert plan({0, 1, 2}, {0, 1}, AUTO) == {0, 1}


def test_two_or_more_spare_cores_change_nothing():
    assert plan({0, 1, 2}, {0}, AUTO) is None
    assert plan(set(range(8)), {0, 1, 2, 3, 4, 5}, AUTO) is None


def test_unbound_workers_or_workers_on_every_core_change_nothing():
    assert plan({0, 1}, {0, 1}, AUTO) is None  # VLLM_CPU_OMP_THREADS_BIND=nobind
    assert plan({0, 1}, set(), AUTO) is None  # no worker process (in-process executor)


def test_off_changes_nothing():
    assert plan({0, 1}, {0}, OFF) is None


def test_mode_comes_from_the_environment_and_bad_values_are_refused():
    assert CpuLayoutConfig.from_env({}) == AUTO
    assert CpuLayoutConfig.from_env({ENV_VAR: "off"}) == OFF
    with pytest.raises(ValueError, match=r"one of auto, off, got 'sometimes'.*ART_VLLM_CPU"):
        CpuLayoutConfig.from_env({ENV_VAR: "sometimes"})


PIN = textwrap.dedent(
    """
    import json, os, threading
    from art_vllm_plugin.engine_core.core_pinning import pin_this_process, process_cpus

    started = threading.Event()
    stop = threading.Event()
    def idle():
        started.set()
        stop.wait()
    t = threading.Thread(target=idle)
    t.start()
    started.wait()
    moved = pin_this_process(frozenset({0}))
    late = []
    t2 = threading.Thread(target=lambda: late.append(sorted(os.sched_getaffinity(0))))
    t2.start(); t2.join()
    out = {"moved": moved, "threads": sorted(process_cpus(os.getpid())), "late": late[0]}
    stop.set(); t.join()
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable CPUs")
def test_pinning_moves_every_thread_and_threads_started_later_inherit_it():
    proc = subprocess.run(
        [sys.executable, "-c", PIN], capture_output=True, text=True, timeout=120, check=True
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["moved"] >= 2  # the main thread and the idle thread
    assert out["threads"] == [0]
    assert out["late"] == [0]
