"""The content digest of a set of full weights: one definition for trainer and server.

A full-weight update names the served model's tensors (Hugging Face names). The trainer
streams them one layer at a time (`art_megatron_ext.weights.stream_hf_weights`); a files
update carries them in safetensors files, which store tensors sorted by name, not in the
order they were written. So the digest is defined over the *set* of named tensors, not their
order, and both ends (and a directory on disk) give the same value for the same weights.
Importable without torch or vLLM.

`xxh3-128:<32 hex digits>` = XXH3-128 over, for each tensor in name order (by the UTF-8
bytes of the name), `name \\0 dtype \\0 shape \\0` followed by the 16-byte XXH3-128 of its
bytes (C order, little-endian), where `dtype` is torch's name without the `torch.` prefix
(`bfloat16`; safetensors codes are mapped to it, `SAFETENSORS_DTYPES`) and `shape` the sizes
joined by `x` (`""` for a scalar). A tensor added twice is refused (a name means one tensor).
So a set cut short, with another tensor's dtype, shape or bytes, gives another digest. Like
the adapter digest (`art_protocol.digest`) it detects accidental change, not an adversary.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from art_protocol.checkpoint_layout import LayoutError, checkpoint_files, raw_header
from art_protocol.digest import ALGORITHM

#: safetensors dtype code -> torch's dtype name (what the digest names).
SAFETENSORS_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
#: Bytes read at a time when digesting a file.
_CHUNK = 16 * 2**20


class WeightsDigest:
    """Digest of a set of named tensors, fed in any order (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[str, bytes] = {}
        self.tensors = 0
        self.bytes = 0

    def add(self, name: str, dtype: str, shape: Sequence[int], data_digest: bytes, nbytes: int):
        """Add one tensor by the XXH3-128 digest of its bytes (`data_digest`, 16 bytes)."""
        if "\0" in name:
            raise ValueError(f"weight name {name!r} contains a NUL byte")
        if name in self._entries:
            raise ValueError(f"weight {name!r} was added twice")
        header = f"{name}\0{dtype.removeprefix('torch.')}\0{'x'.join(map(str, shape))}\0"
        self._entries[name] = header.encode() + data_digest
        self.tensors += 1
        self.bytes += nbytes

    def update(self, name: str, dtype: str, shape: Sequence[int], data) -> None:
        """Add one tensor: `data` is its bytes (any buffer: bytes, memoryview, numpy)."""
        import xxhash

        view = memoryview(data).cast("B")
        self.add(name, dtype, shape, xxhash.xxh3_128(view).digest(), view.nbytes)

    def hexdigest(self) -> str:
        import xxhash

        h = xxhash.xxh3_128()
        for name in sorted(self._entries, key=lambda n: n.encode()):
            h.update(self._entries[name])
        return f"{ALGORITHM}:{h.hexdigest()}"


def digest_checkpoint(checkpoint_dir: str | Path) -> WeightsDigest:
    """The digest of a safetensors checkpoint directory's tensors (`checkpoint_files`), read a
    chunk at a time (never a whole file in memory). Raises `LayoutError` naming a file whose
    header is malformed or whose data is shorter than its header says."""
    import xxhash

    digest = WeightsDigest()
    for path in checkpoint_files(checkpoint_dir):
        header, start = raw_header(path)
        entries = [(n, e) for n, e in header.items() if n != "__metadata__"]
        with open(path, "rb") as f:
            for name, entry in entries:
                try:
                    begin, end = (int(x) for x in entry["data_offsets"])
                    dtype, shape = entry["dtype"], [int(d) for d in entry["shape"]]
                except (KeyError, TypeError, ValueError) as exc:
                    raise LayoutError(f"{path}: tensor {name!r} has a malformed entry") from exc
                f.seek(start + begin)
                h, left = xxhash.xxh3_128(), end - begin
                while left > 0:
                    chunk = f.read(min(left, _CHUNK))
                    if not chunk:
                        raise LayoutError(f"{path}: the data of {name!r} is cut short")
                    h.update(chunk)
                    left -= len(chunk)
                digest.add(
                    name, SAFETENSORS_DTYPES.get(dtype, dtype), shape, h.digest(), end - begin
                )
    return digest
