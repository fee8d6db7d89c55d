"""The one place that maps a `CheckpointLayout` to its `Checkpointer`.

Why: the resident store (and any trainer) chooses a layout once, by configuration; after
that it only talks to the `Checkpointer` interface, so nothing else branches on the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from art_megatron_ext.optim.checkpoint import CheckpointConfig, ShardedCheckpointer
from art_megatron_ext.optim.checkpointer import Checkpointer
from art_megatron_ext.optim.dist_checkpoint import DistCheckpointer
from art_megatron_ext.optim.fileio import CheckpointIO
from art_megatron_ext.optim.manifest import CheckpointLayout

__all__ = ["checkpointer_factory"]


def checkpointer_factory(
    layout: CheckpointLayout,
    *,
    group: Any = None,
    io: CheckpointIO | None = None,
    weights_only: bool = True,
) -> Callable[[Path], Checkpointer]:
    """A function that opens a checkpoint directory in `layout` with these options.

    Options the layout cannot honour are refused here, before any directory is opened:
    the dist_checkpointing layout plans on the default process group (no `group`), and
    `weights_only` applies to the per-rank layout's `torch.load`.
    """
    if not isinstance(layout, CheckpointLayout):
        raise TypeError(f"layout must be a CheckpointLayout, got {layout!r}")
    if layout is CheckpointLayout.DIST:
        if group is not None:
            raise ValueError("the dist_checkpointing layout runs on the default process group")
        return lambda directory: DistCheckpointer(directory, io=io)
    return lambda directory: ShardedCheckpointer(
        CheckpointConfig(directory, weights_only=weights_only), group=group, io=io
    )
