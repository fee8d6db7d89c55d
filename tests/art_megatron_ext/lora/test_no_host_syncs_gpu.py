"""No host synchronization in a LoRA training step on CUDA (issue 24 item 5; marked `gpu`).

One training step of a model with LoRA sites (forward, backward, `zero_lora_padding_`, an
Adam step, `zero_lora_padding_` again) runs under `torch.cuda.set_sync_debug_mode("error")`
after a warm-up step: any device-to-host read (`.item()`, `.tolist()`, a boolean index) or
blocking copy raises there. The model holds what LoRA adds to a trainer's step and nothing
else: two real Megatron local-spec linears (`ColumnParallelLinear`, `RowParallelLinear`,
dense sites) and two `ArtGroupedLinear` expert linears (grouped sites, no Transformer Engine),
with `m_splits` already on the device as a token dispatcher computes it. Megatron's GPT loss
and its optimizers are left out on purpose: their found-inf and grad-norm checks read the
device by design. Megatron's mixed-precision recipe is done by hand instead (bf16 parameters,
fp32 main copies in torch AdamW), as is the plain torch-optimizer path (fp32 LoRA parameters).

Known: a host `m_splits` list costs one host-to-device copy per grouped linear per forward
(`grouped.splits_on_device`), which this mode also reports; fp32 grouped LoRA GEMMs may run on
torch's `_grouped_mm` fallback, which may read the group offsets on the host: not tested
here until measured on a GPU (a test that passes either way would say nothing).

CPU twins: tests/art_megatron_ext/ops/test_grouped_gemm_backend.py checks that `grouped_gemm`
resolves its backend once per process and input class (no per-call file-system probe); the
CPU test here runs the same step (without the sync check) so a harness bug costs no device
time. This file needs megatron-core (local-spec linears only, no Transformer Engine), which
the GPU image lacks: bench/gpu_check.sh puts the carried one on PYTHONPATH
(`bench/gpu_check_unpack.py`), and the CUDA tests fail rather than skip if it is missing.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from art_megatron_ext.lora import LoraConfig, attach_lora, iter_lora_sites, zero_lora_padding_
from art_megatron_ext.lora.padding import logical_view, padding_is_zero

HIDDEN, FFN, EXPERTS, RANK = 64, 96, 4, 8
SPLITS = [20, 0, 28, 16]  # tokens per expert, one expert empty
TOKENS = sum(SPLITS)
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
#: torch._grouped_mm has its bf16 kernel on sm_90 and sm_100 only (elsewhere it loops on the host)
BF16_GROUPED_MM = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)
CUDA_ONLY = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: a host sync only exists on a device (CPU twins: "
    "ops/test_grouped_gemm_backend.py and the CPU step test in this file)",
)


@contextmanager
def no_host_syncs():
    """Raise on any synchronizing CUDA call inside the block."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _config(dtype: torch.dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=4,
        gated_linear_unit=True,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
    )


class _DenseMlp(torch.nn.Module):
    """A gated MLP of Megatron's local-spec linears (dense LoRA sites)."""

    def __init__(self, config) -> None:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(
            HIDDEN, 2 * FFN, config=config, init_method=config.init_method, bias=False,
            gather_output=False,
        )  # fmt: skip
        self.linear_fc2 = RowParallelLinear(
            FFN, HIDDEN, config=config, init_method=config.output_layer_init_method, bias=False,
            input_is_parallel=True, skip_bias_add=True,
        )  # fmt: skip

    def forward(self, x):
        gate, up = self.linear_fc1(x)[0].chunk(2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)[0]


class _Experts(torch.nn.Module):
    """Gated experts on `ArtGroupedLinear` (grouped LoRA sites through `grouped_gemm`)."""

    def __init__(self, config, backend: str) -> None:
        from art_megatron_ext.moe.grouped_linear import ArtGroupedLinear

        super().__init__()
        self.num_local_experts = EXPERTS
        make = lambda i, o, kind: ArtGroupedLinear(  # noqa: E731
            EXPERTS, i, o, kind=kind, config=config, backend=backend
        )
        self.linear_fc1 = make(HIDDEN, 2 * FFN, "column")
        self.linear_fc2 = make(FFN, HIDDEN, "row")
        for linear in (self.linear_fc1, self.linear_fc2):
            linear.init_like_megatron(config.init_method)

    def forward(self, x, splits):
        gate, up = self.linear_fc1(x, splits)[0].chunk(2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up, splits)[0]


class _Model(torch.nn.Module):
    """`decoder.layers[0].mlp` dense, `decoder.layers[1].mlp.experts` grouped (optional)."""

    def __init__(self, config, backend: str, experts: bool) -> None:
        super().__init__()
        layers = []
        for number in (1, 2) if experts else (1,):
            layer = torch.nn.Module()
            layer.layer_number = number
            layer.mlp = _DenseMlp(config) if number == 1 else torch.nn.Module()
            if number == 2:
                layer.mlp.experts = _Experts(config, backend)
            layers.append(layer)
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(layers)

    def forward(self, x, splits):
        x = x + self.decoder.layers[0].mlp(x)
        if len(self.decoder.layers) > 1:
            x = x + self.decoder.layers[1].mlp.experts(x, splits)
        return x


