"""The content digest of a stream of full weights: one definition for trainer and server.

A full-weight update sends the served model's tensors by name, one after another (one layer
at a time on the trainer side). Both ends must name what crossed the wire the same way, so
the digest is defined over the stream itself, importable without torch or vLLM:

`xxh3-128:<32 hex digits>` = XXH3-128 over, for each tensor in the order it was sent,
`name \\0 dtype \\0 shape \\0` followed by its bytes (C order, little-endian), where `dtype` is
torch's name without the `torch.` prefix (`bfloat16`) and `shape` the sizes joined by `x`
(`""` for a scalar). The order counts: a receiver digests in arrival order, so a stream that
was reordered, cut short or carried other bytes gives another digest. Like the adapter digest
(`art_protocol.digest`) it detects accidental change, not an adversary.
"""

from __future__ import annotations

from collections.abc import Sequence

from art_protocol.digest import ALGORITHM


class WeightsDigest:
    """Incremental digest of a weight stream (see the module docstring)."""

    def __init__(self) -> None:
        import xxhash

        self._h = xxhash.xxh3_128()
        self.tensors = 0
        self.bytes = 0

    def update(self, name: str, dtype: str, shape: Sequence[int], data) -> None:
        """Add one tensor: `data` is its bytes (any buffer: bytes, memoryview, numpy)."""
        if "\0" in name:
            raise ValueError(f"weight name {name!r} contains a NUL byte")
        header = f"{name}\0{dtype.removeprefix('torch.')}\0{'x'.join(map(str, shape))}\0"
        view = memoryview(data).cast("B")
        self._h.update(header.encode())
        self._h.update(view)
        self.tensors += 1
        self.bytes += view.nbytes

    def hexdigest(self) -> str:
        return f"{ALGORITHM}:{self._h.hexdigest()}"
