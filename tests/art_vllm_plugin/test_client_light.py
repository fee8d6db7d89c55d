"""The trainer-side client stays light: HTTP client, fleet and route decoding import no torch or
vLLM, even in an environment that has both (a trainer imports it next to its own stack)."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "vllm", "transformers", "megatron")

PROBE = (
    "import sys\n"
    "from art_protocol.client import ArtClient, Fleet, decode_routed_completion\n"
    "import art_protocol.client.routes as routes\n"
    "from art_megatron_ext.routing import decode_route_bundle, encode_route_bundle\n"
    "EXTRA"
    f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
    "print(heavy)\n"
    "sys.exit(1 if heavy else 0)\n"
)


def _probe(extra: str = "") -> subprocess.CompletedProcess:
    code = PROBE.replace("EXTRA", extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_client_fleet_and_route_decoding_import_no_heavy_module():
    done = _probe()
    assert done.returncode == 0, f"the client imported {done.stdout} {done.stderr}"


def test_the_probe_would_catch_a_heavy_import():
    """Reaching the torch half of the routing package makes the same probe fail."""
    done = _probe("from art_megatron_ext.routing import collate_routes\n")
    assert done.returncode == 1 and "torch" in done.stdout, done.stdout + done.stderr
