"""Where a linear sits in a Megatron model: its parallel group's size and rank, the
decoder layer that holds it, and (for experts) its global expert index. Both the plain and
the grouped site builders (`attach.py`, `grouped.py`) read these.

Decoder layers are numbered as a GPT counts them (one layer = attention + MLP), whichever
model class holds them. In a `GPTModel` that is Megatron's `layer_number`. A `HybridModel`
(megatron-core 0.19's successor of `GPTModel`) gives attention and MLP a layer each (pattern
`*-*-` for two GPT layers), so there a site's number comes from Megatron's own GPT <-> Hybrid
pairing (`dist_checkpointing/gpt_checkpoint_interop.py`): the i-th `*` position holds GPT layer
i's attention, the i-th `-` or `E` position its MLP. LoRA init seeds and Hugging Face names
then match the GPTModel of the same shape (docs/megatron-settings.md, "HybridModel").
"""

from __future__ import annotations

import re
import sys

import torch

_LOCAL_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


def group_size_rank(group) -> tuple[int, int]:
    if group is None or not torch.distributed.is_initialized():
        return 1, 0
    return group.size(), group.rank()


class UnsupportedLayerPattern(ValueError):
    """A LoRA target in a `HybridModel` layer that has no GPT-equivalent decoder layer (the
    message names the site, the pattern and what is supported)."""


def layer_number(path: str, modules: dict[str, torch.nn.Module]) -> int | None:
    """1-based global number of the GPT-style decoder layer holding `path` (see above);
    None outside decoder layers. Raises `UnsupportedLayerPattern` for a `HybridModel` site
    that cannot be paired with a GPT layer."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 1, -1):
        number = getattr(modules.get(".".join(parts[:cut])), "layer_number", None)
        if parts[cut - 2] == "layers" and isinstance(number, int):
            stack_path = ".".join(parts[: cut - 2])
            if _is_hybrid_stack(modules.get(stack_path)):
                return _hybrid_gpt_layer(path, stack_path, number - 1, modules)
            return number
    return None


def _is_hybrid_stack(module) -> bool:
    """Whether `module` is Megatron's `HybridStack` (a `HybridModel`'s decoder). Imports
    nothing: a model holds one only if its module was imported."""
    hybrid_block = sys.modules.get("megatron.core.models.hybrid.hybrid_block")
    return hybrid_block is not None and isinstance(module, hybrid_block.HybridStack)


# Megatron 0.19's layer symbols (`hybrid_layer_allocation.Symbols`): what we can pair.
_ATTENTION, _MLPS, _PIPE, _MTP = "*", ("-", "E"), "|", "/"


def gpt_layer_pairs(pattern: str) -> list[tuple[int, int]]:
    """For each GPT layer of a `HybridModel` with `hybrid_layer_pattern` `pattern`, in order:
    (global index of its attention layer, global index of its MLP layer), e.g. `*-*-` ->
    [(0, 1), (2, 3)]. The i-th `*` and the i-th `-` or `E` of the main pattern (before `/`,
    `|` ignored) form GPT layer i, as in Megatron's GPT <-> Hybrid checkpoint pairing.

    Raises `UnsupportedLayerPattern` when the pattern holds other layer kinds (Mamba `M`,
    GDN `G`, MLA `+`, DSA `D`: no Llama-style Hugging Face layer) or unequal or zero counts.
    """
    main = pattern.split(_MTP)[0].replace(_PIPE, "")
    attention = [i for i, s in enumerate(main) if s == _ATTENTION]
    mlps = [i for i, s in enumerate(main) if s in _MLPS]
    other = sorted(set(main) - {_ATTENTION, *_MLPS})
    if other or len(attention) != len(mlps) or not attention:
        raise UnsupportedLayerPattern(
            f"HybridModel pattern {pattern!r} does not pair into GPT layers. Sites are numbered "
            "as GPT layers (Megatron's GPT <-> Hybrid pairing: the i-th '*' and the i-th '-' or "
            "'E' form layer i) and named as a Llama-style Hugging Face model, so the main "
            "pattern may hold only '*', '-' and 'E', as many '*' as '-'/'E' "
            f"(this one: {len(attention)} '*', {len(mlps)} '-'/'E'"
            + (f", and {other}" if other else "")
            + ")"
        )
    return list(zip(attention, mlps, strict=True))


def _hybrid_gpt_layer(path: str, stack_path: str, index: int, modules) -> int:
    """GPT layer number (1-based) of the site at `path`, in global hybrid layer `index` of the
    `HybridStack` at `stack_path`, from the owning `HybridModel`'s `hybrid_layer_pattern`."""
    owner = modules.get(stack_path.rpartition(".")[0])
    pattern = getattr(owner, "hybrid_layer_pattern", None)
    if getattr(owner, "decoder", None) is not modules.get(stack_path) or pattern is None:
        raise UnsupportedLayerPattern(
            f"{path}: LoRA on a HybridStack is supported in a HybridModel's decoder only "
            f"(this one is at {stack_path!r}, e.g. a multi-token-prediction layer); nothing "
            "was attached"
        )
    try:
        pairs = gpt_layer_pairs(pattern)
    except UnsupportedLayerPattern as exc:
        raise UnsupportedLayerPattern(f"{path}: {exc}; nothing was attached") from None
    return next(n for n, pair in enumerate(pairs, 1) if index in pair)


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
