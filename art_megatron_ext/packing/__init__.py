"""Prefix-tree packing of trajectory groups into fixed-length training rows.

See `pack.py` for the pipeline and `attention.py` for the attention rule the rows imply.
"""

from art_megatron_ext.packing.attention import tree_attention_mask
from art_megatron_ext.packing.inputs import PackingInputError, Trajectory, TrajectoryGroup
from art_megatron_ext.packing.pack import PackedBatch, PackingConfig, PackingStats, pack_groups

__all__ = [
    "PackedBatch",
    "PackingConfig",
    "PackingInputError",
    "PackingStats",
    "Trajectory",
    "TrajectoryGroup",
    "pack_groups",
    "tree_attention_mask",
]
