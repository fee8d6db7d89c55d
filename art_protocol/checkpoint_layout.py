"""Names, dtypes and shapes of a safetensors checkpoint, and how an update's differ.

Why: a full-weight update is checked against the served model before anything changes (a bad
one is refused with every problem named and the old weights keep serving). The served
model's checkpoint directory already says what its tensors are, in the same (Hugging Face)
names the trainer streams (`art_megatron_ext.weights.stream_hf_weights`), so comparing
headers needs no model, no GPU and no tensor data: a safetensors file starts with an 8-byte
little-endian length and a JSON header `{name: {"dtype", "shape", "data_offsets"}}`.
Standard library only: trainers can run the same check before they send.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER = 100 * 2**20  # safetensors' own limit


class LayoutError(ValueError):
    """A checkpoint whose files or headers cannot be read; the message names the file."""


@dataclass(frozen=True)
class TensorSpec:
    dtype: str  # safetensors' code: "BF16", "F32", ...
    shape: tuple[int, ...]


def raw_header(path: str | Path) -> tuple[dict, int]:
    """(the JSON header, the offset its tensors' data starts at) of one `.safetensors` file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise LayoutError(f"{path}: shorter than a safetensors header")
            (length,) = struct.unpack("<Q", raw)
            if length > _MAX_HEADER:
                raise LayoutError(f"{path}: header of {length} bytes is not safetensors")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise LayoutError(f"{path}: unreadable ({exc})") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LayoutError(f"{path}: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise LayoutError(f"{path}: header is not a JSON object")
    return header, 8 + length


def read_header(path: str | Path) -> dict[str, TensorSpec]:
    """The tensors one `.safetensors` file declares (reads only its header)."""
    header, _ = raw_header(path)
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            out[name] = TensorSpec(str(entry["dtype"]), tuple(int(d) for d in entry["shape"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise LayoutError(f"{path}: tensor {name!r} has a malformed entry {entry!r}") from exc
    return out


def checkpoint_files(checkpoint_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: `model.safetensors`, or the shards
    its `model.safetensors.index.json` names."""
    root = Path(checkpoint_dir)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise LayoutError(f"{index}: not a safetensors index ({exc})") from exc
    elif (root / SINGLE_FILE).is_file():
        shards = [SINGLE_FILE]
    else:
        raise LayoutError(f"{root}: neither {SINGLE_FILE} nor {INDEX_FILE}")
    return [root / shard for shard in shards]


def read_layout(checkpoint_dir: str | Path) -> dict[str, TensorSpec]:
    """Every tensor of a checkpoint directory (`checkpoint_files`; a name in two shards is an
    error)."""
    root = Path(checkpoint_dir)
    layout: dict[str, TensorSpec] = {}
    for shard in checkpoint_files(root):
        for name, spec in read_header(shard).items():
            if name in layout:
                raise LayoutError(f"{root}: tensor {name!r} appears in more than one shard")
            layout[name] = spec
    return layout


def layout_problems(
    served: dict[str, TensorSpec], update: dict[str, TensorSpec], *, partial: bool = False
) -> list[str]:
    """Every way `update` does not fit `served`, one sentence each naming the tensor (empty
    when it fits). `partial=True` accepts an update that leaves some tensors out."""
    problems = [
        f"{name}: the served model has no such tensor"
        for name in sorted(update.keys() - served.keys())
    ]
    if not partial:
        problems += [
            f"{name}: missing from the update" for name in sorted(served.keys() - update.keys())
        ]
    for name in sorted(update.keys() & served.keys()):
        want, got = served[name], update[name]
        if got.shape != want.shape:
            problems.append(
                f"{name}: shape {list(got.shape)}, the served model's is {list(want.shape)}"
            )
        if got.dtype != want.dtype:
            problems.append(f"{name}: dtype {got.dtype}, the served model's is {want.dtype}")
    return problems
