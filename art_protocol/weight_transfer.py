"""A full-weight update streamed from the trainer (no files): the plan and the wire rules.

`POST /art/v1/weights/update` takes either `path` (files, `art_protocol.weight_updates`) or
`transfer`: the plan of a stream the trainer sends over a weight-transfer group it opened
with `POST /art/v1/weights/transfer/init` (every worker of every engine joined it). The
plan names every tensor it will send, in the served model's Hugging Face names, with torch
dtype names and shapes, and a `round` (a fresh id per stream, the trainer's choice):

    {"round": "r-7", "names": [...], "dtypes": ["float32", ...], "shapes": [[64, 64], ...]}

The server checks the plan against the served model before any byte moves (422 naming every
problem), has every worker start receiving on its staging thread, and only then does the
trainer send. The wire of the `art_gloo` engine (`art_vllm_plugin.worker.gloo_transfer`,
trainer side `art_megatron_ext.weights.gloo_sender`), all broadcasts from rank 0 (the
trainer); the workers are ranks 1.. (engine e's worker w is `1 + e * workers_per_engine + w`):

1. each worker, once receiving, sets `ready_key(round, rank)` in the group's store; the trainer
   sends nothing until every worker's key is there (or the update's HTTP answer came back:
   then it was refused before anything was received, and nothing is sent);
2. for each tensor, in any order: an int64 header `[index into the plan]`, then the tensor's
   bytes (its plan dtype and shape);
3. the end: an int64 header `[END]`, then the stream's digest (`art_protocol.weights_digest`
   of every tensor sent) as `DIGEST_BYTES` uint8. A worker refuses a stream whose digest is
   not that of what it received, that repeats or leaves out a tensor, or that holds a NaN or
   an infinity.

The wire of the `art_nixl` engine (`art_vllm_plugin.worker.nixl_transfer`, the wire without
vLLM in `worker/nixl_receiver`; trainer side `art_megatron_ext.weights.nixl_sender`; records
and keys in `art_protocol.nixl_wire`). The bytes move by NIXL, each worker READing from the
trainer's registered memory; the trainer's `TCPStore` carries only small control records:

0. at `connect`, before the join: the trainer registers `count` buffers of `bucket_bytes`
   (GPU memory on a GPU trainer, host memory otherwise) with its NIXL agent and sets
   `nixl_wire.METADATA_KEY` (its agent metadata) and `TRAINER_KEY` (JSON: agent name, NIXL
   memory type `DRAM`/`VRAM`, `[address, bytes, device id]` of every buffer). Each worker,
   in `init_transfer_engine` (`init_info`: `master_address`, `master_port`, `world_size`,
   `timeout_s`, `stall_timeout_s`; ranks as for `art_gloo`), adds that agent and registers
   one receive buffer of the bucket size (on its GPU where it has one);
1. the ready handshake of `art_gloo` (step 1 above), unchanged;
2. the trainer packs the stream's tensors back to back into a free buffer (a tensor larger
   than the room left continues in the next bucket) and, per filled bucket `n` = 0, 1, ...,
   sets `bucket_key(round, n)` to `{"buffer": i, "used": bytes, "entries": [[plan index,
   start, offset, size], ...]}` (bytes `start .. start + size` of that tensor lie at
   `offset` in the bucket). Each worker waits for it, READs the first `used` bytes of buffer
   `i` into its own buffer, adds 1 to `pulled_key(round, n)`, and the worker whose add makes
   it the number of workers sets `all_pulled_key(round, n)`: only then does the trainer
   write buffer `i` again (and delete the bucket's keys);
3. the end: `bucket_key(round, n)` = `{"end": digest}` (the digest of every tensor sent,
   computed by the trainer from host bytes it owns), checked as in step 3 above; or, when the
   trainer's producer failed, `{"abort": reason}`: every worker refuses the stream at once,
   naming the reason;
4. deadlines from progress: a worker waits `stall_timeout_s` (default 120) for each next
   record and ends the stream naming the round and the bytes received when none comes; a
   worker that stops before the end sets `quit_reason_key(round, rank)` and adds 1 to
   `quit_key(round)`, and the trainer, which waits for the workers' pulls, stops too.

Importable without torch or vLLM.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from art_protocol.checkpoint_layout import TensorSpec
from art_protocol.updates import UpdateRequestError
from art_protocol.weights_digest import SAFETENSORS_DTYPES

#: The backend name of the gloo engine (`vllm serve --weight-transfer-config
#: '{"backend": "art_gloo"}'`).
GLOO_BACKEND = "art_gloo"
#: The backend name of the NIXL engine (`--weight-transfer-config '{"backend": "art_nixl"}'`).
NIXL_BACKEND = "art_nixl"
#: The store prefix of the gloo group itself (trainer and workers alike; its keys are gloo's).
GROUP_PREFIX = "art-weights-group"
#: `POST` here with `{"init_info": {...}}` to have every worker of every engine join the group.
INIT_ROUTE = "/art/v1/weights/transfer/init"
#: The header that ends a stream (a tensor's header is its index in the plan).
END = -1
#: `xxh3-128:` and 32 hex digits, as ASCII bytes.
DIGEST_BYTES = 41
#: Longest `round` id.
MAX_ROUND = 128

_DTYPE_CODES = {name: code for code, name in SAFETENSORS_DTYPES.items()}
_FIELDS = '{"round", "names", "dtypes", "shapes"}'


def ready_key(round_id: str, rank: int) -> str:
    """The store key worker `rank` sets once it is receiving stream `round_id`."""
    return f"art-weights/{round_id}/ready/{rank}"


@dataclass(frozen=True)
class TransferPlan:
    """What a stream will carry: tensor `i` is `names[i]` with `dtypes[i]`, `shapes[i]`."""

    round: str
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.round, str) or not 0 < len(self.round) <= MAX_ROUND:
            raise UpdateRequestError(
                f"'transfer.round' must be a string of 1..{MAX_ROUND} characters, "
                f"got {self.round!r}"
            )
        if not self.names:
            raise UpdateRequestError("'transfer.names' must name at least one tensor")
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise UpdateRequestError(
                f"'transfer.names', 'dtypes' and 'shapes' must have one entry per tensor, got "
                f"{len(self.names)}, {len(self.dtypes)} and {len(self.shapes)}"
            )
        if len(set(self.names)) != len(self.names):
            raise UpdateRequestError("'transfer.names' names a tensor more than once")
        for dtype in self.dtypes:
            if dtype not in _DTYPE_CODES:
                raise UpdateRequestError(
                    f"'transfer.dtypes': {dtype!r} is not one of {sorted(_DTYPE_CODES)}"
                )

    @classmethod
    def from_json(cls, body: Any) -> TransferPlan:
        """The plan in a decoded JSON object, or `UpdateRequestError` naming the bad field."""
        if not isinstance(body, Mapping):
            raise UpdateRequestError(f"'transfer' must be a JSON object {_FIELDS}")
        lists = [body.get(k) for k in ("names", "dtypes", "shapes")]
        if not all(isinstance(v, list) for v in lists):
            raise UpdateRequestError("'transfer' needs the lists 'names', 'dtypes', 'shapes'")
        names, dtypes, shapes = lists
        if not all(isinstance(n, str) and n for n in names):
            raise UpdateRequestError("'transfer.names' must be non-empty strings")
        if not all(isinstance(d, str) for d in dtypes):
            raise UpdateRequestError("'transfer.dtypes' must be torch dtype names")
        if not all(
            isinstance(s, list) and all(isinstance(x, int) and x >= 0 for x in s) for s in shapes
        ):
            raise UpdateRequestError("'transfer.shapes' must be lists of non-negative integers")
        return cls(
            round=body.get("round"),
            names=tuple(names),
            dtypes=tuple(dtypes),
            shapes=tuple(tuple(s) for s in shapes),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "names": list(self.names),
            "dtypes": list(self.dtypes),
            "shapes": [list(s) for s in self.shapes],
        }

    def body_id(self) -> str:
        """What "the same body" means for a streamed update's `operation_id` (its part of the
        fingerprint): the tensors' names, dtypes and shapes in order, not the round (each try
        of one update opens a fresh one), as a path update's is the path as sent. So a retry
        whose answer was lost is answered from the server's record before a byte moves."""
        layout = json.dumps([self.names, self.dtypes, self.shapes], separators=(",", ":"))
        return "stream " + hashlib.sha256(layout.encode()).hexdigest()

    def layout(self) -> dict[str, TensorSpec]:
        """The plan as a checkpoint layout (safetensors dtype codes), to check against the
        served model's (`checkpoint_layout.layout_problems`)."""
        return {
            name: TensorSpec(_DTYPE_CODES[dtype], tuple(shape))
            for name, dtype, shape in zip(self.names, self.dtypes, self.shapes, strict=True)
        }

    @classmethod
    def of(cls, round_id: str, tensors: Sequence[tuple[str, str, Sequence[int]]]) -> TransferPlan:
        """A plan from (name, torch dtype name, shape) triples."""
        return cls(
            round=round_id,
            names=tuple(n for n, _, _ in tensors),
            dtypes=tuple(d for _, d, _ in tensors),
            shapes=tuple(tuple(s) for _, _, s in tensors),
        )
