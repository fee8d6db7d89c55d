"""Padded LoRA tensors: allocation, the logical shape each carries, and padding cleanup.

Why: kernels want aligned dimensions (rank to a multiple of 16, expert rows to what the
grouped GEMM wants), while PEFT files, optimizers' view of "the adapter" and every test speak
logical shapes. Each padded parameter records its logical shape as `lora_logical_shape`; the
padded region is everything outside the leading `logical` slice in every dimension, and it
must stay exactly zero (then it contributes nothing to outputs or gradients).
"""

from __future__ import annotations

import torch

LOGICAL_SHAPE_ATTR = "lora_logical_shape"
ZERO_MASK_ATTR = "lora_zero_mask"  # optional: [.., rows, cols] structural zeros (see adapter)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padded_parameter(
    logical: torch.Tensor, padded_shape: tuple[int, ...], *, requires_grad: bool = True
) -> torch.nn.Parameter:
    """A zero-padded copy of `logical` with shape `padded_shape`, tagged with its logical shape."""
    if len(padded_shape) != logical.dim() or any(
        p < s for p, s in zip(padded_shape, logical.shape, strict=True)
    ):
        raise ValueError(
            f"padded shape {tuple(padded_shape)} cannot hold logical shape {tuple(logical.shape)}"
        )
    data = torch.zeros(padded_shape, dtype=logical.dtype, device=logical.device)
    data[tuple(slice(0, s) for s in logical.shape)] = logical
    param = torch.nn.Parameter(data, requires_grad=requires_grad)
    setattr(param, LOGICAL_SHAPE_ATTR, tuple(logical.shape))
    return param


def logical_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The logical shape recorded on a LoRA tensor (its own shape if it carries none)."""
    return tuple(getattr(tensor, LOGICAL_SHAPE_ATTR, tensor.shape))


def logical_view(tensor: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The unpadded region of `tensor` (a view)."""
    shape = logical_shape(tensor) if shape is None else shape
    return tensor[tuple(slice(0, s) for s in shape)]


def zero_padding_(
    tensor: torch.Tensor, logical: tuple[int, ...], zero_mask: torch.Tensor | None = None
) -> None:
    """Zero every element of `tensor` outside its leading `logical` block, in place, and
    where `zero_mask` (broadcast over leading dimensions) is True."""
    with torch.no_grad():
        for dim, (size, keep) in enumerate(zip(tensor.shape, logical, strict=True)):
            if size > keep:
                tensor.narrow(dim, keep, size - keep).zero_()
        if zero_mask is not None:
            tensor.masked_fill_(zero_mask, 0)


def padding_is_zero(
    tensor: torch.Tensor, logical: tuple[int, ...], zero_mask: torch.Tensor | None = None
) -> bool:
    """True when every padded (or structurally zero) element of `tensor` is exactly 0."""
    mask = torch.ones(tensor.shape, dtype=torch.bool, device=tensor.device)
    mask[tuple(slice(0, s) for s in logical)] = False
    if zero_mask is not None:
        mask |= zero_mask
    return bool((tensor.detach()[mask] == 0).all())


def zero_mask_of(tensor: torch.Tensor) -> torch.Tensor | None:
    return getattr(tensor, ZERO_MASK_ATTR, None)


def padding_mask(
    shape: tuple[int, ...], logical: tuple[int, ...], zero_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Bool tensor of `shape`: True on every element that must stay zero."""
    mask = torch.ones(shape, dtype=torch.bool)
    mask[tuple(slice(0, s) for s in logical)] = False
    if zero_mask is not None:
        mask |= zero_mask.to("cpu")
    return mask


SHARD_MASK_CACHE_ATTR = "_lora_shard_masks"  # on a parameter: {key: (zero_mask, mask)}


def shard_padding_mask(
    param: torch.nn.Parameter, start: int, end: int, device: torch.device
) -> torch.Tensor | None:
    """Bool mask over `param.view(-1)[start:end]` (a distributed optimizer's shard), True where
    the padding (and structural zeros) must stay zero, on `device`; None when the shard holds
    none.

    Why cached: built on the host and copied to the device for every state tensor, the mask
    cost several host-to-device copies (each a stream sync) per parameter, twice per step. It
    is built once per (parameter, shard, device) and kept on the parameter; a new logical
    shape or a new `lora_zero_mask` object (a slot reloaded into the same parameters) builds
    it again."""
    logical, zero_mask = logical_shape(param), zero_mask_of(param)
    cache = getattr(param, SHARD_MASK_CACHE_ATTR, None)
    if cache is None:
        cache = {}
        setattr(param, SHARD_MASK_CACHE_ATTR, cache)
    key = (start, end, str(device), tuple(param.shape), logical)
    hit = cache.get(key)
    if hit is not None and hit[0] is zero_mask:
        return hit[1]
    flat = padding_mask(tuple(param.shape), logical, zero_mask).view(-1)[start:end]
    mask = flat.to(device) if bool(flat.any()) else None  # host-side any(): no device sync
    cache[key] = (zero_mask, mask)
    return mask


def zero_optimizer_padding_(
    optimizer, param: torch.nn.Parameter, zero_mask: torch.Tensor | None = None
) -> None:
    """Zero `param`'s padded region in everything `optimizer` keeps for it.

    A plain torch optimizer keeps per-parameter state tensors of the parameter's shape (Adam
    moments). Megatron's `DistributedOptimizer` (or a `ChainedOptimizer` of them) keeps, on
    each DP rank, a flat shard of the parameter's fp32 main copy, of its gradient and of
    every moment: those shards are masked with the matching slice of the flattened padding
    (`shard_padding_mask`, built once per parameter), in the optimizer's live storage also
    under `use_precision_aware_optimizer` (`compat.distopt_live_param_state`), whose
    state accessor hands back unscaled copies. For a distributed optimizer the structural
    zeros are read from `param` itself (`zero_mask` is for the torch-optimizer path).
    """
    logical = logical_shape(param)
    if type(optimizer).__module__.startswith("megatron."):
        from art_megatron_ext import compat

        for part in compat.chained_parts(optimizer):
            if not compat.is_distributed_optimizer(part):
                continue
            if not compat.distopt_owns(part, param):
                continue  # no shard of this parameter on this DP rank
            start, end = compat.distopt_param_shard(part, param)
            with torch.no_grad():
                for value in compat.distopt_live_param_state(part, param).values():
                    if not (torch.is_tensor(value) and value.numel() == end - start):
                        continue
                    mask = shard_padding_mask(param, start, end, value.device)
                    if mask is None:
                        break  # this shard holds no padding
                    value.masked_fill_(mask, 0)
                    if value.grad is not None and value.grad.shape == value.shape:
                        value.grad.masked_fill_(mask, 0)
        return
    state = getattr(optimizer, "state", {})
    for value in state.get(param, {}).values():
        if torch.is_tensor(value) and value.shape == param.shape:
            zero_padding_(value, logical, zero_mask)
