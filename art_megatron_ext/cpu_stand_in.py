"""Stand-ins for the absent GPU, so Megatron-core's DDP and DistributedOptimizer run on CPU.

Why: megatron-core 0.19 assumes CUDA in a few places that do not matter for correctness
(streams and events for overlap, `device="cuda"` / `torch.cuda.current_device()` tensor
factories, split sizes kept in CPU tensors for NCCL, a `torch.cuda.*Tensor` type check in the
distributed optimizer). With those stood in for, DDP with `overlap_grad_reduce` and
`overlap_param_gather`, the DistributedOptimizer and MoE layers run forward, backward and step
on gloo groups: the tests do (tests/support/megatron_cpu.py adds parallel-state helpers), and
so does the example trainer on a machine without a GPU (examples/pipeline_rl). On a GPU
machine neither context is entered (`cpu_shim` refuses). They patch `torch` process-wide while
active.

What `cpu_shim()` does while active:
- `torch.cuda.Stream/Event/current_stream/default_stream/stream/synchronize` become no-ops
  (`torch.cuda.is_available()` stays False).
- Tensor factories (`torch.empty/zeros/ones/full/tensor/arange/...`, their `*_like`
  forms, `Tensor.new_*`), `Tensor.to` and `Tensor.cuda` map any CUDA device (`"cuda"`,
  `"cuda:0"`, an int, `torch.device("cuda")`) to CPU, and drop `pin_memory=True`.
- `torch.distributed.all_to_all_single` accepts split sizes given as tensors (gloo wants
  Python lists); `torch.distributed.all_gather` accepts parts of unequal length (gloo wants
  equal ones; Megatron gathers uneven sequence-parallel splits when TP > 1).

`cuda_tensor_type_names()` makes `Tensor.type()` answer `torch.cuda.*` names (below).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["cpu_shim", "cuda_tensor_type_names"]

_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "as_tensor",
    "arange",
    "linspace",
    "eye",
    "rand",
    "randn",
    "randint",
    "randperm",
    "empty_strided",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "rand_like",
    "randn_like",
)
_TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare ordinal means a CUDA device in torch
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _cpu_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    if _is_cuda_device(kwargs.get("device")):
        kwargs["device"] = "cpu"
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return kwargs


def _wrap_factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def factory(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **_cpu_kwargs(kwargs))

    return factory


def _wrap_tensor_to(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
        return fn(self, *args, **_cpu_kwargs(kwargs))

    return to


def _tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


class _NoStream:
    """Stands in for `torch.cuda.Stream`: every synchronization is already satisfied on CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NoEvent:
        return event if event is not None else _NoEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoEvent:
    """Stands in for `torch.cuda.Event`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_NO_STREAM = _NoStream()


def _wrap_all_to_all_single(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return fn(
            output,
            input,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            **kw,
        )

    return all_to_all_single


def _wrap_all_gather(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        rows = [t.shape[0] if t.dim() else 0 for t in tensor_list]
        if all(t.shape == tensor.shape for t in tensor_list):
            return fn(tensor_list, tensor, group=group, async_op=async_op)
        # gloo needs equal sizes: pad every part to the longest, gather, then trim.
        longest = max(rows)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in tensor_list]
        fn(parts, padded, group=group)
        for out, part, n in zip(tensor_list, parts, rows, strict=True):
            out.copy_(part[:n])
        return None

    return all_gather


def _patches() -> list[tuple[Any, str, Any]]:
    cuda = torch.cuda
    patches: list[tuple[Any, str, Any]] = [
        (cuda, "Stream", _NoStream),
        (cuda, "Event", _NoEvent),
        (cuda, "current_stream", lambda device=None: _NO_STREAM),
        (cuda, "default_stream", lambda device=None: _NO_STREAM),
        (cuda, "stream", lambda stream=None: contextlib.nullcontext()),
        (cuda, "synchronize", lambda device=None: None),
        (cuda, "current_device", lambda: 0),
        (torch.Tensor, "to", _wrap_tensor_to(torch.Tensor.to)),
        (torch.Tensor, "cuda", _tensor_cuda),
        (
            torch.distributed,
            "all_to_all_single",
            _wrap_all_to_all_single(torch.distributed.all_to_all_single),
        ),
        (torch.distributed, "all_gather", _wrap_all_gather(torch.distributed.all_gather)),
    ]
    patches += [(torch, name, _wrap_factory(getattr(torch, name))) for name in _FACTORIES]
    patches += [
        (torch.Tensor, name, _wrap_factory(getattr(torch.Tensor, name)))
        for name in _TENSOR_FACTORIES
    ]
    return patches


@contextlib.contextmanager
def cpu_shim() -> Iterator[None]:
    """Patch torch so Megatron-core's CUDA-only calls run on CPU; restore everything on exit.

    Refused where CUDA is available (there the real streams and devices must be used). Not
    re-entrant across threads; enter it once per process (one rank, one test, one trainer).
    """
    if torch.cuda.is_available():
        raise RuntimeError("cpu_shim() stands in for an absent GPU: do not enter it with CUDA")
    saved = []
    try:
        for obj, name, new in _patches():
            saved.append((obj, name, obj.__dict__.get(name, getattr(obj, name))))
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)


def _cuda_type_name(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = fn(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
            return name  # a conversion (`t.type(dtype)`), or already a CUDA tensor
        return "torch.cuda." + name.removeprefix("torch.")

    return type_


@contextlib.contextmanager
def cuda_tensor_type_names() -> Iterator[None]:
    """`Tensor.type()` (no arguments) answers `torch.cuda.FloatTensor` for a CPU float tensor.

    Why: Megatron's `DistributedOptimizer` sorts parameters by that string and refuses any
    other (megatron-core 0.19.2 `optimizer/distrib_optimizer.py`, lines 401 and 466, raising
    at 477: "Wrapped parameters must be one of torch.cuda.FloatTensor, ..."). That check is
    the only thing that stops it on CPU: with `cpu_shim()` for the rest (streams, `cuda`
    devices), DDP grad buffers, gloo reduce-scatter/all-gather and the optimizer step run.
    `t.type(dtype)` conversions are untouched. CPU only, like `cpu_shim`.
    """
    own = "type" in torch.Tensor.__dict__  # else inherited from the C base class
    original = torch.Tensor.type
    torch.Tensor.type = _cuda_type_name(original)
    try:
        yield
    finally:
        if own:
            torch.Tensor.type = original
        else:
            del torch.Tensor.type
