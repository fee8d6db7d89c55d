"""vLLM names the worker-recorded labels reach (`worker/forward_labels.py`).

vLLM 0.32 `v1/outputs.py`: a step's `ModelRunnerOutput` (a plain dataclass, pickled to
EngineCore by the multiprocessing executor, so an extra attribute travels with it), the
shared `EMPTY_MODEL_RUNNER_OUTPUT`, and `AsyncModelRunnerOutput`, whose `get_output()` makes
the output later (async scheduling).
"""

from __future__ import annotations

from art_vllm_plugin.compat import names
from art_vllm_plugin.compat.patching import load


def is_async_runner_output(output) -> bool:
    return isinstance(output, load(names.ASYNC_MODEL_RUNNER_OUTPUT))


def is_shared_empty_runner_output(output) -> bool:
    return output is load(names.EMPTY_MODEL_RUNNER_OUTPUT)
