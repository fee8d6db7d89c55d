"""The worker's answer to "which host are you on" (`engine_core/worker_hosts.py`)."""

from __future__ import annotations

from art_vllm_plugin import host_layout


def art_host_id(self) -> str:
    """collective_rpc target: this worker's host (`host_layout.host_id`)."""
    return host_layout.host_id()
