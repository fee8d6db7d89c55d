"""Test-only probes on a full-weight in-place write (`base_weights`), on only when the server
runs with ART_TEST_HOOKS=1: the serve suite makes the write fail where vLLM's layerwise reload
cannot undo it by itself, and checks what the write runs in.

- The `commit` fault (`art_test_inject_fault`, `POST /art/v1/test/fault {"kind": "commit"}`)
  makes the next base commit on that worker raise *inside* the model's `load_weights`, right
  after the first half of a fused layer: after the first `*gate_proj.weight` or
  `*up_proj.weight`, whichever comes first (files come sorted by name, a stream in the
  trainer's order), so that layer's fused `gate_up_proj` (or an expert's `w13`) holds one half
  of the new rows and none of the other. A failure there leaves the layer armed with half a
  pass buffered, the state a write-back must clear first (`compat.reload_weights_in_place`).
  A checkpoint with no such pair fails after its last tensor, still inside `load_weights`.
- Every write, the commit's and the write-back's, checks at its first tensor that vLLM's
  current config is the runner's, as weight processing that reads it (FP8 MoE kernels, DeepEP
  all2all set-up) needs: outside `set_current_vllm_config` the write fails, naming it.

Why weights, not a patched loader: the weights are what the write consumes inside
`load_weights`, so a probe on them runs where the write does and touches nothing of vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

from art_vllm_plugin import compat

TEST_HOOKS_ENV = "ART_TEST_HOOKS"
#: The `commit` fault raises after the first of these: one half of a fused gate/up layer.
FUSED_HALVES = ("gate_proj.weight", "up_proj.weight")


class InjectedWriteFailure(RuntimeError):
    """The `commit` fault: raised inside `load_weights`, in the middle of a layer."""


class OutsideConfigContext(RuntimeError):
    """The write ran without the runner's config as vLLM's current config."""


def probed(worker, weights: dict | Iterable, fail_mid_layer: bool = False) -> Iterable:
    """`weights` ((name, tensor) pairs, or a dict of them) as the write should consume them:
    unchanged without the test hooks, else through the probes above."""
    pairs = iter(weights.items() if isinstance(weights, dict) else weights)
    if os.environ.get(TEST_HOOKS_ENV) != "1":
        return pairs
    return _probe(worker, pairs, fail_mid_layer)


def _probe(worker, pairs: Iterator, fail_mid_layer: bool) -> Iterator:
    _check_config(worker)
    where = f"injected commit failure on rank {compat.worker_rank(worker)} inside load_weights"
    for name, tensor in pairs:
        yield name, tensor
        if fail_mid_layer and name.endswith(FUSED_HALVES):
            raise InjectedWriteFailure(f"{where}, after {name}, half of a layer (test hook)")
    if fail_mid_layer:
        raise InjectedWriteFailure(f"{where}, after its last tensor (test hook)")


def _check_config(worker) -> None:
    runner = compat.worker_model_runner(worker)
    current = compat.current_vllm_config_or_none()
    if current is not runner.vllm_config:
        state = "not set" if current is None else "another config than the runner's"
        raise OutsideConfigContext(
            "the in-place write runs outside vLLM's config context (the current vLLM config is "
            f"{state}; test hook)"
        )
