"""PEFT adapter validation for slot updates, done completely before anything changes.

An update must never half-apply, so the API server checks the new adapter against the slot's
reference adapter (the one it was started with, which vLLM already accepted): files present
and readable, `adapter_config.json` consistent with the slot (same target modules, rank within
`--max-lora-rank`), the same tensor names, every tensor's shape right for its module (A is
`[r, in]`, B is `[out, r]`, with `in`/`out` from the reference), the dtype of the slot's
tensor of the same name, and all values finite. Every error names the file, the tensor and
the problem.

The files are read once (`read_adapter_files`) and validated from those bytes
(`validate_adapter_files`), so the bytes handed on to the workers are exactly the bytes that
were checked, whatever happens to the trainer's directory afterwards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
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
    # tensor name -> safetensors dtype of the reference ("BF16", ...)
    dtypes: dict[str, str] = field(default_factory=dict)


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
        shapes, dtypes = {}, {}
        for name in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
            sl = handle.get_slice(name)
            shape = sl.get_shape()
            if len(shape) != 2:
                raise AdapterError(f"{weights}: tensor {name} has shape {shape}, expected 2-D")
            shapes[name] = (int(shape[0]), int(shape[1]))
            dtypes[name] = sl.get_dtype()
    cfg_path = path / CONFIG_FILE
    return AdapterSignature(_rank_of(cfg, cfg_path), _targets_of(cfg, cfg_path), shapes, dtypes)


def _expected_shape(name: str, ref: tuple[int, int], rank: int) -> tuple[int, int]:
    if "lora_A" in name:
        return (rank, ref[1])
    if "lora_B" in name:
        return (ref[0], rank)
    return ref


@dataclass(frozen=True)
class AdapterFiles:
    """The bytes of an adapter directory, read once."""

    path: Path
    config: bytes
    weights: bytes

    def as_files(self) -> dict[str, bytes]:
        return {CONFIG_FILE: self.config, WEIGHTS_FILE: self.weights}


def read_adapter_files(path: str | Path) -> AdapterFiles:
    """Read `adapter_config.json` and `adapter_model.safetensors` of `path` (once)."""
    path = Path(path)
    if not path.exists():
        raise AdapterError(f"{path}: adapter path does not exist")
    if not path.is_dir():
        raise AdapterError(f"{path}: adapter path is not a directory")
    out = {}
    for name, why in (
        (CONFIG_FILE, "a PEFT adapter needs it"),
        (WEIGHTS_FILE, "only safetensors adapters are accepted"),
    ):
        f = path / name
        try:
            out[name] = f.read_bytes()
        except FileNotFoundError as exc:
            raise AdapterError(f"{f}: missing ({why})") from exc
        except OSError as exc:
            raise AdapterError(f"{f}: unreadable ({exc})") from exc
    return AdapterFiles(path, out[CONFIG_FILE], out[WEIGHTS_FILE])


def _parse_config(files: AdapterFiles) -> dict:
    cfg_path = files.path / CONFIG_FILE
    try:
        cfg = json.loads(files.config)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{cfg_path}: unreadable or not JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_path}: expected a JSON object")
    return cfg


def _parse_header(files: AdapterFiles) -> dict:
    """The safetensors header, checked against the file length (no trailing or missing data)."""
    import struct

    weights = files.path / WEIGHTS_FILE
    data = files.weights
    try:
        (header_len,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_len])
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        end = max(
            (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
        )
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        raise AdapterError(f"{weights}: cannot read safetensors header ({exc})") from exc
    if len(data) != 8 + header_len + end:
        raise AdapterError(
            f"{weights}: file is {len(data)} bytes but its header describes {8 + header_len + end}"
        )
    return header


_SAFETENSORS_DTYPE_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}


def validate_adapter_files(
    files: AdapterFiles, slot: str, reference: AdapterSignature, max_rank: int
) -> AdapterSignature:
    """Check an adapter's bytes completely; raises AdapterError naming what is wrong."""
    import torch
    from safetensors.torch import load as load_safetensors

    cfg = _parse_config(files)
    header = _parse_header(files)
    layout = {
        k: (v["dtype"], tuple(int(d) for d in v["shape"]))
        for k, v in header.items()
        if k != "__metadata__"
    }
    signature = check_layout(cfg, files.path, layout, slot, reference, max_rank)
    weights = files.path / WEIGHTS_FILE
    try:
        tensors = load_safetensors(files.weights)
    except Exception as exc:  # safetensors raises its own error types for bad data
        raise AdapterError(f"{weights}: cannot read tensors ({exc})") from exc
    for name in sorted(tensors):
        tensor = tensors[name]
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise AdapterError(f"{weights}: tensor {name} has {bad} non-finite values")
    return signature


def check_layout(
    cfg: dict,
    path: Path,
    layout: dict[str, tuple[str, tuple[int, ...]]],
    slot: str,
    reference: AdapterSignature,
    max_rank: int,
) -> AdapterSignature:
    """Everything but the values: the config `cfg` and the tensors' (safetensors dtype code,
    shape) by name against the slot. Checked before a streamed adapter's first byte moves
    (its plan), and as part of `validate_adapter_files`."""
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
    weights = path / WEIGHTS_FILE
    names = set(layout)
    missing = sorted(set(reference.shapes) - names)
    extra = sorted(names - set(reference.shapes))
    if missing:
        raise AdapterError(f"{weights}: missing tensor {missing[0]} ({len(missing)} missing)")
    if extra:
        raise AdapterError(f"{weights}: unexpected tensor {extra[0]} for slot {slot!r}")
    for name in sorted(names):
        dtype, shape = layout[name]
        want = _expected_shape(name, reference.shapes[name], rank)
        if shape != want:
            raise AdapterError(f"{weights}: tensor {name} has shape {shape}, expected {want}")
        if dtype not in FLOAT_DTYPES:
            raise AdapterError(
                f"{weights}: tensor {name} has dtype {dtype}, expected one of "
                f"{sorted(FLOAT_DTYPES)}"
            )
        want_dtype = reference.dtypes.get(name)
        if want_dtype is not None and dtype != want_dtype:
            raise AdapterError(
                f"{weights}: tensor {name} has dtype {dtype}, but slot {slot!r}'s tensor is "
                f"{want_dtype} ({_SAFETENSORS_DTYPE_NAMES.get(want_dtype, want_dtype)})"
            )
    return AdapterSignature(rank, targets, reference.shapes, reference.dtypes)


def validate_adapter(
    path: str | Path, slot: str, reference: AdapterSignature, max_rank: int
) -> AdapterSignature:
    """Read and check the adapter at `path` (see `validate_adapter_files`)."""
    return validate_adapter_files(read_adapter_files(path), slot, reference, max_rank)


def read_and_validate(
    path: str | Path, slot: str, reference: AdapterSignature, max_rank: int
) -> AdapterFiles:
    """Read the adapter once, check it, and return the bytes that were checked."""
    files = read_adapter_files(path)
    validate_adapter_files(files, slot, reference, max_rank)
    return files
