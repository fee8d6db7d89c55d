"""Paths and names shared by the megatron-bridge evaluation scripts in this folder.

Why: every script reads the same zoo folder (written by `write_zoo.py`) and the same saved
Hugging Face logits, and imports the project (`art_megatron_ext`) and its test helpers
(`tests/support`, the zoo test's rank worker) from this checkout, wherever it lies.
Not run on its own.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
ZOO_TEST_DIR = TESTS / "art_megatron_ext" / "weights"  # test_model_zoo.py: prompts, worker

HF_LOGITS = "hf_logits.pt"  # {"prompts": [2, 48] tokens, name: HF fp32 logits}, in the zoo
# Qwen3-MoE with every layer MoE (mlp_only_layers=[]), like the published checkpoints; the
# zoo's own entry has a dense layer 0.
ALL_MOE = "qwen3-moe-allmoe"
MODELS = (
    "llama3.1",
    "llama3.2",
    "qwen2.5",
    "qwen3",
    "qwen3-moe",
    ALL_MOE,
    "deepseek-v3",
)


def use_repo() -> None:
    """Put the checkout, its tests folder and the zoo test's folder first on `sys.path`."""
    for path in (ZOO_TEST_DIR, TESTS, REPO):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
