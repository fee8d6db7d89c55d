"""Prefix-tree packing of trajectory groups into fixed-length training rows.

See `pack.py` for the pipeline and `attention.py` for the attention rule the rows imply.
The exports resolve lazily (module `__getattr__`): `pack.py` and `attention.py` need torch,
while `inputs`, `prefix_tree` and `placement` are numpy-only, and the autotuner (which must
import without torch) uses those to estimate how many groups fit a row budget.
"""

from __future__ import annotations

from importlib import import_module

_EXPORTS = {
    "PackedBatch": "pack",
    "PackingConfig": "pack",
    "PackingInputError": "inputs",
    "PackingStats": "pack",
    "Trajectory": "inputs",
    "TrajectoryGroup": "inputs",
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
    return getattr(import_module(f"{__name__}.{module}"), name)


__all__ = sorted(_EXPORTS)
