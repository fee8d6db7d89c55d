"""The complete state of an optimizer, for checkpoints: plain torch or Megatron's distributed.

Why: `torch.optim.Optimizer.state_dict()` holds everything (moments included), but
Megatron's `DistributedOptimizer.state_dict()` holds only hyper-parameters and the step: the
fp32 main parameters and the Adam moments live in its DP-sharded parameter state, which
Megatron saves through separate calls. Saving `state_dict()` alone would drop the moments
without a word. Here a Megatron optimizer (a `DistributedOptimizer` or a `ChainedOptimizer`
of them) is captured as its `state_dict()` plus, per trainable parameter (by name), this
rank's shard of the main parameter and of every moment, with the shard's range; restoring
checks that the ranges match (same DP size and bucket layout) and copies every tensor back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from art_megatron_ext import compat

__all__ = [
    "OptimizerLayoutError",
    "capture_optimizer_state",
    "is_megatron_distributed",
    "restore_optimizer_state",
]

KIND_TORCH = "torch"
KIND_DISTRIBUTED = "megatron-distributed"


class OptimizerLayoutError(RuntimeError):
    """A distributed optimizer checkpoint was written with another sharding of the state."""


def _parts(optimizer: Any) -> list[Any] | None:
    """The `DistributedOptimizer` parts of `optimizer`, or None for a plain optimizer."""
    if not type(optimizer).__module__.startswith("megatron."):
        return None
    parts = compat.chained_parts(optimizer)
    distributed = [compat.is_distributed_optimizer(p) for p in parts]
    if not any(distributed):
        return None  # Megatron's non-distributed optimizers keep moments in state_dict()
    if not all(distributed):
        raise TypeError(
            f"{type(optimizer).__name__} mixes distributed and non-distributed parts "
            f"({[type(p).__name__ for p in parts]}); checkpointing it is not supported"
        )
    return parts


def is_megatron_distributed(optimizer: Any) -> bool:
    return _parts(optimizer) is not None


def _names(params: Iterable[tuple[str, nn.Parameter]]) -> dict[int, str]:
    return {id(p): n for n, p in params}


def capture_optimizer_state(
    optimizer: Any, params: Iterable[tuple[str, nn.Parameter]]
) -> dict[str, Any]:
    """Everything needed to continue `optimizer` bit-exactly (live tensors, not copies)."""
    parts = _parts(optimizer)
    if parts is None:
        return {"kind": KIND_TORCH, "state_dict": optimizer.state_dict()}
    names = _names(params)
    captured = []
    for part in parts:
        param_state = {}
        for model_param in compat.distopt_model_params(part):
            name = names.get(id(model_param))
            if name is None:
                raise ValueError(
                    f"the distributed optimizer owns a parameter of shape "
                    f"{tuple(model_param.shape)} that is not among the model's trainable "
                    "parameters; build it over the same model"
                )
            tensors = compat.distopt_get_param_state(part, model_param)
            param_state[name] = {"shard": list(compat.distopt_param_shard(part, model_param))}
            param_state[name].update({k: v for k, v in tensors.items() if torch.is_tensor(v)})
        # A fresh torch-backed DistributedOptimizer (no step yet) cannot produce state_dict().
        has_state = len(part.optimizer.state) > 0
        captured.append(
            {"state_dict": part.state_dict() if has_state else None, "param_state": param_state}
        )
    return {"kind": KIND_DISTRIBUTED, "parts": captured}


def restore_optimizer_state(
    optimizer: Any, saved: Any, params: Iterable[tuple[str, nn.Parameter]], *, source: str
) -> None:
    """Load `saved` (from `capture_optimizer_state`, or a bare torch `state_dict`) into
    `optimizer`. Raises `OptimizerLayoutError` naming `source` on a sharding mismatch,
    before anything is changed."""
    parts = _parts(optimizer)
    kind = saved.get("kind") if isinstance(saved, dict) else None
    if kind is None:  # legacy shards: a bare torch state_dict
        kind, saved = KIND_TORCH, {"kind": KIND_TORCH, "state_dict": saved}
    want = KIND_TORCH if parts is None else KIND_DISTRIBUTED
    if kind != want:
        raise OptimizerLayoutError(
            f"{source} holds {kind!r} optimizer state but the job's optimizer is "
            f"{type(optimizer).__name__} ({want!r}); use the same optimizer kind or start "
            "from a fresh optimizer path. Nothing was loaded."
        )
    if parts is None:
        optimizer.load_state_dict(saved["state_dict"])
        return
    _check_layout(parts, saved["parts"], _names(params), source)
    names = _names(params)
    for part, part_saved in zip(parts, saved["parts"], strict=True):
        if part_saved["state_dict"] is not None:
            part.load_state_dict(part_saved["state_dict"])  # allocates the moment tensors
            _unshare_step_tensors(part.optimizer)
        for model_param in compat.distopt_model_params(part):
            tensors = dict(part_saved["param_state"][names[id(model_param)]])
            tensors.pop("shard")
            live = compat.distopt_get_param_state(part, model_param)
            missing = sorted(set(live) - set(tensors))
            if missing:
                raise OptimizerLayoutError(
                    f"{source} lacks optimizer state {missing} for {names[id(model_param)]}"
                )
            compat.distopt_set_param_state(part, model_param, tensors)


def _unshare_step_tensors(inner: Any) -> None:
    """Give every parameter its own Adam `step` tensor.

    megatron-core 0.19.2 `DistributedOptimizer.load_state_dict` (torch-optimizer fallback,
    no TE/Apex: optimizer/distrib_optimizer.py, `s["step"] = step` in the loop over states)
    puts one tensor object into every parameter's state, and torch keeps `step` uncopied
    when loading. torch's Adam then increments that shared tensor once per parameter per
    step, so every later bias correction is wrong. Separate copies restore the invariant.
    """
    seen: set[int] = set()
    for state in inner.state.values():
        step = state.get("step")
        if torch.is_tensor(step):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(step))


def _check_layout(parts: list[Any], saved: list[dict], names: dict[int, str], source: str) -> None:
    if len(saved) != len(parts):
        raise OptimizerLayoutError(
            f"{source} has {len(saved)} distributed optimizer parts, the job has {len(parts)}. "
            "Nothing was loaded."
        )
    for part, part_saved in zip(parts, saved, strict=True):
        have = {
            names[id(p)]: list(compat.distopt_param_shard(part, p))
            for p in compat.distopt_model_params(part)
        }
        got = {n: s["shard"] for n, s in part_saved["param_state"].items()}
        if have != got:
            diff = sorted(n for n in set(have) | set(got) if have.get(n) != got.get(n))
            raise OptimizerLayoutError(
                f"{source} was saved with another distributed-optimizer sharding (parameters "
                f"{diff[:4]}{'...' if len(diff) > 4 else ''} have other shard ranges on this "
                "rank): the data-parallel size or bucket layout changed. Resume with the saved "
                "layout. Nothing was loaded."
            )
