"""Drive a Megatron `MoELayer` with fixed expert choices (router replay) and compare runs:
the HybridEP oracle (CPU, gloo) and its GPU twin route the same tokens through two
dispatchers and compare output, input gradient and every weight gradient."""

from __future__ import annotations

import torch


def alltoall_and_flex_layers(**config):
    """(MoELayer on Megatron's alltoall dispatcher, MoELayer on its flex dispatcher with the
    hybridep backend) with the same weights, from `moe_test_config(**config)`; parallel state
    and `enable_hybridep` must be set up by the caller. Seeds torch (1234) first."""
    from support.megatron_cpu import build_moe_layer, moe_test_config

    torch.manual_seed(1234)
    ref = build_moe_layer(moe_test_config(moe_token_dispatcher_type="alltoall", **config))
    flex = build_moe_layer(
        moe_test_config(
            moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep", **config
        )
    )
    flex.load_state_dict(ref.state_dict())
    return ref, flex


def topk_indices(
    allowed: list[int], tokens: int, topk: int, generator: torch.Generator
) -> torch.Tensor:
    """[tokens, topk] distinct experts per token, drawn from `allowed`."""
    allowed_t = torch.tensor(allowed)
    rows = [
        allowed_t[torch.randperm(len(allowed), generator=generator)[:topk]] for _ in range(tokens)
    ]
    return torch.stack(rows)


def run_with_replay(layer, x, topk_idx, grad_out):
    """(output, input grad, {name: weight grad}) of one forward + backward with the router
    replaying `topk_idx`; the layer's grads are cleared afterwards."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replay = layer.router.router_replay
    replay.clear_indices()
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    replay.set_target_indices(topk_idx)
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(grad_out)
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def rel_diff(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Largest difference, relative to the reference's largest magnitude (0.0 when equal)."""
    diff = float((ref.float() - got.float()).abs().max())
    return diff / max(float(ref.float().abs().max()), 1e-30) if diff else 0.0
