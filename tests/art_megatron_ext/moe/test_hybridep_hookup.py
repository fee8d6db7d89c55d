"""`enable_hybridep` patches Megatron's module attributes and puts them back (one process)."""

from __future__ import annotations

import pytest

from art_megatron_ext.moe import HybridEPOptions, enable_hybridep, hybridep_enabled
from hybridep import Buffer, HybridEPConfig


def _megatron_state():
    from megatron.core.transformer.moe import fused_a2a, token_dispatcher

    return (
        fused_a2a.__dict__.get("HybridEPBuffer"),
        fused_a2a.HAVE_HYBRIDEP,
        fused_a2a.hybrid_ep_dispatch,
        fused_a2a.hybrid_ep_combine,
        token_dispatcher.hybrid_ep_dispatch,
        token_dispatcher.hybrid_ep_combine,
    )


def test_enable_points_megatron_at_our_buffer_and_disable_restores():
    from megatron.core.transformer.moe import fused_a2a, token_dispatcher

    before = _megatron_state()
    assert before[1] is False, "this environment must not have DeepEP's HybridEP"
    with enable_hybridep(HybridEPOptions(backend="torch")):
        assert hybridep_enabled()
        assert issubclass(fused_a2a.HybridEPBuffer, Buffer)
        assert fused_a2a.HAVE_HYBRIDEP is True
        assert token_dispatcher.hybrid_ep_dispatch is fused_a2a.hybrid_ep_dispatch
        assert token_dispatcher.hybrid_ep_combine is fused_a2a.hybrid_ep_combine
        assert fused_a2a._hybrid_ep_buffer is None
    assert not hybridep_enabled()
    assert _megatron_state() == before


def test_enable_twice_replaces_the_options_and_restores_once():
    from megatron.core.transformer.moe import fused_a2a

    before = _megatron_state()
    enable_hybridep(HybridEPOptions(backend="torch"))
    patch = enable_hybridep(
        HybridEPOptions(backend="auto", config=HybridEPConfig(num_sms_dispatch=8))
    )
    assert fused_a2a.HybridEPBuffer.options.config.num_sms_dispatch == 8
    patch.disable()
    assert _megatron_state() == before


def test_buffer_keeps_megatrons_signature_for_its_feature_checks():
    import inspect

    params = inspect.signature(Buffer.dispatch_with_permute).parameters
    assert "fuse_permute_dispatch" in params
    for name in (
        "routing_map",
        "probs",
        "scaling_factor",
        "num_of_experts_per_rank",
        "pad_multiple",
        "num_permuted_tokens",
        "non_blocking",
        "handle",
    ):
        assert name in params, name
    assert "fuse_unpermute_combine" in inspect.signature(Buffer.combine_with_unpermute).parameters


@pytest.mark.parametrize(
    "kwargs, match",
    [({"backend": "gpu"}, "backend"), ({"max_num_of_tokens_per_rank": 0}, "max_num_of_tokens")],
)
def test_options_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HybridEPOptions(**kwargs)
