"""Publish-ready adapter exports: atomic version directories with a digest manifest.

Why: the trainer wants to hand a new adapter to the server the moment its weights exist, and
save the optimizer while the server loads it (the optimizer save is the slow part of a step's
tail). That is only safe if the server can never read half an export and can tell a torn or
stale one from the real thing. `export_ready` gives both:

1. `export_peft` (collective; rank 0 alone receives and writes) writes into a temporary
   directory beside the final one (same filesystem), `<root>/<slot>/.v<version>.tmp-<id>`;
2. the manifest `art-adapter.json` (slot, version, step, digest, created, base model) is
   written there too, the digest being `art_protocol.digest.digest_dir` of the two
   adapter files (the same bytes the server reads and checks);
3. every file and the directory are fsynced, the directory is renamed to
   `<root>/<slot>/v<version>` in one `rename(2)` and the parent directory is fsynced.

A reader therefore sees either no `v<version>` or a complete one with its manifest; a process
killed before the rename leaves only a `.tmp-` directory (removed by the next export of the
same version). An existing `v<version>` is refused (`AdapterVersionExists`) before anything is
gathered: versions are immutable, which is what lets the server pin one (exact leases).

`export_ready` returns `AdapterReady` on every rank (broadcast from rank 0) and calls
`on_ready` on rank 0 as soon as the directory is visible, so the caller starts the publish
(e.g. `BackgroundPublisher.submit`) before it saves the optimizer::

    ready = export_ready(model, "policy", root, version=v, step=s, base_model_name_or_path=b)
    pending = publisher.submit(ready)      # POST /art/v1/lora/update on a background thread
    save_optimizer(...)                    # overlaps the server's load and swap
    pending.result()                       # the server's receipt (raises on refusal)
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from art_protocol.digest import CONFIG_FILE, WEIGHTS_FILE, digest_dir
from art_protocol.updates import ROUTE as UPDATE_ROUTE
from art_protocol.updates import UpdateRequest

from .export import export_peft
from .hf_layout import HfNaming

MANIFEST_FILE = "art-adapter.json"
MANIFEST_FORMAT = 1


class AdapterVersionExists(FileExistsError):
    """`<root>/<slot>/v<version>` already exists: adapter versions are never overwritten."""


@dataclass(frozen=True)
class AdapterReady:
    """A complete, durable adapter version on disk, ready to publish."""

    slot: str
    version: int
    path: str  # the final version directory (absolute)
    digest: str  # `xxh3-128:<32 hex>` of its adapter_config.json + adapter_model.safetensors
    step: int  # the training step whose weights these are
    created: float  # time.time() when the directory became visible

    def update_request(self, *, with_digest: bool = True) -> UpdateRequest:
        """The `POST /art/v1/lora/update` request for this version, digest included."""
        digest = self.digest if with_digest else None
        return UpdateRequest(self.slot, self.path, self.version, digest=digest)

    def update_body(self) -> dict[str, Any]:
        """The JSON body of `update_request()`."""
        return self.update_request().to_json()


def version_dir(root: str | os.PathLike, slot: str, version: int) -> Path:
    """Where `export_ready` puts version `version` of `slot`: `<root>/<slot>/v<version>`."""
    return Path(root) / slot / f"v{version}"


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a version directory written by `export_ready`."""
    return json.loads((Path(path) / MANIFEST_FILE).read_text())


