"""Test-side helpers for real `vllm serve` processes on the tiny model.

A server start costs about 30 s here, so test modules share one server through a
module-scoped fixture and start a fresh one only where a test needs a clean state.
"""

from __future__ import annotations

from pathlib import Path

from art_vllm_plugin.serve_process import tiny_lora_args

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / ".cache" / "tiny"

#: Serve flags for LoRA on the tiny model (docs/vllm-on-cpu.md "Serving").
LORA_ARGS = tiny_lora_args()


def tiny_paths() -> tuple[Path, Path]:
    """(model dir, adapters dir) of the tiny model, generating it if `make tiny` has not run."""
    if not (TINY / "model" / "config.json").exists():
        from art_vllm_plugin.tiny_model import generate

        generate(TINY)
    return TINY / "model", TINY / "adapters"
