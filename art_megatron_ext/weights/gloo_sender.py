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
refuses a stream whose bytes do not give it.

With tensor parallelism, every TP rank runs the Megatron stream (its gathers are
collectives) and only the sender (rank 0, which holds this object) hands tensors to `send`'s
sink, e.g. `sender.send(version, plan_tensors, lambda sink: stream_hf_weights(model, shape,
sink))` on rank 0 and `stream_hf_weights(model, shape, lambda *_: None, send=False)` on the
others.

Needs torch; no vLLM, no Megatron.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from art_protocol.weight_transfer import DIGEST_BYTES, END, GROUP_PREFIX, TransferPlan, ready_key
from art_protocol.weights_digest import WeightsDigest

_POLL_S = 0.005

Sink = Callable[[str, torch.Tensor], None]


def _broadcast(group, tensor: torch.Tensor) -> None:
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


#: Where the group is hosted unless `connect` is told otherwise: workers on this host only.
LOOPBACK = "127.0.0.1"


def _check_host(host: str) -> None:
    """Refuse an address no worker can connect to: empty, or a listener's "any address"."""
    try:
        unspecified = ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:  # a host name: resolved by the store and by the workers
        unspecified = not host.strip()
    if unspecified:
        raise ValueError(
            f"host {host!r} is no address the workers can connect to: give the trainer's "
            "address on the workers' network (the group was not opened)"
        )


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


class GlooWeightSender:
    """Rank 0 of the group: `connect` once, then `send` each version."""

    def __init__(self, client, store, group, world_size: int):
        self.client = client
        self.store = store
        self.group = group
        self.world_size = world_size
        self._http = ThreadPoolExecutor(max_workers=1, thread_name_prefix="art-weights-http")

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
        _check_host(host)
        timeout = datetime.timedelta(seconds=timeout_s)
        dist = torch.distributed
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
        world = workers + 1
        init_info = {
            "master_address": host,
            "master_port": store.port,
            "world_size": world,
            "timeout_s": timeout_s,
        }
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer, init_info, timeout=timeout_s)
            group = _gloo_group(dist.PrefixStore(GROUP_PREFIX, store), world, host, timeout)
            joined.result()
        return cls(client, store, group, world)

    def send(
        self,
        version: int,
        tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        produce: Callable[[Sink], object],
        *,
        operation_id: str | None = None,
        expected_version: int | None = None,
        digest: str | None = None,
        timeout_s: float = 600.0,
    ) -> dict:
        """Publish `version`: `tensors` is the plan ((name, dtype, shape) of every tensor the
        served model has), `produce(sink)` hands each tensor to `sink(name, tensor)`, in any
        order. Returns the server's response; raises `ArtError` when it refused, `ValueError`
        when `produce` strays from the plan (the stream is then cut short: the workers time
        out and the update is refused)."""
        plan = TransferPlan.of(
            uuid.uuid4().hex, [(n, _dtype_name(d), tuple(s)) for n, d, s in tensors]
        )
        answer = self._http.submit(
            self.client.update_weights_stream,
            plan,
            version,
            operation_id=operation_id,
            expected_version=expected_version,
            digest=digest,
            timeout=timeout_s,
        )
        keys = [ready_key(plan.round, rank) for rank in range(1, self.world_size)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if answer.done():  # refused before any worker received: nothing to send
                answer.result()
                raise RuntimeError("the server answered before its workers were receiving")
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not receiving round {plan.round} after {timeout_s} s")
            time.sleep(_POLL_S)
        self._stream(plan, produce)
        return answer.result()

    def _stream(self, plan: TransferPlan, produce: Callable[[Sink], object]) -> None:
        index = {name: i for i, name in enumerate(plan.names)}
        sent = WeightsDigest()
        header = torch.empty(1, dtype=torch.int64)

        def sink(name: str, tensor: torch.Tensor) -> None:
            i = index.get(name)
            if i is None:
                raise ValueError(f"{name!r} is not in the plan")
            tensor = tensor.detach().to("cpu").contiguous()
            shape, dtype = plan.shapes[i], plan.dtypes[i]
            if tuple(tensor.shape) != shape or _dtype_name(tensor.dtype) != dtype:
                raise ValueError(
                    f"{name}: {_dtype_name(tensor.dtype)} {list(tensor.shape)}, the plan says "
                    f"{dtype} {list(shape)}"
                )
            data = tensor.view(torch.uint8).numpy() if tensor.numel() else b""
            sent.update(name, dtype, shape, data)  # refuses a name sent twice
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
        self._http.shutdown(wait=False)
        self.group = None
        self.store = None
