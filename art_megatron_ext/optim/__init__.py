"""Resident optimizer state and crash-atomic sharded checkpoints.

`resident` keeps optimizer and trainable state in memory across jobs with the same
(training session, objective, optimizer path); `checkpoint` writes and reads the per-rank,
manifest-committed checkpoints it falls back to, `async_save` runs those saves in the
background, `optimizer_state` captures a torch or Megatron distributed optimizer completely,
and `dist_checkpoint` writes resharding checkpoints with Megatron's `dist_checkpointing`
under the same commit protocol (format: docs/checkpoint-format.md).
"""

from art_megatron_ext.optim.async_save import AsyncCheckpointer, snapshot_state
from art_megatron_ext.optim.checkpoint import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointSaveError,
    CheckpointWorldSizeError,
    LoadedShard,
    ShardedCheckpointer,
)
from art_megatron_ext.optim.dist_checkpoint import DistCheckpointer, DistManifest, LoadedDist
from art_megatron_ext.optim.fileio import CheckpointIO
from art_megatron_ext.optim.manifest import CheckpointFormatError, Manifest
from art_megatron_ext.optim.optimizer_state import (
    OptimizerLayoutError,
    capture_optimizer_state,
    restore_optimizer_state,
)
from art_megatron_ext.optim.resident import (
    CheckpointLayout,
    ObjectiveMismatchError,
    Residency,
    ResidentKey,
    ResidentOptimizerStore,
    ResidentState,
    TrainableStateError,
)
from art_megatron_ext.optim.schedule import PeriodicSaver, SaveSchedule

__all__ = [
    "AsyncCheckpointer",
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointIO",
    "CheckpointLayout",
    "CheckpointSaveError",
    "CheckpointWorldSizeError",
    "DistCheckpointer",
    "DistManifest",
    "LoadedDist",
    "LoadedShard",
    "Manifest",
    "ObjectiveMismatchError",
    "OptimizerLayoutError",
    "PeriodicSaver",
    "Residency",
    "ResidentKey",
    "ResidentOptimizerStore",
    "ResidentState",
    "SaveSchedule",
    "ShardedCheckpointer",
    "TrainableStateError",
    "capture_optimizer_state",
    "restore_optimizer_state",
    "snapshot_state",
]