def _dist_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _from_rank0(value: Any, world: int) -> Any:
    """`value` of rank 0 on every rank (a small picklable object)."""
    if world == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_args(slot: str, version: int, step: int) -> None:
    if not isinstance(slot, str) or not slot or "/" in slot or slot.startswith("."):
        raise ValueError(f"slot must be a plain directory name, got {slot!r}")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be a non-negative integer, got {version!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")


def _prepare(final: Path, slot: str, version: int) -> str | None:
    """On rank 0: refuse an existing version, remove stale temporaries of this version."""
    if final.exists():
        return (
            f"adapter version directory {final} already exists; versions are immutable: "
            f"publish slot {slot!r} under a new version instead of {version}"
        )
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # a killed export of this version
    return None


def _finish(tmp: Path, final: Path, slot: str, version: int, step: int, base: str) -> AdapterReady:
    """On rank 0, after `export_peft` wrote `tmp`: manifest, fsync, rename, fsync parent."""
    digest = digest_dir(tmp)
    created = time.time()
    manifest = {
        "format": MANIFEST_FORMAT,
        "slot": slot,
        "version": version,
        "step": step,
        "digest": digest,
        "created": created,
        "base_model_name_or_path": base,
    }
    (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    for name in (CONFIG_FILE, WEIGHTS_FILE, MANIFEST_FILE):
        _fsync_path(tmp / name)
    _fsync_path(tmp)
    if final.exists():  # appeared while we were exporting (another writer)
        raise AdapterVersionExists(
            f"adapter version directory {final} appeared during the export; not replaced"
        )
    os.rename(tmp, final)
    _fsync_path(final.parent)
    return AdapterReady(slot, version, str(final.resolve()), digest, step, created)


def export_ready(
    model: torch.nn.Module,
    slot: str,
    root: str | os.PathLike,
    *,
    version: int,
    step: int,
    base_model_name_or_path: str,
    naming: HfNaming | None = None,
    dtype: torch.dtype | None = None,
    on_ready: Callable[[AdapterReady], Any] | None = None,
) -> AdapterReady:
    """Export slot `slot` as `<root>/<slot>/v<version>` atomically; return its `AdapterReady`.

    Collective over the default process group (every rank calls it; rank 0 writes). Raises
    `AdapterVersionExists` on every rank, before any tensor is gathered, if that version
    directory exists; any error of rank 0's write is raised on every rank too (as
    `RuntimeError` naming it), and leaves no `v<version>`. `on_ready` runs on rank 0 right
    after the rename (use it to start the publish); its errors propagate to rank 0 only.
    """
    _check_args(slot, version, step)
    rank, world = _dist_world()
    final = version_dir(root, slot, version)
    problem: tuple[type[Exception], str] | None = None
    if rank == 0:
        try:
            exists = _prepare(final, slot, version)
            problem = (AdapterVersionExists, exists) if exists else None
        except OSError as exc:  # e.g. an unwritable root: every rank must hear of it
            problem = (OSError, f"cannot prepare {final.parent}: {exc}")
    problem = _from_rank0(problem, world)
    if problem is not None:
        raise problem[0](problem[1])
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
    outcome: AdapterReady | str
    try:
        export_peft(model, slot, tmp, base_model_name_or_path, naming=naming, dtype=dtype)
        outcome = ""
        if rank == 0:
            outcome = _finish(tmp, final, slot, version, step, base_model_name_or_path)
    except Exception as exc:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            if world == 1:
                raise
            outcome = f"rank 0 failed to write {final}: {type(exc).__name__}: {exc}"
        else:
            raise  # a collective failed here; rank 0 fails in it too
    outcome = _from_rank0(outcome, world)
    if isinstance(outcome, str):
        raise RuntimeError(outcome)
    if rank == 0 and on_ready is not None:
        on_ready(outcome)
    return outcome


class BackgroundPublisher:
    """Runs `publish(ready)` on one background thread, in submission order.

    Why: the POST that publishes a version waits for the server to read, validate, stage and
    swap it in; the trainer should spend that time saving its optimizer instead of waiting.
    `publish` is any callable, e.g. `post_update(base_url, api_key=...)`.
    """

    def __init__(self, publish: Callable[[AdapterReady], Any]):
        self._publish = publish
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="art-publish")

    def submit(self, ready: AdapterReady) -> Future:
        return self._pool.submit(self._publish, ready)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> BackgroundPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def post_update(
    base_url: str, *, api_key: str | None = None, timeout_s: float = 300.0, send_digest: bool = True
) -> Callable[[AdapterReady], dict]:
    """A `publish` callable: `POST <base_url>/art/v1/lora/update` with the manifest's digest.

    Returns the server's receipt; raises `RuntimeError` with the server's message on refusal
    (a 422 on a digest mismatch means the server read other bytes than the trainer wrote).
    """
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def publish(ready: AdapterReady) -> dict:
        body = ready.update_request(with_digest=send_digest).to_json()
        resp = httpx.post(
            f"{base_url.rstrip('/')}{UPDATE_ROUTE}",
            json=body,
            headers=headers,
            timeout=timeout_s,
        )
        if resp.status_code != 200:
            raise RuntimeError(
                f"publishing {ready.slot}@{ready.version} from {ready.path} was refused "
                f"({resp.status_code}): {resp.text}"
            )
        return resp.json()

    return publish
