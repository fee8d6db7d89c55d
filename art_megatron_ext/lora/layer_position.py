"""Where a linear sits in a Megatron model: its parallel group's size and rank, the
transformer layer that holds it, and (for experts) its global expert index. Both the plain and
the grouped site builders (`attach.py`, `grouped.py`) read these."""

from __future__ import annotations

import re

import torch

_LOCAL_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


def group_size_rank(group) -> tuple[int, int]:
    if group is None or not torch.distributed.is_initialized():
        return 1, 0
    return group.size(), group.rank()


def layer_number(path: str, modules: dict[str, torch.nn.Module]) -> int | None:
    """Megatron's 1-based global `layer_number` of the transformer layer holding `path`."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 1, -1):
        number = getattr(modules.get(".".join(parts[:cut])), "layer_number", None)
        if parts[cut - 2] == "layers" and isinstance(number, int):
            return number
    return None


def expert_index(path: str, modules: dict[str, torch.nn.Module]) -> int | None:
    """Global expert index of a `SequentialMLP` expert linear (EP rank * local count + i)."""
    match = _LOCAL_EXPERT.search(f".{path}.")
    if match is None:
        return None
    experts = modules[path[: path.index(".local_experts.")]]
    return local_expert_offset(experts) + int(match.group(1))


def local_expert_offset(experts: torch.nn.Module) -> int:
    """Global index of the first local expert of an experts module (SequentialMLP/TEGroupedMLP)."""
    ep_rank = group_size_rank(getattr(experts, "ep_group", None))[1]
    return ep_rank * int(experts.num_local_experts)
