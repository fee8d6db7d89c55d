"""grouped_gemm op: forward and backward against a float64 per-expert loop (CPU, torch backend).

Tolerances: fp32 inputs must match the float64 loop to 1e-5 relative to the output scale (one
fp32 rounding per product term); bf16 inputs to 2e-2 (bf16 output rounding plus bf16 inputs).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from art_megatron_ext.ops import GroupedGemmBackendError, grouped_gemm, resolve_backend

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def loop_reference(x, w, counts):
    """Per-expert matmul loop in float64 with autograd: the specification."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    outs, start = [], 0
    for g, c in enumerate(counts):
        outs.append(x64[start : start + c] @ w64[g])
        start += c
    y = torch.cat(outs) if outs else x64.new_zeros(0, w.shape[2])
    return x64, w64, y


def _case(seed, groups, k, n, counts, dtype):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    x = torch.randn(rows, k, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(groups, k, n, generator=gen) / k**0.5).to(dtype).requires_grad_()
    dy = torch.randn(rows, n, generator=gen).to(dtype)
    return x, w, dy


def _close(actual, expected, dtype):
    scale = expected.abs().max().item() if expected.numel() else 1.0
    err = (actual.double() - expected).abs().max().item() if expected.numel() else 0.0
    assert err <= TOL[dtype] * max(scale, 1.0), f"max error {err} vs scale {scale}"


