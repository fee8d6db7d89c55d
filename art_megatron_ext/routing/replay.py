"""Router replay: make Megatron's MoE routers use the experts recorded at rollout time.

Why: the policy that sampled a trajectory routed each token to particular experts; a trainer
that re-routes with its own (slightly different) router computes logprobs of a different
mixture, which biases importance ratios in RL. Megatron-core's `RouterReplay` can feed fixed
top-k indices to every router; this module feeds it the collated batch routes
(`collate.py`), in the token order Megatron's routers see, and clears it afterwards.

Layout: routes are `[batch, seq, layers, topk]`; a Megatron MoE layer routes hidden states
`[seq, batch, hidden]` flattened sequence-major, so layer l's target is
`routes[:, :, l].transpose(0, 1).reshape(seq * batch, topk)` as int64 (what `gather` needs).
Padding rows hold the dummy route `0..topk-1`; pass the collation's `padding_mask`
(`[batch, seq]`, True = padding) to the model's forward as Megatron's `padding_mask` so those
rows stay out of aux-loss and expert-bias accounting. (Megatron's docstrings say True marks
valid tokens; its code, `routing_map & ~padding_mask`, treats True as padding, and so do we.
megatron-core 0.19.2 cannot combine expert bias with a padding mask at all; `replaying_routes`
installs the fix from `compat.fix_expert_bias_padding_mask`.)

Scope: the targets cover the routers of this rank in construction order (`layers` picks which
route layers they are, e.g. a pipeline stage's slice). With sequence or context parallelism the
caller passes the rank's local token shard. Virtual pipeline parallelism > 1 is refused:
`RouterReplay` holds one global queue per router, and interleaved micro-batches of different
model chunks would pop each other's targets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from art_megatron_ext.compat import fix_expert_bias_padding_mask, megatron_router_replay


class RouterReplayError(RuntimeError):
    """Replay cannot be set up as asked; the message says which input is wrong."""


def check_replay_supported(virtual_pipeline_model_parallel_size: int | None) -> None:
    """Refuse replay under interleaved (virtual) pipeline parallelism; 1 and None are fine."""
    if (
        virtual_pipeline_model_parallel_size is not None
        and virtual_pipeline_model_parallel_size > 1
    ):
        raise RouterReplayError(
            f"router replay is not supported with virtual_pipeline_model_parallel_size="
            f"{virtual_pipeline_model_parallel_size}: Megatron's RouterReplay keeps one target "
            "queue per router, and interleaved model chunks desynchronize them. Use no virtual "
            "pipeline (None or 1) or disable replay."
        )


def replay_targets(
    routes: torch.Tensor, *, num_experts: int, topk: int, layers: Sequence[int] | None = None
) -> list[torch.Tensor]:
    """Per-layer `[seq * batch, topk]` int64 targets (sequence-major) from `[B, S, L, K]` routes.

    Raises:
        RouterReplayError: wrong rank or topk, a layer index outside the routes, or an expert
            id outside [0, num_experts).
    """
    if routes.dim() != 4:
        raise RouterReplayError(
            f"routes must be [batch, seq, layers, topk], got {tuple(routes.shape)}"
        )
    batch, seq, num_layers, route_topk = routes.shape
    if route_topk != topk:
        raise RouterReplayError(f"routes carry top-{route_topk}, the routers use top-{topk}")
    layers = list(range(num_layers)) if layers is None else list(layers)
    bad = [layer for layer in layers if not 0 <= layer < num_layers]
    if bad:
        raise RouterReplayError(f"route layers {bad} outside the {num_layers} layers of routes")
    if routes.numel():
        low, high = int(routes.min()), int(routes.max())
        if low < 0 or high >= num_experts:
            raise RouterReplayError(
                f"expert id {low if low < 0 else high} outside [0, {num_experts}) in routes"
            )
    sequence_major = routes.transpose(0, 1)  # [S, B, L, K], a view
    return [
        sequence_major[:, :, layer].reshape(seq * batch, topk).to(torch.int64) for layer in layers
    ]


@dataclass
class ReplayControl:
    """Handle yielded by `replaying_routes`."""

    def for_recompute(self) -> None:
        """Switch to REPLAY_BACKWARD before activation recomputation re-runs the routers, so
        they pop the same targets in the same order as the forward used them."""
        router_replay, action = megatron_router_replay()
        router_replay.set_global_router_replay_action(action.REPLAY_BACKWARD)


@contextlib.contextmanager
def replaying_routes(
    routes: torch.Tensor, config, *, layers: Sequence[int] | None = None
) -> Iterator[ReplayControl]:
    """Within the block, every MoE router of this rank uses the given routes.

    Args:
        routes: collated `[batch, seq, layers, topk]` routes (`CollatedRoutes.routes`).
        config: the model's `TransformerConfig`; it must have `moe_enable_routing_replay=True`
            (so routers were built with a `RouterReplay`), and its virtual pipeline size must
            be None or 1.
        layers: which route layers feed this rank's routers, in the order they were built;
            default all, which must match the number of routers.

    Actions and targets are cleared on exit, also on error, so a later step routes normally.
    """
    check_replay_supported(getattr(config, "virtual_pipeline_model_parallel_size", None))
    if not getattr(config, "moe_enable_routing_replay", False):
        raise RouterReplayError(
            "the model was built without moe_enable_routing_replay=True; its routers have no "
            "RouterReplay to feed"
        )
    router_replay, action = megatron_router_replay()
    targets = replay_targets(
        routes, num_experts=config.num_moe_experts, topk=config.moe_router_topk, layers=layers
    )
    instances = router_replay.global_router_replay_instances
    if len(targets) != len(instances):
        raise RouterReplayError(
            f"{len(targets)} route layers for {len(instances)} routers on this rank; pass "
            "`layers` to say which route layers this rank's routers take"
        )
    if getattr(config, "moe_router_enable_expert_bias", False):
        fix_expert_bias_padding_mask()  # else a padding_mask crashes the router (compat.py)
    router_replay.set_replay_data(targets)
    router_replay.set_global_router_replay_action(action.REPLAY_FORWARD)
    try:
        yield ReplayControl()
    finally:
        router_replay.clear_global_router_replay_action()
        router_replay.clear_global_indices()
