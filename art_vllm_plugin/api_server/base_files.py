"""A full-weight update's files: copied to a stage, then checked there before any engine sees
them.

Why copy first and check the copy: the workers read the stage, not the trainer's directory,
which the trainer may overwrite with its next export at any time. Checking the copy checks
exactly the bytes every worker will load, and the digest in the response is theirs.

Before the copy, every file it reads (the index, the shards it names, `model.safetensors`) must
lie inside an allowed root with every symlink resolved, as an adapter's files must
(`paths.PathPolicy.check_files`, the same rule and message, 403 naming the file): a
checkpoint directory inside a root may not hand the server a file from elsewhere.

The checks, all before anything changes (a refusal names every problem, 422):
- files: each shard is whole, exactly as long as its header says (8 bytes, the header, the
  tensors' data): a truncated or padded file is named, rather than failing inside the
  safetensors reader with a 500 that names no file;
- layout: every tensor of the served checkpoint is there with its dtype and shape, and no
  other (`art_protocol.checkpoint_layout`: the served model's own safetensors headers, in the
  same Hugging Face names the trainer streams);
- values: every floating-point tensor is finite (a NaN in the weights would turn every token
  to garbage, with nothing in the response to say why);
- digest: of the copy (`art_protocol.weights_digest`), against the request's when it has one.
  Values and digest come from one read of the files (`scan`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from art_protocol.checkpoint_layout import (
    INDEX_FILE,
    SINGLE_FILE,
    LayoutError,
    checkpoint_files,
    layout_problems,
    raw_header,
    read_layout,
)
from art_protocol.weights_digest import WeightsDigest
from art_vllm_plugin import staging
from art_vllm_plugin.api_server.paths import PathPolicy

#: Most problems one refusal lists (the rest are counted).
MAX_PROBLEMS = 20


class WeightsRefused(ValueError):
    """The update's files do not fit the served model; the message names every problem."""

    def __init__(self, source: str, problems: list[str]):
        shown = problems[:MAX_PROBLEMS]
        more = len(problems) - len(shown)
        text = "; ".join(shown) + (f"; and {more} more" if more > 0 else "")
        super().__init__(f"{source} does not fit the served model: {text}")
        self.problems = problems


def write_stage(
    config: staging.StagingConfig,
    source: Path,
    version: int,
    engines,
    server: str,
    paths: PathPolicy,
) -> Path:
    """A fresh stage holding a copy of the checkpoint at `source` and one marker directory per
    engine (`staging.marker_dir`), tagged with `server` (engine 0's `server_id`) and `version`.
    `paths.PathRefused` when a file of it leads out of the allowed roots; `WeightsRefused`
    when `source` is no safetensors checkpoint; `staging.StagingRefused` (507 out of space,
    else 500) when the copy cannot be written; nothing is left behind on failure."""
    what = f"the full weights at {source}"
    # The index first: it names the shards, and is read here.
    paths.check_files(source, (INDEX_FILE, SINGLE_FILE), kind="checkpoint")
    try:
        files = checkpoint_files(source)
        if (source / INDEX_FILE).is_file():
            files.append(source / INDEX_FILE)
        paths.check_files(source, [str(f) for f in files], kind="checkpoint")
        size = sum(f.stat().st_size for f in files)
    except (LayoutError, OSError) as exc:
        raise WeightsRefused(what, [str(exc)]) from exc
    config.check_space(size, what)

    def copy(stage_dir: Path) -> None:
        for f in files:
            shutil.copyfile(f, stage_dir / f.name)
        staging.mark_base(stage_dir, version, server)

    return staging.fill_stage(config, "base", version, [e.dp_rank for e in engines], copy, what)


def file_problems(checkpoint_dir: Path) -> list[str]:
    """Every shard of `checkpoint_dir` whose length is not what its header declares (8 bytes,
    the header, the tensors' data up to the largest end offset), or whose header cannot be
    read; one sentence each, naming the file by its name."""
    problems = []
    for path in checkpoint_files(checkpoint_dir):
        try:
            header, data_start = raw_header(path)
            ends = [
                int(entry["data_offsets"][1])
                for name, entry in header.items()
                if name != "__metadata__"
            ]
        except LayoutError as exc:
            problems.append(f"{path.name}: {str(exc).removeprefix(f'{path}: ')}")
            continue
        except (KeyError, TypeError, ValueError, IndexError):
            problems.append(f"{path.name}: a tensor of its header has no valid data_offsets")
            continue
        declared, held = data_start + max(ends, default=0), path.stat().st_size
        if held != declared:
            cut = "truncated" if held < declared else "longer than its header says"
            problems.append(
                f"{path.name}: {cut}: the file holds {held} bytes, its header declares {declared}"
            )
    return problems


def scan(checkpoint_dir: Path) -> tuple[str, list[str]]:
    """(the weights' digest, the floating-point tensors holding a NaN or an infinity, one
    sentence each), in one read of the files: each tensor is loaded once for both."""
    import torch
    from safetensors import SafetensorError, safe_open

    from art_vllm_plugin.tensor_checks import all_finite

    digest, bad = WeightsDigest(), []
    for path in checkpoint_files(checkpoint_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                    tensor = f.get_tensor(name).contiguous()
                    if not all_finite(tensor):
                        bad.append(f"{name}: holds NaN or infinite values")
                    data = tensor.view(torch.uint8).numpy() if tensor.numel() else b""
                    digest.update(name, str(tensor.dtype), tuple(tensor.shape), data)
        except (SafetensorError, OSError) as exc:  # name the file the reader failed on
            bad.append(f"{path.name}: not a readable safetensors file ({exc})")
    return digest.hexdigest(), bad


def check_stage(stage_dir: Path, served_dir: Path, source: str) -> str:
    """The digest of the staged weights once they fit the served model, else `WeightsRefused`
    naming every problem (`source`: how the refusal names the update)."""
    try:
        if problems := file_problems(stage_dir):
            raise WeightsRefused(source, problems)
        problems = layout_problems(read_layout(served_dir), read_layout(stage_dir))
    except LayoutError as exc:
        raise WeightsRefused(source, [str(exc)]) from exc
    if problems:
        raise WeightsRefused(source, problems)
    digest, problems = scan(stage_dir)
    if problems:
        raise WeightsRefused(source, problems)
    return digest
