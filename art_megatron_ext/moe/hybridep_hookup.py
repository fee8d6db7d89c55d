"""Make Megatron-core's flex dispatcher (`moe_flex_dispatcher_backend="hybridep"`) use ours.

Why at run time: Megatron 0.19 looks for `deep_ep.HybridEPBuffer`; we must not install a
package named `deep_ep` (it would shadow a real DeepEP), and we do not edit Megatron's files.
`enable_hybridep()` sets the few module attributes Megatron reads (names listed in
`art_megatron_ext.compat`) so that its own `_HybridEPManager` and autograd Functions
(`HybridEPDispatch` / `HybridEPCombine`) drive a `hybridep.Buffer`. Everything it changed is
put back by `disable()` (or leaving the `with` block).

Megatron's `reset_hybrid_ep_buffer()` only drops its reference to the buffer; ours also closes
it (collective, like Megatron's reset, which every rank calls), so the CUDA backend's
registered memory and IPC mappings are freed rather than leaked. `enable_hybridep` and
`disable` reset through it.

    from art_megatron_ext.moe import enable_hybridep
    enable_hybridep()            # before the first MoE forward; then configure Megatron with
                                 # moe_token_dispatcher_type="flex",
                                 # moe_flex_dispatcher_backend="hybridep", moe_router_dtype="fp32"
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from art_megatron_ext import compat
from hybridep import Buffer, HybridEPConfig
from hybridep.backends import BACKEND_NAMES

_MISSING = object()
_LOCK = threading.Lock()
_ACTIVE: HybridEPPatch | None = None


@dataclass(frozen=True)
class HybridEPOptions:
    """How the buffer Megatron creates is built.

    Attributes:
        backend: "auto", "torch" or "cuda" (see `hybridep.Buffer`).
        config: launch tunables; Megatron's `moe_flex_dispatcher_num_sms` etc. overlay it.
        max_num_of_tokens_per_rank: floor of the buffer's token capacity. Megatron sizes
            the buffer from the first batch; a later, larger batch grows it collectively
            (a reallocation, logged) unless this floor already covers it.
    """

    backend: str = "auto"
    config: HybridEPConfig = field(default_factory=HybridEPConfig)
    max_num_of_tokens_per_rank: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_NAMES:
            raise ValueError(
                f"HybridEPOptions.backend must be one of {BACKEND_NAMES}, got {self.backend!r}"
            )
        floor = self.max_num_of_tokens_per_rank
        bad = isinstance(floor, bool) or not isinstance(floor, int) or floor < 1
        if floor is not None and bad:
            raise ValueError(
                f"HybridEPOptions.max_num_of_tokens_per_rank must be an int >= 1, got {floor!r}"
            )


def _buffer_class(options: HybridEPOptions) -> type[Buffer]:
    """A `Buffer` subclass with Megatron's constructor call shape and our options baked in."""

    class MegatronHybridEPBuffer(Buffer):
        def __init__(
            self,
            group: Any,
            hidden_dim: int,
            max_num_of_tokens_per_rank: int,
            num_local_experts: int,
            use_fp8: bool = False,
            **megatron_kwargs: Any,
        ) -> None:
            floor = options.max_num_of_tokens_per_rank or 0
            super().__init__(
                group,
                hidden_dim,
                max(max_num_of_tokens_per_rank, floor),
                num_local_experts,
                use_fp8,
                backend=options.backend,
                config=options.config,
                **megatron_kwargs,
            )

    MegatronHybridEPBuffer.options = options
    return MegatronHybridEPBuffer


def _hybrid_ep_dispatch(
    x,
    routing_map,
    probs,
    group,
    num_local_experts,
    num_sms_dispatch_api=None,
    num_sms_combine_api=None,
    num_blocks_permute=None,
    num_blocks_unpermute=None,
    fused=False,
    num_permuted_tokens=None,
    pad_multiple=None,
    num_sms_preprocessing_api=108,
):
    """Megatron's `hybrid_ep_dispatch` (defined only when DeepEP imports), same signature."""
    fused_a2a = compat.megatron_fused_a2a_module()
    return fused_a2a.HybridEPDispatch.apply(
        x,
        routing_map,
        probs,
        group,
        num_local_experts,
        num_sms_dispatch_api,
        num_sms_combine_api,
        num_blocks_permute,
        num_blocks_unpermute,
        fused,
        num_permuted_tokens,
        pad_multiple,
        num_sms_preprocessing_api,
    )


