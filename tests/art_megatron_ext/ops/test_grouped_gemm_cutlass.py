"""CUTLASS grouped GEMM on an sm_90 GPU against torch._grouped_mm and a float64 loop.

CPU twin: tests/hybridep/test_build_kernels.py compiles the same library and checks its C ABI
(argument checks, config choice, version refusal) without a GPU,
tests/hybridep/test_kernels_zero_rows_abi.py calls its zero-row entry points for real, and
test_grouped_gemm.py checks the Python marshalling (null pointers, no workspace at zero rows,
the device-counts flag) and that `backend="cutlass"` on CPU is an error.
"""

from __future__ import annotations

import pytest
import torch

from art_megatron_ext.ops import grouped_gemm

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")]

CASES = [
    # groups, k, n, counts (config follows from rows per group: <256 ping-pong, else coop)
    (8, 256, 512, [300, 0, 17, 1024, 1, 0, 700, 90]),
    (4, 2048, 1536, [2048, 4096, 0, 1000]),
    (16, 128, 64, [3] * 16),
    (3, 13, 7, [5, 0, 9]),  # padded inside the op
    (2, 64, 64, [0, 0]),
    (1, 512, 256, [777]),
]


def _loop64(x, w, counts):
    outs, start = [], 0
    for g, c in enumerate(counts):
        outs.append(x[start : start + c].double() @ w[g].double())
        start += c
    return torch.cat(outs)


@pytest.mark.parametrize("groups,k,n,counts", CASES)
def test_cutlass_matches_torch_grouped_mm_forward_and_backward(groups, k, n, counts):
    torch.manual_seed(groups * 1000 + k)
    dev = "cuda"
    rows = sum(counts)
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(groups, k, n, device=dev) / k**0.5).to(torch.bfloat16)
    dy = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
    results = {}
    for backend in ("cutlass", "torch"):
        xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_gemm(xb, wb, torch.tensor(counts), backend=backend)
        y.backward(dy)
        results[backend] = (y.detach(), xb.grad, wb.grad)
    ref = _loop64(x, w, counts)
    scale = max(ref.abs().max().item() if ref.numel() else 1.0, 1.0)
    pairs = zip(results["cutlass"], results["torch"], strict=True)
    for (a, b), name in zip(pairs, ("y", "dx", "dw"), strict=True):
        assert a.shape == b.shape, name
        err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        bscale = max(b.double().abs().max().item() if b.numel() else 1.0, 1.0)
        assert err <= 2e-2 * bscale, f"{name}: cutlass vs torch differ by {err}"
    err_ref = (results["cutlass"][0].double() - ref).abs().max().item() if rows else 0.0
    assert err_ref <= 2e-2 * scale
    for g, c in enumerate(counts):
        if c == 0:
            assert torch.count_nonzero(results["cutlass"][2][g]) == 0, "empty expert dW not 0"


@pytest.mark.parametrize("config", [0, 1])
def test_both_tile_configs_agree(config):
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    torch.manual_seed(config)
    counts = [129, 0, 300, 5]
    x = torch.randn(sum(counts), 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 256, 384, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    y = cg.fwd(x, w, ends, config=config)
    torch.testing.assert_close(y, torch._grouped_mm(x, w, offs=ends), rtol=2e-2, atol=2e-2)


def test_linear_layout_weight_view_matches_torch_backend():
    """w passed as the transposed view of [G, N, K]: CUTLASS runs dgrad/fwd/wgrad swapped."""
    torch.manual_seed(5)
    counts = [100, 0, 300, 17]
    x = torch.randn(sum(counts), 256, device="cuda", dtype=torch.bfloat16)
    w_linear = (torch.randn(4, 384, 256, device="cuda") / 16).to(torch.bfloat16)
    dy = torch.randn(sum(counts), 384, device="cuda", dtype=torch.bfloat16)
    results = {}
    for backend in ("cutlass", "torch"):
        xb, wb = x.clone().requires_grad_(), w_linear.clone().requires_grad_()
        y = grouped_gemm(xb, wb.transpose(1, 2), counts, backend=backend)
        y.backward(dy)
        results[backend] = (y.detach(), xb.grad, wb.grad)
    for a, b in zip(results["cutlass"], results["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * max(b.abs().max().item(), 1.0))


def test_zero_rows_on_every_expert_forward_and_backward():
    """A rank whose experts got no token: x is [0, k] (a null data pointer); y and dx are
    empty and dW is exactly zero for every expert (ABI 1 refused the null pointers)."""
    x = torch.zeros(0, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = grouped_gemm(x, w, torch.zeros(4, dtype=torch.int64, device="cuda"), backend="cutlass")
    assert y.shape == (0, 128)
    y.sum().backward()
    assert x.grad.shape == (0, 256) and torch.count_nonzero(w.grad) == 0


def test_device_counts_that_do_not_sum_to_the_rows_are_flagged_without_a_sync():
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    x = torch.randn(10, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2, 64, 64, device="cuda", dtype=torch.bfloat16)
    bad_counts = torch.tensor([4, 9], device="cuda")  # sum 13, x has 10 rows
    cg._error_flag(x.device)  # allocated once per device (pinned), before the check below
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the op must not read the counts on the host
    try:
        grouped_gemm(x, w, bad_counts, backend="cutlass")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # a sync point the caller already has
    with pytest.raises(cg.GroupedGemmCountsError, match=r"does not sum to x\.shape"):
        cg.check_device_errors()
    cg.check_device_errors()  # cleared: the next call runs normally
    y = grouped_gemm(x, w, torch.tensor([4, 6], device="cuda"), backend="cutlass")
    torch.testing.assert_close(y[:4], x[:4] @ w[0], rtol=2e-2, atol=2e-1)
