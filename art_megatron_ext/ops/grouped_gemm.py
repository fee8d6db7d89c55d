"""`grouped_gemm(x, w, tokens_per_expert)`: the expert GEMM of a MoE layer, with autograd.

Rows of `x` are grouped by expert (group g = the next `tokens_per_expert[g]` rows) and
`Y_g = X_g @ W_g`. Two kernels sit behind one `autograd.Function`:

- `cutlass`: our CUTLASS sm_90a ptr-array grouped GEMM (csrc/grouped_gemm), bf16 on Hopper.
- `torch`: `torch._grouped_mm`, which runs everywhere (CPU included) in fp32/bf16/fp16.

`auto` takes `cutlass` where it can run and `torch` elsewhere, and logs once which it chose and
why; asking for `cutlass` where it cannot run raises, naming why. Whether CUTLASS can run is
decided once per process for each class of inputs (requested backend, devices, dtypes and the
`$ART_CUTLASS_DIR` / `$ART_PIPELINE_KERNEL_CACHE` overrides), never per call: the machine
probe (CUTLASS headers, a valid cached build, `nvcc` on PATH) reads the file system. A valid
cached build counts without `nvcc`, as the build cache promises. `reset_backend_cache()`
forgets the choices (after installing a toolkit in a running process, and in tests).

Both kernels need 16-byte aligned row pitches, so K and N are padded to a
multiple of 8 inside the op with differentiable `F.pad`/slicing: callers see logical shapes, and
the gradient of a padded region is dropped by autograd, never added to a logical weight.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

Backend = Literal["auto", "cutlass", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "cutlass", "torch")
ALIGN_ELEMENTS = 8
"""K and N are padded to this many elements: 16 bytes in bf16 (TMA) and >= 16 bytes in fp32."""
TORCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
logger = logging.getLogger(__name__)


class GroupedGemmBackendError(RuntimeError):
    """The requested backend cannot run these inputs on this machine (says why)."""


@dataclass(frozen=True)
class BackendChoice:
    """What one class of inputs resolved to: `backend` ("cutlass"/"torch", or None when the
    requested backend cannot run) and `reason`, the why that is logged or raised."""

    backend: str | None
    reason: str


_CHOICES: dict[tuple, BackendChoice] = {}
_CHOICES_LOCK = threading.Lock()


def reset_backend_cache() -> None:
    """Forget every resolved backend and the machine probe; the next call probes again."""
    with _CHOICES_LOCK:
        _CHOICES.clear()
        _cutlass_machine_reason.cache_clear()


def _tensor_reason(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why the CUTLASS kernel cannot take tensors like (x, w), from their device and dtype."""
    if not (x.is_cuda and w.is_cuda):
        return f"tensors are on {x.device}/{w.device}; the CUTLASS kernel needs an sm_90 GPU"
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return f"dtypes are {x.dtype}/{w.dtype}; the CUTLASS kernel takes bfloat16 only"
    major, minor = torch.cuda.get_device_capability(x.device)
    if (major, minor) != (9, 0):
        return f"GPU {x.device} has compute capability {major}.{minor}; the kernel is sm_90a"
    return None


def _machine_key() -> tuple[str | None, str | None]:
    """The environment overrides that change what the machine probe finds: part of the key,
    so setting one re-probes instead of reusing an answer about another tree or cache."""
    from art_megatron_ext.ops.cutlass_grouped_gemm import CUTLASS_DIR_ENV, kbuild

    return os.environ.get(CUTLASS_DIR_ENV), os.environ.get(kbuild.CACHE_DIR_ENV)


@functools.cache
def _cutlass_machine_reason(cutlass_dir: str | None, kernel_cache: str | None) -> str | None:
    """Why this machine can neither load nor build the CUTLASS library (None when it can).
    Cached per override pair (the arguments): the probe hashes sources and searches PATH."""
    from art_megatron_ext.ops import cutlass_grouped_gemm

    return cutlass_grouped_gemm.library_unavailable_reason()


