"""Pushing an adapter's bytes with its update: the `multipart/form-data` body, defined once.

Why: a path update needs the server to read the trainer's directory (a shared file system and
an `--art-adapter-root` that covers it). A push sends the two files in the request instead, so
a trainer on another machine, or one that writes where the server may not read, can publish.
The server streams the parts into its staging directory as they arrive and then treats the
update exactly like a path update (validation, digest, receipts, `operation_id`,
`expected_version`).

The body (`POST /art/v1/lora/update`, `Content-Type: multipart/form-data`), three parts:

- `request`: the update as JSON without `path`, `{"slot", "version"[, "operation_id",
  "expected_version", "digest"]}` (`UpdateRequest.from_push_json`);
- `adapter_config.json`: the file's bytes;
- `adapter_model.safetensors`: the file's bytes.

Each part once, in any order; any other part is refused (400). Reading the directory
(`AdapterBytes.read`) and building the parts needs no vLLM, torch or xxhash; `digest()` needs
xxhash (the `client` extra).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from art_protocol.digest import CONFIG_FILE, WEIGHTS_FILE, digest_bytes
from art_protocol.updates import UpdateRequest

#: The part holding the update's JSON fields.
REQUEST_PART = "request"
#: One part per adapter file, named like the file.
FILE_PARTS = (CONFIG_FILE, WEIGHTS_FILE)
_CONTENT_TYPES = {CONFIG_FILE: "application/json", WEIGHTS_FILE: "application/octet-stream"}


@dataclass(frozen=True)
class AdapterBytes:
    """An adapter directory's two files, read once; `source` says where they came from."""

    config: bytes
    weights: bytes
    source: str

    @classmethod
    def read(cls, local_dir: str | Path) -> AdapterBytes:
        """Read `adapter_config.json` and `adapter_model.safetensors` of `local_dir`;
        `ValueError` naming the file that is missing or unreadable."""
        local_dir = Path(local_dir)
        data = {}
        for name in FILE_PARTS:
            try:
                data[name] = (local_dir / name).read_bytes()
            except OSError as exc:
                raise ValueError(
                    f"cannot push the adapter in {local_dir}: {local_dir / name} is not "
                    f"readable ({exc})"
                ) from exc
        return cls(data[CONFIG_FILE], data[WEIGHTS_FILE], str(local_dir))

    @property
    def size(self) -> int:
        return len(self.config) + len(self.weights)

    def digest(self) -> str:
        """`art_protocol.digest` of these bytes (needs xxhash)."""
        return digest_bytes(self.config, self.weights)


def multipart_files(request: UpdateRequest, adapter: AdapterBytes) -> list[tuple]:
    """The body as httpx `files=`: the `request` part, then one part per file. The adapter's
    bytes objects are passed as they are (several replicas share them, never copied here)."""
    if request.path is not None:
        raise ValueError(
            f"a push carries the adapter's files, not a path; got path {request.path!r}"
        )
    body = json.dumps(request.to_json()).encode()
    return [
        (REQUEST_PART, (None, body, "application/json")),
        (CONFIG_FILE, (CONFIG_FILE, adapter.config, _CONTENT_TYPES[CONFIG_FILE])),
        (WEIGHTS_FILE, (WEIGHTS_FILE, adapter.weights, _CONTENT_TYPES[WEIGHTS_FILE])),
    ]
