"""Resident optimizer state and crash-atomic checkpoints.

`resident` keeps optimizer and trainable state in memory across jobs with the same
(training session, objective, optimizer path) and checkpoints through one `Checkpointer`
interface (`checkpointer`), chosen once from the `CheckpointLayout` (`layouts`): the
per-rank layout (`checkpoint.ShardedCheckpointer`) or Megatron's resharding
`dist_checkpointing` (`dist_checkpoint.DistCheckpointer`). Both write the same `Manifest`
(`manifest`), commit it with one protocol (`commit`) and save in the background on one path
(`async_save`); `optimizer_state` captures a torch or Megatron distributed optimizer
completely. Format: docs/checkpoint-format.md.
"""

from art_megatron_ext.optim.async_save import AsyncCheckpointer, snapshot_state
from art_megatron_ext.optim.checkpoint import CheckpointConfig, ShardedCheckpointer
from art_megatron_ext.optim.checkpointer import Checkpointer, LoadedCheckpoint, Restore
from art_megatron_ext.optim.dist_checkpoint import DistCheckpointer
from art_megatron_ext.optim.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointSaveError,
    CheckpointWorldSizeError,
)
from art_megatron_ext.optim.fileio import CheckpointIO
from art_megatron_ext.optim.layouts import checkpointer_factory
from art_megatron_ext.optim.manifest import CheckpointLayout, FileRecord, Manifest
from art_megatron_ext.optim.optimizer_state import (
    OptimizerLayoutError,
    capture_optimizer_state,
    restore_optimizer_state,
)
from art_megatron_ext.optim.resident import (
    Residency,
    ResidentKey,
    ResidentOptimizerStore,
    ResidentState,
)
from art_megatron_ext.optim.schedule import PeriodicSaver, SaveSchedule
from art_megatron_ext.optim.training_state import ObjectiveMismatchError, TrainableStateError

__all__ = [
    "AsyncCheckpointer",
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointIO",
    "CheckpointLayout",
    "CheckpointSaveError",
    "CheckpointWorldSizeError",
    "Checkpointer",
    "DistCheckpointer",
    "FileRecord",
    "LoadedCheckpoint",
    "Manifest",
    "ObjectiveMismatchError",
    "OptimizerLayoutError",
    "PeriodicSaver",
    "Residency",
    "ResidentKey",
    "ResidentOptimizerStore",
    "ResidentState",
    "Restore",
    "SaveSchedule",
    "ShardedCheckpointer",
    "TrainableStateError",
    "capture_optimizer_state",
    "checkpointer_factory",
    "restore_optimizer_state",
    "snapshot_state",
]
