"""The tuner imports with the base install: numpy at most, never torch, vLLM or an HTTP client."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "vllm", "httpx", "transformers")


def test_import_pulls_in_no_heavy_module():
    code = (
        "import sys, art_protocol.autotune\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"importing the tuner imported {done.stdout} {done.stderr}"


def test_the_check_would_catch_a_heavy_import():
    """The same probe fails once torch is imported (so the test above can fail)."""
    code = (
        "import sys, art_megatron_ext.packing\n"
        "art_megatron_ext.packing.pack_groups  # pack.py needs torch\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
