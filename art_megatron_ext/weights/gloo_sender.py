"""The trainer's end of an `art_gloo` weight-transfer group: stream full weights to every
worker of every engine, no files in between.

Why: a files update needs a directory the server can read (one host, or a shared file
system). A stream needs only a TCP path from the workers to the trainer: the trainer (rank
0) hosts the group at an address the workers can reach (`connect(host=)`; loopback, the
default, reaches workers on the trainer's host only), every worker joins it once, and each
update is one `POST /art/v1/weights/update` with the stream's plan plus the stream itself
(`art_protocol.weight_transfer` defines both). The server answers that request once the
update committed on every engine or on none, with the same receipts, compare-and-swap,
operation ids and per-token base versions as a files update.

`send` sends nothing before every worker is receiving (their keys in the store): if the
server refuses the request first (a stale version, a plan that does not fit the served
model), the refusal is raised and the group is untouched. Each tensor is checked against
the plan before it is sent; the digest of what was sent ends the stream, and each worker
refuses a stream whose bytes do not give it. The store, the join, the plan and the ready
handshake are `stream_sender`'s, shared with `nixl_sender`.

With tensor parallelism, every TP rank runs the Megatron stream (its gathers are
collectives) and only the sender (rank 0, which holds this object) hands tensors to `send`'s
sink, e.g. `sender.send(version, plan_tensors, lambda sink: stream_hf_weights(model, shape,
sink))` on rank 0 and `stream_hf_weights(model, shape, lambda *_: None, send=False)` on the
others.

Needs torch; no vLLM, no Megatron.
"""

from __future__ import annotations

import datetime
import os

import torch

from art_megatron_ext.weights.stream_sender import (
    LOOPBACK,
    PlanCheck,
    Produce,
    StreamSender,
    join,
    open_store,
)
from art_protocol.weight_transfer import DIGEST_BYTES, END, GROUP_PREFIX, TransferPlan
from art_protocol.weights_digest import WeightsDigest

__all__ = ["LOOPBACK", "GlooWeightSender"]


def _broadcast(group, tensor: torch.Tensor) -> None:
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _gloo_group(store, world: int, host: str, timeout: datetime.timedelta):
    """Rank 0's gloo group, its device bound to `host`: the address gloo announces to the
    workers for its connections is then the one they were told to reach, not whatever this
    machine's host name resolves to (often 127.0.1.1, unreachable from another host).
    GLOO_SOCKET_IFNAME, when set, wins (torch's own override). Private torch names (none
    of vLLM's or Megatron's): `ProcessGroupGloo._Options` and its `_devices` / `_timeout`,
    as torch's own gloo tests set them; torch has no public constructor taking a device."""
    dist = torch.distributed
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return dist.ProcessGroupGloo(store, 0, world, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, 0, world, options)


class GlooWeightSender(StreamSender):
    """Rank 0 of the group: `connect` once, then `send` each version (`StreamSender.send`)."""

    def __init__(self, client, store, group, world_size: int):
        super().__init__(client, store, world_size - 1)
        self.group = group
        self.world_size = world_size

    @classmethod
    def connect(
        cls,
        client,
        *,
        workers: int,
        host: str = LOOPBACK,
        port: int = 0,
        timeout_s: float = 600.0,
    ) -> GlooWeightSender:
        """Open the group on `host:port` (0: a free port) for `workers` workers (every worker
        of every engine of the server `client` talks to) and have them join it.

        `host`: an address of this machine that every worker can reach: the workers are
        told to connect to it (`master_address`), and the group's gloo device is bound to
        it. The default, loopback, reaches workers on this host only (one-host runs, the
        tests); a server on other hosts needs this host's address on their network (the
        example's `--trainer-host`). Raises ValueError for an empty or wildcard address."""
        store = open_store(host, port, timeout_s)
        world = workers + 1
        init_info = {
            "master_address": host,
            "master_port": store.port,
            "world_size": world,
            "timeout_s": timeout_s,
        }
        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = torch.distributed.PrefixStore(GROUP_PREFIX, store)
        group = join(
            client, init_info, timeout_s, lambda: _gloo_group(prefixed, world, host, timeout)
        )
        return cls(client, store, group, world)

    def _stream(self, plan: TransferPlan, produce: Produce, answer=None) -> None:
        check = PlanCheck(plan)
        sent = WeightsDigest()
        header = torch.empty(1, dtype=torch.int64)

        def sink(name: str, tensor: torch.Tensor) -> None:
            i = check(name, tensor)
            tensor = tensor.detach().to("cpu").contiguous()
            data = tensor.view(torch.uint8).numpy() if tensor.numel() else b""
            sent.update(name, plan.dtypes[i], plan.shapes[i], data)
            header[0] = i
            _broadcast(self.group, header)
            _broadcast(self.group, tensor)

        produce(sink)
        header[0] = END
        _broadcast(self.group, header)
        text = sent.hexdigest().encode("ascii")
        assert len(text) == DIGEST_BYTES
        _broadcast(self.group, torch.tensor(list(text), dtype=torch.uint8))

    def close(self) -> None:
        super().close()
        self.group = None
