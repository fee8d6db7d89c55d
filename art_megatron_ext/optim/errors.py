"""The errors a checkpoint raises, the same for both layouts.

Why one module: the commit protocol (`commit.py`) and both layouts raise the same error for
the same situation (another rank failed its part of a save, a file does not match the
manifest, a manifest a reader must not trust), so a caller catches one set of errors
whichever layout its checkpointer writes.
"""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointSaveError",
    "CheckpointWorldSizeError",
]


class CheckpointFormatError(RuntimeError):
    """A manifest or shard on disk does not match the checkpoint format."""


class CheckpointCorruptError(RuntimeError):
    """A file listed in the manifest is missing, has the wrong size or the wrong digest."""


class CheckpointWorldSizeError(RuntimeError):
    """A per-rank checkpoint was written by a different number of ranks (it does not reshard)."""


class CheckpointSaveError(RuntimeError):
    """Another rank failed its part of a save; the previous generation stays committed."""
