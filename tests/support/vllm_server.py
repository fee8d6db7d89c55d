"""Test-side helpers for real `vllm serve` processes on the tiny model.

A server start costs about 30 s here, so test modules share one server through a
module-scoped fixture and start a fresh one only where a test needs a clean state.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / ".cache" / "tiny"

#: Serve flags for LoRA on the tiny model (docs/vllm-on-cpu.md "Serving").
LORA_ARGS = (
    "--enable-lora",
    "--max-lora-rank",
    "8",
    "--max-loras",
    "2",
    "--dtype",
    "bfloat16",
    "--max-model-len",
    "512",
)


def tiny_paths() -> tuple[Path, Path]:
    """(model dir, adapters dir) of the tiny model, generating it if `make tiny` has not run."""
    if not (TINY / "model" / "config.json").exists():
        from art_vllm_plugin.tiny_model import generate

        generate(TINY)
    return TINY / "model", TINY / "adapters"
