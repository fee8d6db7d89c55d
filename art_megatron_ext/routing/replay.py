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
applies `compat.expert_bias_padding_mask_fixed` to the given model's routers for the block.)

Scope: the targets cover the routers of this rank in construction order (`layers` picks which
route layers they are, e.g. a pipeline stage's slice). With sequence parallelism the caller
passes the whole sequence and the rank's shard is taken here, as Megatron shards the tokens.
`check_replay_config` refuses what cannot be exact, at configuration time: virtual pipeline
> 1 (`RouterReplay` holds one queue per router, and interleaved micro-batches of different
model chunks would pop each other's targets), context parallelism, routing that bypasses the
top-k (sinkhorn, quantile balancing, the fused kernel), token dropping, the overlapped
MoE schedule and CUDA graphs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from art_megatron_ext.compat import expert_bias_padding_mask_fixed, megatron_router_replay


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


def check_replay_config(config) -> None:
    """Refuse, at configuration time, every model setting under which replayed routes could not
    be reproduced exactly; the message names the setting and why.

    Accepted: any pipeline size (without virtual stages), tensor parallelism with or without
    sequence parallelism (the routes are sharded like the tokens), expert parallelism, and
    activation recompute (`full`, or `selective` with any modules: a recomputed router pops
    the same micro-batch's targets, see `schedule.py`).
    """
    check_replay_supported(getattr(config, "virtual_pipeline_model_parallel_size", None))
    if not getattr(config, "moe_enable_routing_replay", False):
        raise RouterReplayError(
            "the model was built without moe_enable_routing_replay=True; its routers have no "
            "RouterReplay to feed"
        )
    refusals = {
        "context_parallel_size": (
            lambda v: v is not None and v > 1,
            "context parallelism splits each sequence into load-balanced chunks chosen by the "
            "data loader; the routes would have to be split the same way, which is not "
            "implemented",
        ),
        "moe_router_load_balancing_type": (
            lambda v: v in ("sinkhorn", "quantile_balancing"),
            "this routing does not go through Megatron's top-k, so RouterReplay never sees it",
        ),
        "moe_router_fusion": (
            bool,
            "the fused top-k kernel bypasses RouterReplay",
        ),
        "moe_expert_capacity_factor": (
            lambda v: v is not None,
            "token dropping after top-k changes which experts a token reaches",
        ),
        "overlap_moe_expert_parallel_comm": (
            bool,
            "the overlapped schedule runs one micro-batch's forward inside another's backward, "
            "so the per-micro-batch target order of the routers is not the schedule's order",
        ),
        "cuda_graph_impl": (
            lambda v: v not in (None, "none"),
            "a captured graph replays the top-k it recorded, not the targets of each step",
        ),
    }
    for name, (refused, why) in refusals.items():
        value = getattr(config, name, None)
        if refused(value):
            raise RouterReplayError(f"router replay cannot be exact with {name}={value!r}: {why}")


def sequence_shard(config) -> tuple[int, int] | None:
    """`(rank, size)` of this rank's sequence shard when sequence parallelism splits the tokens
    the routers see (TP > 1 with `sequence_parallel`), else None."""
    if not getattr(config, "sequence_parallel", False):
        return None
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    if size <= 1:
        return None
    return parallel_state.get_tensor_model_parallel_rank(), size


def replay_targets(
    routes: torch.Tensor,
    *,
    num_experts: int,
    topk: int,
    layers: Sequence[int] | None = None,
    shard: tuple[int, int] | None = None,
) -> list[torch.Tensor]:
    """Per-layer `[seq * batch, topk]` int64 targets (sequence-major) from `[B, S, L, K]` routes.

    `shard=(rank, size)`: keep sequence positions `[rank * S/size, (rank + 1) * S/size)`, the
    tokens a sequence-parallel rank's routers see (Megatron scatters the sequence dimension in
    equal contiguous parts; see `sequence_shard`).

    Raises:
        RouterReplayError: wrong rank or topk, a layer index outside the routes, an expert
            id outside [0, num_experts), or a sequence the shard count does not divide.
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
    if shard is not None:
        rank, size = shard
        if not 0 <= rank < size or seq % size:
            raise RouterReplayError(
                f"sequence length {seq} cannot be split into {size} sequence-parallel shards "
                f"(shard {rank}); Megatron needs it divisible by the tensor-parallel size"
            )
        part = seq // size
        routes = routes[:, rank * part : (rank + 1) * part]
        seq = part
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
    routes: torch.Tensor,
    config,
    *,
    layers: Sequence[int] | None = None,
    model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
) -> Iterator[ReplayControl]:
    """Within the block, every MoE router of this rank uses the given routes (one batch; for a
    micro-batched pipeline schedule use `schedule.replaying_schedule`).

    Args:
        routes: collated `[batch, seq, layers, topk]` routes (`CollatedRoutes.routes`), the
            whole sequence: with sequence parallelism this rank's shard is taken here.
        config: the model's `TransformerConfig`; `check_replay_config` must accept it.
        layers: which route layers feed this rank's routers, in the order they were built;
            default all, which must match the number of routers.
        model: the module(s) holding this rank's routers; required with expert bias, whose
            routers get the padding-mask fix (`compat.expert_bias_padding_mask_fixed`) for the
            block only.

    Actions and targets are cleared on exit, also on error, so a later step routes normally.
    """
    check_replay_config(config)
    router_replay, action = megatron_router_replay()
    targets = replay_targets(
        routes,
        num_experts=config.num_moe_experts,
        topk=config.moe_router_topk,
        layers=layers,
        shard=sequence_shard(config),
    )
    instances = router_replay.global_router_replay_instances
    if len(targets) != len(instances):
        raise RouterReplayError(
            f"{len(targets)} route layers for {len(instances)} routers on this rank; pass "
            "`layers` to say which route layers this rank's routers take"
        )
    with _expert_bias_fix(config, model):
        router_replay.set_replay_data(targets)
        router_replay.set_global_router_replay_action(action.REPLAY_FORWARD)
        try:
            yield ReplayControl()
        finally:
            router_replay.clear_global_router_replay_action()
            router_replay.clear_global_indices()


def _expert_bias_fix(config, model) -> contextlib.AbstractContextManager:
    """The scoped padding-mask fix for `model`'s routers when expert bias is on."""
    if not getattr(config, "moe_router_enable_expert_bias", False):
        return contextlib.nullcontext()
    if model is None:
        raise RouterReplayError(
            "moe_router_enable_expert_bias is on: pass model= (the modules holding this rank's "
            "routers) so their padding-mask fix is applied for the block "
            "(compat.expert_bias_padding_mask_fixed)"
        )
    return expert_bias_padding_mask_fixed(list(model) if isinstance(model, Sequence) else model)
