"""Padding cleanup in optimizer state: masks built once, live storage, precision refusal.

A Megatron `DistributedOptimizer` (fp32, one rank, CPU) over a LoRA GPT: `zero_lora_padding_`
masks each parameter's flat shard of the main params and moments. The mask is built once per
parameter (it used to be built on the host and copied per state tensor on every call); with
`use_precision_aware_optimizer` Megatron's state accessor hands back unscaled copies, so the
live storage must be masked instead; and a plain torch optimizer stepping bf16 LoRA
parameters is refused.
"""

from __future__ import annotations

import pytest
import torch
from support.distopt_model import build, optimizer_builder, train_step

from art_megatron_ext import compat
from art_megatron_ext.lora import iter_lora_sites, zero_lora_padding_
from art_megatron_ext.lora import padding as padding_mod
from art_megatron_ext.lora.padding import logical_shape, padding_mask
from art_megatron_ext.lora.sites import LoraPrecisionError, check_lora_optimizer_precision


def _lora_params(model) -> list[torch.nn.Parameter]:
    return [p for e in iter_lora_sites(model) for _, p in e.tensors]


def _shard_mask(optimizer, param) -> torch.Tensor:
    start, end = compat.distopt_param_shard(optimizer, param)
    return padding_mask(tuple(param.shape), logical_shape(param)).view(-1)[start:end]


def _live_states(optimizer, param) -> dict:
    """The inner optimizer's own tensors for `param`'s shard (not Megatron's accessor)."""
    group, order = optimizer.model_param_group_index_map[param]
    shard = optimizer.optimizer.param_groups[group]["params"][order]
    state = optimizer.optimizer.state[shard]
    shaped = {k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == shard.shape}
    return {"shard": shard, **shaped}  # not Adam's scalar "step"


def _step(ddp, optimizer, step: int) -> None:
    """One step on the whole global batch, padding zeroed in the optimizer's state too."""
    train_step(ddp, optimizer, step, slice(None), mask_optimizer=True)


@pytest.fixture()
def distopt(megatron_world):
    """(DDP model, Megatron optimizer, its one DistributedOptimizer) after one step."""
    from support.megatron_cpu import cpu_shim, cuda_tensor_type_names

    with cpu_shim(), cuda_tensor_type_names():
        ddp = build(tp=1, dtype=torch.float32)
        optimizer = optimizer_builder(ddp, "adam", bf16=False, lr=0.05)(None)
        (part,) = compat.chained_parts(optimizer)
        _step(ddp, optimizer, 0)  # allocates the moments
        yield ddp, optimizer, part


def _scribble_(tensors, mask) -> None:
    with torch.no_grad():
        for value in tensors:
            value.masked_fill_(mask, 3.0)


def test_shard_masks_are_built_once_across_calls(distopt, monkeypatch):
    ddp, optimizer, part = distopt
    builds = []
    original = padding_mod.padding_mask
    monkeypatch.setattr(
        padding_mod, "padding_mask", lambda *a, **k: builds.append(1) or original(*a, **k)
    )
    owned = [p for p in _lora_params(ddp.module) if compat.distopt_owns(part, p)]
    padded = [p for p in owned if bool(_shard_mask(part, p).any())]
    assert padded, "no LoRA shard with padding: the test would prove nothing"
    for p in padded:  # forget what earlier steps cached, then count three calls
        p.__dict__.pop(getattr(padding_mod, "SHARD_MASK_CACHE_ATTR", ""), None)
    for _ in range(3):
        zero_lora_padding_(ddp.module, optimizer)
    assert len(builds) == len(owned)  # one per parameter, not one per call (was 3x)
    for step in (1, 2):
        _step(ddp, optimizer, step)
    assert len(builds) == len(owned)


def test_padding_in_state_stays_zero_through_steps(distopt):
    ddp, optimizer, part = distopt
    params = [p for p in _lora_params(ddp.module) if compat.distopt_owns(part, p)]
    for p in params:
        _scribble_(_live_states(part, p).values(), _shard_mask(part, p))
    _step(ddp, optimizer, 1)
    for p in params:
        mask = _shard_mask(part, p)
        for name, value in _live_states(part, p).items():
            assert bool((value.detach()[mask] == 0).all()), name


def test_precision_aware_optimizer_live_storage_is_masked(distopt, monkeypatch):
    """Megatron's accessor returns `get_unscaled_state` copies under the precision-aware
    optimizer (the masking went to those copies); the live state must be masked."""
    ddp, optimizer, part = distopt
    params = [p for p in _lora_params(ddp.module) if compat.distopt_owns(part, p)]
    inner = part.optimizer
    for p in params:  # the precision-aware layout: the fp32 master kept as "master_param"
        shard = _live_states(part, p)["shard"]
        inner.state[shard]["master_param"] = shard.detach().clone()
    monkeypatch.setattr(part.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", True)
    monkeypatch.setattr(
        inner, "get_unscaled_state", lambda p, k: inner.state[p][k].float().clone(), raising=False
    )
    for p in params:
        states = _live_states(part, p)
        states.pop("shard")
        _scribble_(states.values(), _shard_mask(part, p))
    zero_lora_padding_(ddp.module, optimizer)
    checked = 0
    for p in params:
        mask = _shard_mask(part, p)
        states = _live_states(part, p)
        states.pop("shard")
        assert set(states) >= {"master_param", "exp_avg", "exp_avg_sq"}
        for name, value in states.items():
            assert bool((value[mask] == 0).all()), name
            checked += int(mask.any())
    assert checked > 0


def test_bf16_lora_with_a_plain_torch_optimizer_is_refused(make_lora_gpt):
    model = make_lora_gpt(dtype=torch.bfloat16)
    params = _lora_params(model)
    adam = torch.optim.Adam(params, lr=1e-4)
    with pytest.raises(
        LoraPrecisionError, match=r"lora\.slots\.default\.a is torch\.bfloat16.*Adam"
    ):
        check_lora_optimizer_precision(model, adam)
    padded = params[0]
    with torch.no_grad():
        padded.view(-1)[-1] = 1.0  # in the padding: untouched by a refused call
    with pytest.raises(LoraPrecisionError):
        zero_lora_padding_(model, adam)
    assert padded.view(-1)[-1].item() == 1.0
    zero_lora_padding_(model)  # no optimizer: nothing to refuse
    assert padded.view(-1)[-1].item() == 0.0


def test_fp32_lora_or_unheld_bf16_parameters_pass(make_lora_gpt):
    model = make_lora_gpt(dtype=torch.float32)
    check_lora_optimizer_precision(model, torch.optim.Adam(_lora_params(model), lr=1e-4))
    bf16 = make_lora_gpt(dtype=torch.bfloat16)
    other = torch.nn.Parameter(torch.zeros(2))
    check_lora_optimizer_precision(bf16, torch.optim.SGD([other], lr=1.0))
