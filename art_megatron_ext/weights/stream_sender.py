"""What every trainer end of a streamed full-weight update shares, whatever moves the bytes
(`gloo_sender`: a gloo group; `nixl_sender`: NIXL reads of registered buckets).

The control plane is the trainer's `TCPStore`, which every worker of every engine reaches at
`master_address:master_port`: `open_store` and `join` (the workers join through
`POST /art/v1/weights/transfer/init`, answered once every worker did). Each update
(`StreamSender.send`) is the `POST /art/v1/weights/update` of the stream's plan, on a thread
of its own (the server answers once the update committed everywhere or nowhere, i.e. after the
stream), and the stream itself, sent only once every worker set its ready key in the store: if
the server answers first, it refused before any worker was receiving (a stale version, a plan
that does not fit, a staging budget), the refusal is raised and nothing was sent, or it
recognised a retried `operation_id` that committed, and its first answer (`replayed`) is
returned, nothing sent either. Each tensor
the producer hands over is checked against the plan (`PlanCheck`) before any of its bytes
move. `art_protocol.weight_transfer` has the wire rules.

Needs torch; no vLLM, no Megatron.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import ipaddress
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from art_protocol.weight_transfer import TransferPlan, ready_key

#: Where the store listens unless `connect` is told otherwise: workers on this host only.
LOOPBACK = "127.0.0.1"
_POLL_S = 0.005

Sink = Callable[[str, torch.Tensor], None]
Produce = Callable[[Sink], object]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_host(host: str) -> None:
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


def open_store(host: str, port: int, timeout_s: float):
    """The trainer's store on `host:port` (0: a free port), after `check_host`."""
    check_host(host)
    timeout = datetime.timedelta(seconds=timeout_s)
    return torch.distributed.TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=timeout
    )


def join(client, init_info: dict, timeout_s: float, alongside: Callable[[], object] | None = None):
    """Have every worker of every engine join (`client.init_weight_transfer`); `alongside()`
    runs meanwhile on this thread (a collective the workers' join waits for) and its result is
    returned once the server answered."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        joined = pool.submit(client.init_weight_transfer, init_info, timeout=timeout_s)
        result = alongside() if alongside is not None else None
        joined.result()
    return result


def make_plan(tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> TransferPlan:
    """A fresh round's plan from (name, dtype, shape) triples."""
    return TransferPlan.of(uuid.uuid4().hex, [(n, dtype_name(d), tuple(s)) for n, d, s in tensors])


class PlanCheck:
    """Checks each tensor the producer hands over against the plan: its name is in it and was
    not handed over before, its dtype and shape are the plan's. Returns its index."""

    def __init__(self, plan: TransferPlan):
        self.plan = plan
        self.index = {name: i for i, name in enumerate(plan.names)}
        self.seen: set[int] = set()

    def __call__(self, name: str, tensor: torch.Tensor) -> int:
        i = self.index.get(name)
        if i is None:
            raise ValueError(f"{name!r} is not in the plan")
        shape, dtype = self.plan.shapes[i], self.plan.dtypes[i]
        if tuple(tensor.shape) != shape or dtype_name(tensor.dtype) != dtype:
            raise ValueError(
                f"{name}: {dtype_name(tensor.dtype)} {list(tensor.shape)}, the plan says "
                f"{dtype} {list(shape)}"
            )
        if i in self.seen:
            raise ValueError(f"weight {name!r} was handed over twice")
        self.seen.add(i)
        return i