CASES = [
    # (groups, k, n, counts): aligned, non-aligned K/N, empty experts, one expert, all empty
    (4, 16, 24, [5, 0, 7, 3]),
    (3, 13, 7, [4, 9, 1]),
    (5, 32, 9, [0, 0, 6, 0, 2]),
    (1, 20, 33, [11]),
    (2, 8, 8, [0, 0]),
    (6, 40, 16, [17, 1, 0, 23, 8, 2]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups,k,n,counts", CASES)
def test_forward_and_backward_match_float64_loop(groups, k, n, counts, dtype):
    x, w, dy = _case(sum(counts) + k * n, groups, k, n, counts, dtype)
    y = grouped_gemm(x, w, torch.tensor(counts), backend="torch")
    assert y.shape == (sum(counts), n) and y.dtype == dtype
    y.backward(dy)
    x64, w64, y64 = loop_reference(x, w, counts)
    y64.backward(dy.double())
    _close(y.detach(), y64.detach(), dtype)
    assert x.grad.shape == x.shape and w.grad.shape == w.shape  # logical shapes only
    _close(x.grad, x64.grad, dtype)
    _close(w.grad, w64.grad, dtype)


def test_empty_expert_weight_gradient_is_exactly_zero():
    x, w, dy = _case(0, 3, 12, 10, [4, 0, 5], torch.float32)
    grouped_gemm(x, w, [4, 0, 5], backend="torch").backward(dy)
    assert torch.count_nonzero(w.grad[1]) == 0
    assert torch.count_nonzero(w.grad[0]) > 0


def test_padding_never_leaks_into_logical_weight_gradient():
    """K=13, N=7 are padded to 16/8 inside; the gradient equals the unpadded loop exactly in
    fp32-vs-fp32 terms and keeps the logical shape."""
    x, w, dy = _case(1, 2, 13, 7, [6, 5], torch.float32)
    grouped_gemm(x, w, [6, 5], backend="torch").backward(dy)
    ref = torch.stack([x[:6].detach().t() @ dy[:6], x[6:].detach().t() @ dy[6:]])
    assert w.grad.shape == (2, 13, 7)
    torch.testing.assert_close(w.grad, ref, rtol=1e-5, atol=1e-5)


def test_sum_backward_with_broadcast_gradient_works():
    x, w, _ = _case(2, 3, 8, 16, [3, 3, 2], torch.float32)
    grouped_gemm(x, w, [3, 3, 2], backend="torch").sum().backward()
    x64, w64, y64 = loop_reference(x, w, [3, 3, 2])
    y64.sum().backward()
    _close(x.grad, x64.grad, torch.float32)
    _close(w.grad, w64.grad, torch.float32)


@pytest.mark.parametrize(
    "counts,match",
    [([3, 3], r"sum to x.shape\[0\]=7"), ([8, -1], "non-negative"), ([7], r"expected \(2,\)")],
)
def test_bad_tokens_per_expert_is_refused(counts, match):
    x, w, _ = _case(3, 2, 8, 8, [4, 3], torch.float32)
    with pytest.raises(ValueError, match=match):
        grouped_gemm(x, w, counts, backend="torch")


def test_mismatched_shapes_and_dtypes_are_refused():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="equal K"):
        grouped_gemm(x, torch.randn(2, 9, 8), [2, 2], backend="torch")
    with pytest.raises(ValueError, match="dtypes differ"):
        grouped_gemm(x, torch.randn(2, 8, 8, dtype=torch.bfloat16), [2, 2], backend="torch")


def test_float64_is_refused_naming_the_dtype():
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(GroupedGemmBackendError, match="float64"):
        grouped_gemm(x, torch.randn(2, 8, 8, dtype=torch.float64), [2, 2])


def test_cutlass_request_on_cpu_is_an_error_not_a_fallback():
    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(2, 8, 8, dtype=torch.bfloat16)
    with pytest.raises(GroupedGemmBackendError, match="needs an sm_90 GPU"):
        grouped_gemm(x, w, [2, 2], backend="cutlass")


def test_auto_picks_torch_on_cpu_and_unknown_backend_is_refused():
    x, w = torch.randn(4, 8), torch.randn(2, 8, 8)
    assert resolve_backend("auto", x, w) == "torch"
    with pytest.raises(ValueError, match="backend='triton'"):
        resolve_backend("triton", x, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_layout_weight_view_is_used_without_copy(dtype):
    """A [G, N, K] (nn.Linear layout, as LoRA B/A and Megatron linears store it) passed as its
    transposed view gives the same output and gradients, and the op saves the weight itself."""
    counts = [6, 0, 9, 3]
    x, w, dy = _case(7, 4, 24, 16, counts, dtype)
    w_linear = w.detach().transpose(1, 2).contiguous().requires_grad_()  # [G, N, K]
    y = grouped_gemm(x, w_linear.transpose(1, 2), counts, backend="torch")
    assert y.grad_fn.saved_tensors[1].data_ptr() == w_linear.data_ptr()
    y.backward(dy)
    x64, w64, y64 = loop_reference(x, w, counts)
    y64.backward(dy.double())
    _close(y.detach(), y64.detach(), dtype)
    _close(x.grad, x64.grad, dtype)
    assert w_linear.grad.shape == w_linear.shape
    _close(w_linear.grad, w64.grad.transpose(1, 2), dtype)


# -- backend choice without CUTLASS headers, and what crosses the C ABI (CPU twins) ---------
class _FakeCudaTensor:
    """What `cutlass_unavailable_reason` reads of a tensor on an sm_90 GPU."""

    is_cuda, dtype, device = True, torch.bfloat16, "cuda:0"


def test_auto_checks_the_cutlass_headers_before_choosing_cutlass(monkeypatch, tmp_path):
    """An sm_90 GPU with nvcc but no `nvidia-cutlass` (and no $ART_CUTLASS_DIR tree): "auto"
    must take torch (it used to pick CUTLASS and die with ModuleNotFoundError on the first
    call) and an explicit "cutlass" must say which headers are missing."""
    import importlib

    gg = importlib.import_module("art_megatron_ext.ops.grouped_gemm")  # the module, not the op

    monkeypatch.setattr(gg.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    gg.reset_backend_cache()  # the machine is probed once per process: probe this one
    monkeypatch.setenv("ART_CUTLASS_DIR", str(tmp_path))  # a tree without the headers
    x = w = _FakeCudaTensor()
    assert gg.resolve_backend("auto", x, w) == "torch"
    with pytest.raises(GroupedGemmBackendError, match="CUTLASS headers"):
        gg.resolve_backend("cutlass", x, w)


class _RecordingLib:
    """Stands in for libart_grouped_gemm.so: records the params of each call."""

    def __init__(self, raise_flag: bool = False) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.raise_flag = raise_flag

    def _record(self, name, ref):
        p = ref._obj
        self.calls.append((name, {f: getattr(p, f) for f, _ in p._fields_}))
        if self.raise_flag:  # what the device does on inconsistent group ends
            import ctypes

            ctypes.c_int32.from_address(p.error_flag).value = 1
        return 0

    def art_grouped_gemm_workspace_size(self, ref, size_ref):
        self.calls.append(("workspace_size", {}))
        size_ref._obj.value = 1024
        return 0

    def __getattr__(self, name):
        if name.startswith("art_grouped_gemm_"):
            return lambda ref: self._record(name.removeprefix("art_grouped_gemm_"), ref)
        raise AttributeError(name)


@pytest.fixture
def cg_on_cpu(monkeypatch):
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    flags: dict = {}
    monkeypatch.setattr(cg, "_stream_of", lambda device: 0)
    monkeypatch.setattr(cg, "_device_index", lambda device: 0)
    monkeypatch.setattr(cg, "_ERROR_FLAGS", flags)
    monkeypatch.setattr(
        cg, "_error_flag", lambda device: flags.setdefault(0, torch.zeros(1, dtype=torch.int32))
    )
    return cg


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_zero_rows_pass_null_row_pointers_and_allocate_no_workspace(cg_on_cpu, op):
    lib = _RecordingLib()
    x = torch.zeros(0, 64, dtype=torch.bfloat16)
    w = torch.randn(4, 64, 32).to(torch.bfloat16)
    ends = torch.zeros(4, dtype=torch.int32)
    a = x if op == "fwd" else torch.zeros(0, 32, dtype=torch.bfloat16)
    out = getattr(cg_on_cpu, op)(a, w, ends, lib=lib)
    assert out.shape == ((0, 32) if op == "fwd" else (0, 64))
    assert [name for name, _ in lib.calls] == [op]  # no workspace query at zero rows
    params = lib.calls[0][1]
    assert params["total_rows"] == 0 and params["a"] is None and params["out"] is None
    assert params["b"] == w.data_ptr() and params["workspace"] is None


def test_zero_rows_wgrad_passes_the_weight_gradient_to_zero(cg_on_cpu):
    lib = _RecordingLib()
    x, dy = torch.zeros(0, 64, dtype=torch.bfloat16), torch.zeros(0, 32, dtype=torch.bfloat16)
    dw = cg_on_cpu.wgrad(x, dy, torch.zeros(3, dtype=torch.int32), lib=lib)
    assert dw.shape == (3, 64, 32)
    params = lib.calls[-1][1]
    assert params["out"] == dw.data_ptr() and params["a"] is None and params["b"] is None


def test_a_device_side_count_error_is_raised_by_the_next_call(cg_on_cpu):
    """The device flags inconsistent group ends in pinned memory; the host raises at its next
    call (or `check_device_errors()` after its own sync), without synchronizing itself."""
    x, w = torch.randn(6, 64).to(torch.bfloat16), torch.randn(2, 64, 32).to(torch.bfloat16)
    ends = torch.tensor([4, 9], dtype=torch.int32)  # 9 != 6 rows
    cg_on_cpu.fwd(x, w, ends, lib=_RecordingLib(raise_flag=True))
    with pytest.raises(cg_on_cpu.GroupedGemmCountsError, match="does not sum"):
        cg_on_cpu.fwd(x, w, torch.tensor([4, 6], dtype=torch.int32), lib=_RecordingLib())
    cg_on_cpu.check_device_errors()  # cleared after it was reported
