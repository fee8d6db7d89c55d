"""An engine whose workers sit on other hosts stops before its first step, naming them
(art_vllm_plugin.engine_core.worker_hosts, host_layout.check_worker_hosts; issue 36 item 6).

Why: vLLM's Ray executor places workers on Ray nodes the config does not show, and a worker on
another host can neither read its engine's stage nor leave its marker there. Ray nodes on one
host are served (the shared ray_tp2 server runs through this check on every start:
test_ray_executor.py); a second host is not available here, so the refusal is checked on the
hosts the workers would report."""

from __future__ import annotations

import pytest

from art_vllm_plugin import host_layout

pytestmark = pytest.mark.serve


def test_a_host_is_its_name_and_its_boot():
    me = host_layout.host_id()
    assert me == host_layout.host_id()
    assert " (boot " in me and "unknown" not in me


def test_workers_on_the_engines_host_pass():
    me = host_layout.host_id()
    host_layout.check_worker_hosts(me, [me, me])


def test_workers_on_another_host_are_refused_naming_them():
    me = host_layout.host_id()
    other = "node-b (boot 0b0b)"
    with pytest.raises(ValueError) as refused:
        host_layout.check_worker_hosts(me, [me, other, other])
    message = str(refused.value)
    assert message.startswith(
        f"one engine's workers span hosts: worker 1 on {other}, worker 2 on {other}, "
        f"the engine on {me}"
    )
    assert "Ray" in message and "--headless" in message