def _hybrid_ep_combine(x, handle, num_permuted_tokens, pad_multiple, fused=False):
    """Megatron's `hybrid_ep_combine`, same signature."""
    fused_a2a = compat.megatron_fused_a2a_module()
    return fused_a2a.HybridEPCombine.apply(x, handle, num_permuted_tokens, pad_multiple, fused)


def _closing_reset(original_reset: Any):
    """Megatron's `reset_hybrid_ep_buffer`, closing our buffer before it is dropped."""

    def reset_hybrid_ep_buffer() -> None:
        fused_a2a = compat.megatron_fused_a2a_module()
        buffer = getattr(fused_a2a, compat.HYBRIDEP_BUFFER_GLOBAL, None)
        if isinstance(buffer, Buffer):
            buffer.close()
        original_reset()

    reset_hybrid_ep_buffer.art_closes_buffer = True
    return reset_hybrid_ep_buffer


class HybridEPPatch:
    """The attributes `enable_hybridep` replaced, and how to put them back."""

    def __init__(self, options: HybridEPOptions) -> None:
        self.options = options
        self._saved: list[tuple[Any, str, Any]] = []

    def _set(self, module: Any, name: str, value: Any) -> None:
        self._saved.append((module, name, module.__dict__.get(name, _MISSING)))
        setattr(module, name, value)

    def _apply(self) -> None:
        fused_a2a = compat.megatron_fused_a2a_module()
        token_dispatcher = compat.megatron_token_dispatcher_module()
        values = {
            "HybridEPBuffer": _buffer_class(self.options),
            "HAVE_HYBRIDEP": True,
            "hybrid_ep_dispatch": _hybrid_ep_dispatch,
            "hybrid_ep_combine": _hybrid_ep_combine,
            "reset_hybrid_ep_buffer": _closing_reset(fused_a2a.reset_hybrid_ep_buffer),
        }
        for name in compat.HYBRIDEP_FUSED_A2A_ATTRS:
            self._set(fused_a2a, name, values[name])
        for name in compat.HYBRIDEP_TOKEN_DISPATCHER_ATTRS:
            self._set(token_dispatcher, name, values[name])
        fused_a2a.reset_hybrid_ep_buffer()  # a buffer built before must not be reused

    def disable(self) -> None:
        """Restore Megatron's attributes and drop the buffer Megatron cached."""
        global _ACTIVE
        with _LOCK:
            if self._saved:  # our closing reset is still installed: close, then restore
                compat.megatron_fused_a2a_module().reset_hybrid_ep_buffer()
            for module, name, old in reversed(self._saved):
                if old is _MISSING:
                    delattr(module, name)
                else:
                    setattr(module, name, old)
            self._saved.clear()
            compat.megatron_fused_a2a_module().reset_hybrid_ep_buffer()
            if _ACTIVE is self:
                _ACTIVE = None

    def __enter__(self) -> HybridEPPatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.disable()


def enable_hybridep(options: HybridEPOptions | None = None) -> HybridEPPatch:
    """Route Megatron's flex dispatcher backend "hybridep" to `hybridep.Buffer`.

    Idempotent: a second call replaces the options (and drops Megatron's cached buffer).
    Returns the patch; `disable()` or a `with` block restores Megatron's attributes.
    """
    global _ACTIVE
    options = options or HybridEPOptions()
    with _LOCK:
        if _ACTIVE is not None:
            previous, _ACTIVE = _ACTIVE, None
        else:
            previous = None
    if previous is not None:
        previous.disable()
    patch = HybridEPPatch(options)
    with _LOCK:
        patch._apply()
        _ACTIVE = patch
    return patch


def hybridep_enabled() -> bool:
    """True while `enable_hybridep` is in effect."""
    return _ACTIVE is not None