class _Trainer:
    """One step: forward, backward, padding cleanup, AdamW, padding cleanup.

    `main_params`: the LoRA parameters stay in the model's dtype and AdamW steps fp32 copies
    of them (Megatron's mixed-precision optimizer, by hand); otherwise AdamW steps the LoRA
    parameters themselves (fp32 LoRA, the plain torch-optimizer path)."""

    def __init__(self, model, main_params: bool) -> None:
        self.model = model
        self.params = [p for e in iter_lora_sites(model) for _, p in e.tensors]
        self.main = (
            [p.detach().float().clone().requires_grad_() for p in self.params]
            if main_params
            else None
        )
        held = self.main if main_params else self.params
        self.optimizer = torch.optim.AdamW(held, lr=1e-2, foreach=True)

    def step(self, x, splits) -> torch.Tensor:
        loss = self.model(x, splits).float().pow(2).mean()
        loss.backward()
        zero_lora_padding_(self.model, None if self.main else self.optimizer)
        if self.main is not None:
            for p, m in zip(self.params, self.main, strict=True):
                m.grad = p.grad.float()
        self.optimizer.step()
        if self.main is not None:
            with torch.no_grad():
                for p, m in zip(self.params, self.main, strict=True):
                    p.copy_(m)
        zero_lora_padding_(self.model, None if self.main else self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        return loss.detach()


def _build(device, dtype, lora_dtype, backend="torch", experts=True):
    torch.manual_seed(0)
    model = _Model(_config(dtype), backend, experts).to(device)
    attach_lora(
        model,
        LoraConfig(rank=RANK, alpha=16.0, targets=("linear_fc1", "linear_fc2"), dtype=lora_dtype),
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero B: every factor gets a gradient from the first step
        for e in iter_lora_sites(model):
            view = logical_view(e.adapter.b)
            view.copy_(torch.randn(view.shape, generator=g) * 0.02)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(device, dtype)
    splits = torch.tensor(SPLITS, device=device)  # on the device, as a dispatcher hands it
    return model, x, splits


def _assert_trained_and_padding_zero(model, before):
    for e in iter_lora_sites(model):
        for name, p in e.tensors:
            assert padding_is_zero(p, tuple(p.lora_logical_shape)), f"{e.path}.{name}"
            assert not torch.equal(p.detach().cpu(), before[(e.path, name)]), f"{e.path}.{name}"


def _snapshot(model):
    return {
        (e.path, n): p.detach().cpu().clone() for e in iter_lora_sites(model) for n, p in e.tensors
    }


@pytest.fixture(scope="module")
def cuda_world():
    """nccl world of 1, Megatron parallel state TP=1, CUDA RNG tracker seeded."""
    from support.cuda_world import nccl_world_of_one

    with nccl_world_of_one("art_sync_"):
        yield


def _second_step_syncs_nothing(model, x, splits, main_params: bool) -> None:
    """A warm-up step (optimizer state, backend choice, kernel loads), then a step under
    `no_host_syncs`: it trains and keeps the padding zero."""
    trainer = _Trainer(model, main_params=main_params)
    trainer.step(x, splits)
    before = _snapshot(model)
    with no_host_syncs():
        loss = trainer.step(x, splits)
    assert torch.isfinite(loss).item()
    _assert_trained_and_padding_zero(model, before)


def _cutlass_or_skip(backend: str) -> None:
    if backend != "cutlass":
        return
    from art_megatron_ext.ops.grouped_gemm import cutlass_unavailable_reason

    probe = torch.empty(8, 8, device="cuda", dtype=torch.bfloat16)
    reason = cutlass_unavailable_reason(probe, probe.expand(2, 8, 8))
    if reason:
        pytest.skip(f"CUTLASS grouped GEMM unavailable: {reason}")


@pytest.mark.gpu
@CUDA_ONLY
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(
            "torch",
            marks=pytest.mark.skipif(
                not BF16_GROUPED_MM, reason="torch's bf16 grouped GEMM needs sm_90 or sm_100"
            ),
        ),
        pytest.param(
            "cutlass",
            marks=pytest.mark.skipif(not HOPPER, reason="the CUTLASS kernel needs sm_90"),
        ),
    ],
)
def test_bf16_step_with_fp32_main_params_syncs_nothing(cuda_world, backend):
    """bf16 base and LoRA, fp32 main params: dense and grouped sites, bf16 grouped GEMMs."""
    _cutlass_or_skip(backend)
    _second_step_syncs_nothing(*_build("cuda", torch.bfloat16, None, backend), main_params=True)


@pytest.mark.gpu
@CUDA_ONLY
def test_fp32_lora_step_under_a_torch_optimizer_syncs_nothing_on_dense_sites(cuda_world):
    """bf16 base, fp32 LoRA stepped by AdamW itself; `zero_lora_padding_` masks its moments."""
    built = _build("cuda", torch.bfloat16, torch.float32, experts=False)
    _second_step_syncs_nothing(*built, main_params=False)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU harness check; the CUDA tests above run the step"
)
@pytest.mark.parametrize("main_params", [True, False])
def test_the_step_harness_trains_and_keeps_padding_zero_on_cpu(megatron_world, main_params):
    lora_dtype = None if main_params else torch.float32
    model, x, splits = _build("cpu", torch.bfloat16, lora_dtype)
    trainer = _Trainer(model, main_params=main_params)
    trainer.step(x, splits)
    before = _snapshot(model)
    loss = trainer.step(x, splits)
    assert torch.isfinite(loss).item()
    assert len(before) == 8  # 2 dense + 2 grouped sites, A and B each
    _assert_trained_and_padding_zero(model, before)