class StreamSender:
    """The trainer's end of a group of `workers` workers: `send` each version. A transport
    subclasses it with `_stream(plan, produce, answer)` (send every tensor `produce` hands over,
    then the end of the stream) and, where it can tell the workers, `_abort(plan, reason)`."""

    def __init__(self, client, store, workers: int):
        self.client = client
        self.store = store
        self.workers = workers
        self._http = ThreadPoolExecutor(max_workers=1, thread_name_prefix="art-weights-http")

    def send(
        self,
        version: int,
        tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        produce: Produce,
        *,
        operation_id: str | None = None,
        expected_version: int | None = None,
        digest: str | None = None,
        timeout_s: float = 600.0,
    ) -> dict:
        """Publish `version`: `tensors` is the plan ((name, dtype, shape) of every tensor the
        served model has), `produce(sink)` hands each tensor to `sink(name, tensor)`, in any
        order. Returns the server's response; raises `ArtError` when it refused, `ValueError`
        when `produce` strays from the plan (the stream is then cut short and the update
        refused)."""
        plan = make_plan(tensors)
        post = functools.partial(
            self.client.update_weights_stream,
            plan,
            version,
            operation_id=operation_id,
            expected_version=expected_version,
            digest=digest,
            timeout=timeout_s,
        )
        return self._send(plan, post, produce, timeout_s)

    def send_adapter(
        self,
        slot: str,
        version: int,
        adapter_config: dict,
        tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        produce: Produce,
        *,
        operation_id: str | None = None,
        expected_version: int | None = None,
        digest: str | None = None,
        timeout_s: float = 600.0,
    ) -> dict:
        """Publish `version` of LoRA slot `slot` over the same group: `adapter_config` is the
        adapter's adapter_config.json as a dict, `tensors` the plan of its tensors in PEFT's
        names ((name, dtype, shape) each, as the slot's adapter has them), `produce(sink)`
        hands each over as for `send`. No file is written here and none is sent over HTTP
        (`art_protocol.adapter_stream`). Returns the server's response (a LoRA update's);
        raises as `send`."""
        plan = make_plan(tensors)
        post = functools.partial(
            self.client.update_lora_stream,
            plan,
            slot,
            version,
            adapter_config,
            operation_id=operation_id,
            expected_version=expected_version,
            digest=digest,
            timeout=timeout_s,
        )
        return self._send(plan, post, produce, timeout_s)

    def _send(
        self, plan: TransferPlan, post: Callable[[], dict], produce: Produce, timeout_s: float
    ) -> dict:
        """`post()` the update on a thread, stream once every worker is receiving."""
        answer = self._http.submit(post)
        replayed = self._wait_ready(plan, answer, timeout_s)
        if replayed is not None:
            return replayed
        try:
            self._stream(plan, produce, answer)
        except BaseException as exc:
            if self._abort(plan, f"{type(exc).__name__}: {exc}"):
                _settle(answer, timeout_s)  # the workers were told: the server answers soon
            raise
        return answer.result()

    def _wait_ready(self, plan: TransferPlan, answer: Future, timeout_s: float) -> dict | None:
        """Return None once every worker is receiving `plan`'s round. When the server answered
        first, nothing is sent: its refusal is raised, and a retried operation that already
        committed (`replayed`: the first answer, given before any worker received) returned."""
        keys = [ready_key(plan.round, rank) for rank in range(1, self.workers + 1)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if answer.done():
                response = answer.result()  # a refusal raises
                if response.get("replayed"):
                    return response
                raise RuntimeError(
                    f"the server answered before its workers were receiving round "
                    f"{plan.round} and the answer is no replay: {response}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not receiving round {plan.round} after {timeout_s} s")
            time.sleep(_POLL_S)
        return None

    def _stream(self, plan: TransferPlan, produce: Produce, answer: Future | None) -> None:
        raise NotImplementedError

    def _abort(self, plan: TransferPlan, reason: str) -> bool:
        """Tell the workers the stream ended early, naming why; False where the transport
        cannot (they then find out by their own deadline)."""
        return False

    def close(self) -> None:
        self._http.shutdown(wait=False)
        self.store = None


def _settle(answer: Future, timeout_s: float) -> None:
    """Wait for the server's answer to a stream the trainer cut short (a refusal, whatever it
    says: the caller raises the reason it cut the stream for)."""
    with contextlib.suppress(Exception):
        answer.result(timeout=timeout_s)
