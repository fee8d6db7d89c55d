"""Make deliberately broken copies of a real PEFT adapter for bad-input tests."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def copy_adapter(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_tensors(src: Path, dst: Path, edit: Callable[[dict], None]) -> Path:
    copy_adapter(src, dst)
    tensors = load_file(dst / WEIGHTS)
    edit(tensors)
    save_file(tensors, dst / WEIGHTS, metadata={"format": "pt"})
    return dst


def edit_config(src: Path, dst: Path, edit: Callable[[dict], None]) -> Path:
    copy_adapter(src, dst)
    cfg = json.loads((dst / CONFIG).read_text())
    edit(cfg)
    (dst / CONFIG).write_text(json.dumps(cfg))
    return dst


def first_key(tensors: dict, part: str) -> str:
    return sorted(k for k in tensors if part in k)[0]


def make_bad_adapters(good: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (adapter dir, a fragment the error message must contain)."""
    bad: dict[str, tuple[Path, str]] = {}
    bad["missing_path"] = (root / "does-not-exist", "does not exist")

    trunc = copy_adapter(good, root / "truncated")
    data = (trunc / WEIGHTS).read_bytes()
    (trunc / WEIGHTS).write_bytes(data[: len(data) // 2])
    bad["truncated_safetensors"] = (trunc, WEIGHTS)

    def to_rank16(cfg):
        cfg["r"] = 16

    bad["rank_over_max"] = (edit_config(good, root / "rank16", to_rank16), "r=16 exceeds")

    def shrink_rank(t):  # config says r=8, tensors have rank 4
        for k in list(t):
            t[k] = t[k][:4].contiguous() if "lora_A" in k else t[k][:, :4].contiguous()

    bad["rank_mismatch"] = (edit_tensors(good, root / "rank4", shrink_rank), "has shape")

    def wrong_shape(t):
        k = first_key(t, "lora_B")
        t[k] = torch.zeros(t[k].shape[0] + 1, t[k].shape[1], dtype=t[k].dtype)

    bad["wrong_shape"] = (edit_tensors(good, root / "shape", wrong_shape), "has shape")

    def nan(t):
        k = first_key(t, "lora_B")
        t[k] = t[k].clone()
        t[k][0, 0] = float("nan")

    bad["nan"] = (edit_tensors(good, root / "nan", nan), "non-finite")

    def targets(cfg):
        cfg["target_modules"] = ["q_proj", "v_proj"]

    bad["wrong_targets"] = (edit_config(good, root / "targets", targets), "target_modules")
    return bad
