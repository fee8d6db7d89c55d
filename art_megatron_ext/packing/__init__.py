"""Prefix-tree packing of trajectory groups into fixed-length training rows.

See `pack.py` for the pipeline and `attention.py` for the attention rule the rows imply.
The exports resolve lazily (module `__getattr__`): `pack.py` and `attention.py` need torch.
The numpy-only planning steps (trajectory checks, the prefix tree, row placement) live in the
light shared package `art_protocol.packing`, because the autotuner (which imports no torch)
uses them to estimate how many groups fit a row budget.
"""

from __future__ import annotations

from importlib import import_module

_EXPORTS = {
    "PackedBatch": "pack",
    "PackingConfig": "pack",
    "PackingInputError": "art_protocol.packing.inputs",
    "PackingStats": "pack",
    "Trajectory": "art_protocol.packing.inputs",
    "TrajectoryGroup": "art_protocol.packing.inputs",
    "pack_groups": "pack",
    "tree_attention_mask": "attention",
    "TreeAttentionConfig": "tree_attention",
    "plan_tree_attention": "tree_attention",
    "predecessor_logprobs": "logprobs",
    "TreeCoreAttention": "spec",
    "TreePackedSeqParams": "spec",
    "enable_tree_attention": "spec",
    "tree_layer_spec": "spec",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    path = module if "." in module else f"{__name__}.{module}"
    return getattr(import_module(path), name)


__all__ = sorted(_EXPORTS)