def cutlass_unavailable_reason(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why the CUTLASS kernel cannot take (x, w) here, or None if it can (machine part cached)."""
    return _tensor_reason(x, w) or _cutlass_machine_reason(*_machine_key())


def _choose(requested: str, x: torch.Tensor, w: torch.Tensor, machine: tuple) -> BackendChoice:
    """Decide for one input class and log what `auto` took (once: the caller caches this)."""
    tensor_reason = _tensor_reason(x, w)
    reason = tensor_reason or _cutlass_machine_reason(*machine)
    if requested == "cutlass":
        if reason is None:
            return BackendChoice("cutlass", "requested")
        return BackendChoice(
            None,
            f"grouped_gemm(backend='cutlass') cannot run: {reason}. Nothing fell back; pass "
            "backend='auto' or 'torch' to run on torch._grouped_mm instead",
        )
    choice = BackendChoice(
        "cutlass" if reason is None else "torch",
        reason or "sm_90 GPU, bfloat16, CUTLASS headers and a cached build or nvcc",
    )
    # a GPU that could take the kernel but a machine that cannot build or load it is a real
    # slowdown the user should see; a CPU or fp32 input choosing torch is expected
    level = logging.WARNING if tensor_reason is None and reason else logging.INFO
    logger.log(
        level,
        "grouped_gemm(backend='auto') uses %r for %s %s inputs: %s",
        choice.backend,
        x.device,
        x.dtype,
        choice.reason,
    )
    return choice


def resolve_backend(requested: str, x: torch.Tensor, w: torch.Tensor) -> str:
    """The backend that runs (x, w) for `requested`: "cutlass" or "torch".

    Resolved once per process for each (requested, devices, dtypes, overrides) and then read
    from a dict, so a training step pays no file-system probe per GEMM; `auto` logs its choice
    and the reason when it is made. Raises `GroupedGemmBackendError` (every call) when
    "cutlass" is requested where it cannot run, `ValueError` for an unknown name.
    """
    if requested not in BACKENDS:
        raise ValueError(f"backend={requested!r}; expected one of {BACKENDS}")
    if requested == "torch":
        return "torch"
    machine = _machine_key()
    key = (requested, str(x.device), str(w.device), x.dtype, w.dtype, machine)
    choice = _CHOICES.get(key)
    if choice is None:
        with _CHOICES_LOCK:  # one probe and one log line even if threads race here
            choice = _CHOICES.get(key)
            if choice is None:
                choice = _CHOICES[key] = _choose(requested, x, w, machine)
    if choice.backend is None:
        raise GroupedGemmBackendError(choice.reason)
    return choice.backend


class _TorchKernels:
    """`torch._grouped_mm` forms of the three products (the reference and the CPU path)."""

    @staticmethod
    def fwd(x, w, group_end):
        return torch._grouped_mm(x, w, offs=group_end)

    @staticmethod
    def dgrad(dy, w, group_end):
        return torch._grouped_mm(dy, w.transpose(1, 2), offs=group_end)

    @staticmethod
    def wgrad(x, dy, group_end):
        return torch._grouped_mm(x.t(), dy, offs=group_end)

    @staticmethod
    def wgrad_fp32(x, dy, group_end):
        """X_g^T dY_g in fp32 (what is added to `main_grad`): no 16-bit rounding of dW."""
        return torch._grouped_mm(x.t().float(), dy.float(), offs=group_end)


@functools.cache
def _kernels(backend: str):
    if backend == "torch":
        return _TorchKernels
    from art_megatron_ext.ops import cutlass_grouped_gemm

    return cutlass_grouped_gemm


class GroupedGemmFunction(torch.autograd.Function):
    """Autograd over aligned inputs: forward Y_g = X_g W_g, dgrad dY_g W_g^T, wgrad X_g^T dY_g.

    A weight stored as `[G, N, K]` (the `nn.Linear` layout, passed as its transposed view) is
    used in place: forward runs the dgrad kernel on it, dgrad the forward kernel and wgrad
    computes dW^T directly, so neither direction copies the weight.

    Args:
        x: [T, K] contiguous, K % 8 == 0.
        w: [G, K, N], contiguous or the transpose of a contiguous [G, N, K]; N % 8 == 0.
        group_end: [G] int32 cumulative row ends on x's device (last == T).
        backend: "cutlass" or "torch" (already resolved).
        main_grad_param: None, or the weight's Parameter (its logical `[G, K', N']` top-left
            corner of `w`) under Megatron's `gradient_accumulation_fusion`: dW is added to
            its fp32 `main_grad` (see `_accumulate_into_main_grad`).
    """

    @staticmethod
    def forward(ctx, x, w, group_end, backend, main_grad_param=None):
        kernels = _kernels(backend)
        ctx.main_grad_param = main_grad_param
        transposed = not w.is_contiguous() and w.transpose(1, 2).is_contiguous()
        w_stored = w.transpose(1, 2) if transposed else w.contiguous()
        ctx.save_for_backward(x, w_stored, group_end)
        ctx.backend, ctx.transposed = backend, transposed
        if transposed:  # Y = X @ Wt^T with Wt [G, N, K]
            return kernels.dgrad(x, w_stored, group_end)
        return kernels.fwd(x, w_stored, group_end)

    @staticmethod
    def backward(ctx, dy):
        x, w_stored, group_end = ctx.saved_tensors
        kernels = _kernels(ctx.backend)
        dy = dy.contiguous()  # a broadcast gradient (from .sum()) has zero strides
        dx = dw = None
        param = ctx.main_grad_param
        if ctx.needs_input_grad[1] and param is not None and hasattr(param, "main_grad"):
            dw = _accumulate_into_main_grad(
                kernels, param, x, dy, group_end, ctx.transposed, w_stored
            )
        elif ctx.needs_input_grad[1]:
            if ctx.transposed:
                dw = kernels.wgrad(dy, x, group_end).transpose(1, 2)  # (dY^T X)^T
            else:
                dw = kernels.wgrad(x, dy, group_end)
        if ctx.needs_input_grad[0]:
            if ctx.transposed:
                dx = kernels.fwd(dy, w_stored, group_end)  # dY @ Wt
            else:
                dx = kernels.dgrad(dy, w_stored, group_end)
        return dx, dw, None, None, None


def _accumulate_into_main_grad(kernels, param, x, dy, group_end, transposed: bool, w_stored):
    """Megatron's gradient accumulation fusion for the grouped weight: dW (in fp32, so no
    16-bit rounding and no 16-bit `[G, K, N]` gradient kept) is added to `param.main_grad`
    in place and `param.grad_added_to_main_grad` is set, as Megatron's own linears do; the
    returned gradient is then a dummy of the weight's shape (Megatron's DDP hook needs a
    gradient to fire, and skips adding it), or None when the parameter is not under DDP.

    On the CPU (the reference) dW is `_grouped_mm` on fp32 copies of X and dY. On a GPU it is
    still the backend's 16-bit wgrad, upcast before the add (the `.grad` buffer is saved, the
    rounding is not): an fp32-accumulating CUTLASS epilogue is the GPU-side follow-up."""
    if x.is_cuda:
        dw = kernels.wgrad(x, dy, group_end).float()
    else:
        dw = _TorchKernels.wgrad_fp32(x, dy, group_end)  # [G, K_pad, N_pad] fp32
    if transposed:  # the weight is stored [G, N, K]: its logical dW is dW^T
        dw = dw.transpose(1, 2)
    main = param.main_grad
    main.add_(dw[:, : main.shape[1], : main.shape[2]])
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    shape = w_stored.transpose(1, 2).shape if transposed else w_stored.shape
    make = torch.zeros if getattr(param, "zero_out_wgrad", False) else torch.empty
    return make(shape, dtype=x.dtype, device=x.device)


def _group_end(tokens_per_expert, groups: int, rows: int, device) -> torch.Tensor:
    if isinstance(tokens_per_expert, Sequence) and not isinstance(tokens_per_expert, torch.Tensor):
        tokens_per_expert = torch.tensor(list(tokens_per_expert), dtype=torch.int64)
    if tokens_per_expert.dim() != 1 or tokens_per_expert.numel() != groups:
        raise ValueError(
            f"tokens_per_expert has shape {tuple(tokens_per_expert.shape)}; expected ({groups},) "
            "to match w.shape[0]"
        )
    if not tokens_per_expert.is_cuda:  # checkable without a device sync
        counts = tokens_per_expert.tolist()
        if min(counts, default=0) < 0 or sum(counts) != rows:
            raise ValueError(
                f"tokens_per_expert {counts} must be non-negative and sum to x.shape[0]={rows}"
            )
    return tokens_per_expert.cumsum(0).to(device=device, dtype=torch.int32)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor | Sequence[int],
    backend: Backend = "auto",
    main_grad_param: torch.nn.Parameter | None = None,
) -> torch.Tensor:
    """Grouped GEMM with autograd: out[rows of g] = x[rows of g] @ w[g].

    Args:
        x: [T, K] rows sorted by expert.
        w: [G, K, N] one weight per expert (local experts of this rank); a transposed view
            of an `nn.Linear`-layout [G, N, K] tensor is used without a copy.
        tokens_per_expert: [G] row counts (CPU or device tensor, or a list); zeros allowed; they
            must sum to T. On the CPU this is checked before anything runs. On the GPU a
            host check would synchronize, so the CUTLASS kernel checks on the device: a bad
            group is computed as empty (nothing outside the tensors is touched) and the next
            call, or `cutlass_grouped_gemm.check_device_errors()` after a synchronization
            the caller already has, raises `GroupedGemmCountsError`. The torch backend does
            not check device counts (precondition).
        backend: "auto" (CUTLASS on sm_90 bf16, else torch), "cutlass" or "torch".
        main_grad_param: the Parameter `w` is (or views) when Megatron's
            `gradient_accumulation_fusion` is on: its weight gradient is added in fp32 to
            `main_grad` (when the parameter has one) and `grad_added_to_main_grad` is set,
            instead of a 16-bit `.grad` being returned.

    Returns:
        [T, N] in x's dtype.
    """
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"expected x [T, K] and w [G, K, N] with equal K; got x {tuple(x.shape)}, "
            f"w {tuple(w.shape)}"
        )
    if x.dtype != w.dtype:
        raise ValueError(f"x and w dtypes differ: {x.dtype} vs {w.dtype}")
    resolved = resolve_backend(backend, x, w)
    if resolved == "torch" and x.dtype not in TORCH_DTYPES:
        raise GroupedGemmBackendError(
            f"torch._grouped_mm takes {TORCH_DTYPES}, not {x.dtype}; cast the inputs"
        )
    groups, k, n = w.shape
    group_end = _group_end(tokens_per_expert, groups, x.shape[0], x.device)
    k_pad, n_pad = _round_up(k, ALIGN_ELEMENTS), _round_up(n, ALIGN_ELEMENTS)
    if k_pad != k:
        x = F.pad(x, (0, k_pad - k))
    if (k_pad, n_pad) != (k, n):
        w = F.pad(w, (0, n_pad - n, 0, k_pad - k))
    out = GroupedGemmFunction.apply(x.contiguous(), w, group_end, resolved, main_grad_param)
    return out[:, :n] if n_pad != n else out
