"""PEFT adapter validation for slot updates, done completely before anything changes.

An update must never half-apply, so the API server checks the new adapter against the slot's
reference adapter (the one it was started with, which vLLM already accepted): files present
and readable, `adapter_config.json` consistent with the slot (same target modules, rank within
`--max-lora-rank`), the same tensor names, every tensor's shape right for its module (A is
`[r, in]`, B is `[out, r]`, with `in`/`out` from the reference), a floating dtype, and all
values finite. Every error names the file, the tensor and the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
FLOAT_DTYPES = {"F16", "BF16", "F32"}


class AdapterError(ValueError):
    """The adapter at `path` is unusable for the slot; nothing was changed."""


@dataclass(frozen=True)
class AdapterSignature:
    """What a slot's adapters must agree on (taken from the slot's reference adapter)."""

    rank: int
    target_modules: frozenset[str]
    # tensor name -> (rows, cols) of the reference; one dimension of each is the rank
    shapes: dict[str, tuple[int, int]]


def _read_config(path: Path) -> dict:
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise AdapterError(f"{cfg_path}: missing (a PEFT adapter needs {CONFIG_FILE})")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{cfg_path}: unreadable or not JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_path}: expected a JSON object")
    return cfg


def _rank_of(cfg: dict, cfg_path: Path) -> int:
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{cfg_path}: 'r' must be a positive integer, got {rank!r}")
    return rank


def _targets_of(cfg: dict, cfg_path: Path) -> frozenset[str]:
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{cfg_path}: 'target_modules' must be a list of names")
    return frozenset(targets)


def _open_weights(path: Path):
    from safetensors import safe_open

    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(f"{weights}: missing (only safetensors adapters are accepted)")
    try:
        return weights, safe_open(str(weights), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise AdapterError(f"{weights}: cannot read safetensors header ({exc})") from exc


def read_signature(path: str | Path) -> AdapterSignature:
    """The signature of a known-good adapter (the slot's reference)."""
    path = Path(path)
    cfg = _read_config(path)
    weights, handle = _open_weights(path)
    with handle:
        shapes = {}
        for name in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
            shape = handle.get_slice(name).get_shape()
            if len(shape) != 2:
                raise AdapterError(f"{weights}: tensor {name} has shape {shape}, expected 2-D")
            shapes[name] = (int(shape[0]), int(shape[1]))
    cfg_path = path / CONFIG_FILE
    return AdapterSignature(_rank_of(cfg, cfg_path), _targets_of(cfg, cfg_path), shapes)


def _expected_shape(name: str, ref: tuple[int, int], rank: int) -> tuple[int, int]:
    if "lora_A" in name:
        return (rank, ref[1])
    if "lora_B" in name:
        return (ref[0], rank)
    return ref


def validate_adapter(
    path: str | Path, slot: str, reference: AdapterSignature, max_rank: int
) -> AdapterSignature:
    """Check the adapter at `path` completely; raises AdapterError naming what is wrong."""
    import torch

    path = Path(path)
    if not path.exists():
        raise AdapterError(f"{path}: adapter path does not exist")
    if not path.is_dir():
        raise AdapterError(f"{path}: adapter path is not a directory")
    cfg = _read_config(path)
    cfg_path = path / CONFIG_FILE
    rank = _rank_of(cfg, cfg_path)
    if rank > max_rank:
        raise AdapterError(f"{cfg_path}: r={rank} exceeds the server's --max-lora-rank {max_rank}")
    targets = _targets_of(cfg, cfg_path)
    if targets != reference.target_modules:
        raise AdapterError(
            f"{cfg_path}: target_modules {sorted(targets)} differ from slot {slot!r}'s "
            f"{sorted(reference.target_modules)}"
        )
    weights, handle = _open_weights(path)
    with handle:
        names = set(handle.keys())
        missing = sorted(set(reference.shapes) - names)
        extra = sorted(names - set(reference.shapes))
        if missing:
            raise AdapterError(f"{weights}: missing tensor {missing[0]} ({len(missing)} missing)")
        if extra:
            raise AdapterError(f"{weights}: unexpected tensor {extra[0]} for slot {slot!r}")
        for name in sorted(names):
            sl = handle.get_slice(name)
            shape = tuple(int(d) for d in sl.get_shape())
            want = _expected_shape(name, reference.shapes[name], rank)
            if shape != want:
                raise AdapterError(f"{weights}: tensor {name} has shape {shape}, expected {want}")
            dtype = sl.get_dtype()
            if dtype not in FLOAT_DTYPES:
                raise AdapterError(
                    f"{weights}: tensor {name} has dtype {dtype}, expected one of "
                    f"{sorted(FLOAT_DTYPES)}"
                )
            try:
                tensor = handle.get_tensor(name)
            except Exception as exc:
                raise AdapterError(f"{weights}: tensor {name} unreadable ({exc})") from exc
            if not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                raise AdapterError(f"{weights}: tensor {name} has {bad} non-finite values")
    _check_file_complete(weights)
    return AdapterSignature(rank, targets, reference.shapes)


def _check_file_complete(weights: Path) -> None:
    """Refuse trailing garbage or a header that claims less than the file holds."""
    import struct

    with weights.open("rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    size = weights.stat().st_size
    if size != 8 + header_len + end:
        raise AdapterError(
            f"{weights}: file is {size} bytes but its header describes {8 + header_len + end}"
        )
