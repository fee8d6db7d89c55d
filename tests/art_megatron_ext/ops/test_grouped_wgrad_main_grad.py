"""Grouped weight gradients into Megatron's fp32 `main_grad` (issue 38 item 3), CPU reference.

Under `gradient_accumulation_fusion` Megatron's linears add dW to the parameter's fp32
`main_grad` themselves and set `grad_added_to_main_grad`, so the DDP hook does not add a 16-bit
`.grad` again. The grouped GEMM used to ignore it: a bf16 `.grad` per step (a rounding of dW
and one expert-sized buffer) that the hook then added. Now dW is computed in fp32 and added in
place; the gradient returned is Megatron's dummy.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from art_megatron_ext.ops.grouped_gemm import grouped_gemm

COUNTS = [5, 0, 11]


def _case(k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(COUNTS), k, generator=g).to(torch.bfloat16)
    w = torch.randn(len(COUNTS), k, n, generator=g).to(torch.bfloat16)
    upstream = torch.randn(sum(COUNTS), n, generator=g).to(torch.bfloat16)
    start = torch.randn(len(COUNTS), k, n, generator=g)  # main_grad before this step
    return x, w, upstream, start


def _exact_dw(x, upstream) -> torch.Tensor:
    """X_g^T dY_g in float64 from the bf16 operands."""
    ends = torch.tensor(COUNTS).cumsum(0).tolist()
    parts, begin = [], 0
    for end in ends:
        parts.append(x[begin:end].double().t() @ upstream[begin:end].double())
        begin = end
    return torch.stack(parts)


@pytest.mark.parametrize("k, n", [(16, 8), (12, 6)])  # aligned; padded to 16 x 8 inside
def test_wgrad_is_added_to_main_grad_in_fp32_and_flagged(k, n):
    x, w, upstream, start = _case(k, n)
    param = torch.nn.Parameter(w.clone())
    param.main_grad = start.clone()
    param.grad_added_to_main_grad = False  # what Megatron's DDP sets on its parameters
    out = grouped_gemm(x, param, COUNTS, backend="torch", main_grad_param=param)
    out.backward(upstream)
    exact = start.double() + _exact_dw(x, upstream)
    fused_err = float((param.main_grad.double() - exact).abs().max())
    assert fused_err < 1e-5
    assert param.grad_added_to_main_grad is True
    assert param.grad is not None and param.grad.shape == param.shape  # the hook's dummy
    # the unfused path rounds dW to bf16 before it is added: a coarser sum
    plain = torch.nn.Parameter(w.clone())
    grouped_gemm(x, plain, COUNTS, backend="torch").backward(upstream)
    unfused_err = float((start.double() + plain.grad.double() - exact).abs().max())
    assert fused_err < unfused_err


def test_outside_megatron_ddp_the_gradient_is_added_and_none_is_returned():
    x, w, upstream, start = _case(16, 8)
    param = torch.nn.Parameter(w.clone())
    param.main_grad = start.clone()  # no grad_added_to_main_grad attribute: no DDP hook
    grouped_gemm(x, param, COUNTS, backend="torch", main_grad_param=param).backward(upstream)
    assert param.grad is None
    assert (
        float((param.main_grad.double() - start.double() - _exact_dw(x, upstream)).abs().max())
        < 1e-5
    )


def _linear(fusion: bool):
    # imported here: art_megatron_ext.moe needs megatron-core, which the GPU image of
    # bench/gpu_check.sh (it runs this file's CUDA test) does not carry for tests/.../ops
    from art_megatron_ext.moe.grouped_linear import ArtGroupedLinear

    config = SimpleNamespace(
        params_dtype=torch.bfloat16, use_cpu_initialization=True, gated_linear_unit=False,
        gradient_accumulation_fusion=fusion,
    )  # fmt: skip
    return ArtGroupedLinear(len(COUNTS), 16, 8, kind="row", config=config, backend="torch")


def test_the_grouped_linear_follows_gradient_accumulation_fusion():
    x, w, upstream, start = _case(16, 8)
    fused, plain = _linear(True), _linear(False)
    for linear in (fused, plain):
        with torch.no_grad():
            linear.weight.copy_(w)
        linear.weight.main_grad = start.clone()
        linear.weight.grad_added_to_main_grad = False
        linear(x, COUNTS)[0].backward(upstream)
    exact = start.double() + _exact_dw(x, upstream)
    assert fused.weight.grad_added_to_main_grad is True
    assert float((fused.weight.main_grad.double() - exact).abs().max()) < 1e-5
    # without the fusion the gradient is a bf16 .grad and main_grad is the hook's to fill
    assert plain.weight.grad_added_to_main_grad is False
    assert torch.equal(plain.weight.main_grad, start) and plain.weight.grad.dtype == torch.bfloat16


def test_without_a_main_grad_buffer_the_fusion_returns_the_gradient():
    """`gradient_accumulation_fusion` on, but no DDP buffer yet (main_grad absent): .grad."""
    x, _, upstream, _ = _case(16, 8)
    linear = _linear(True)
    linear(x, COUNTS)[0].backward(upstream)
    assert linear.weight.grad is not None and linear.weight.grad.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU twin above)")
@pytest.mark.parametrize("backend", ["torch", "cutlass"])
def test_wgrad_into_main_grad_on_cuda(backend):
    """The GPU path adds the backend's bf16 wgrad (upcast) and sets the flag; within one bf16
    rounding of dW of the exact sum (the fp32 epilogue is a follow-up)."""
    from art_megatron_ext.ops.grouped_gemm import cutlass_unavailable_reason

    x, w, upstream, start = (t.cuda() for t in _case(64, 64))
    if backend == "cutlass" and cutlass_unavailable_reason(x, w) is not None:
        pytest.skip(cutlass_unavailable_reason(x, w))
    param = torch.nn.Parameter(w.clone())
    param.main_grad = start.clone()
    param.grad_added_to_main_grad = False
    grouped_gemm(x, param, COUNTS, backend=backend, main_grad_param=param).backward(upstream)
    exact = start.double() + _exact_dw(x.cpu(), upstream.cpu()).cuda()
    scale = float(exact.abs().max())
    assert param.grad_added_to_main_grad is True
    assert float((param.main_grad.double() - exact).abs().max()) < 1e-2 * scale
