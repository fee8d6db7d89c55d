"""Router replay inside Megatron's micro-batched pipeline schedules (1F1B, forward-only).

Why: `replaying_routes` feeds one batch to the routers, but a training step runs the schedule
from `megatron.core.pipeline_parallel.get_forward_backward_func()`: many micro-batches per
step, each stage running forwards of later micro-batches before the backwards of earlier ones,
and, with activation recompute, each router runs a second time inside the backward. Megatron's
`RouterReplay` has what this needs but does not drive it: a router in `REPLAY_FORWARD` reads
its current target, one in `REPLAY_BACKWARD` pops the oldest target it was given
(`set_target_indices` appends every target to that FIFO).

So `ScheduleReplay.wrap(forward_step_func)` does, for the i-th forward step on this rank:
give every router micro-batch i's targets and switch to `REPLAY_FORWARD`; run the step (the
model's forward runs inside it); switch to `REPLAY_BACKWARD`. Every forward of a micro-batch
reads its own targets. A recomputed router (full recompute, or selective `moe`) runs during
that micro-batch's backward and pops the oldest unpopped targets, which are that micro-batch's
because both schedules here run backwards in forward order on every stage (1F1B is FIFO
per stage). Routers that are not recomputed never pop; their queues are dropped on exit.
Without recompute, the backward differentiates the forward's graph, which used the targets.

Refused at configuration time (`check_replay_config`): virtual pipeline stages (interleaved
1F1B runs model chunks' backwards out of forward order per router queue), the overlapped MoE
schedule, context parallelism and the routing settings no replay can make exact.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from art_megatron_ext.compat import megatron_router_replay
from art_megatron_ext.routing.replay import (
    RouterReplayError,
    _expert_bias_fix,
    check_replay_config,
    replay_targets,
    sequence_shard,
)


class ScheduleReplay:
    """Yielded by `replaying_schedule`: wraps the forward step function of the schedule."""

    def __init__(self, targets: list[list[torch.Tensor]]) -> None:
        self._targets = targets
        self._next = 0

    @property
    def forward_steps(self) -> int:
        """Forward steps run so far (micro-batches whose targets were handed out)."""
        return self._next

    def wrap(self, forward_step_func: Callable[..., Any]) -> Callable[..., Any]:
        """`forward_step_func` with micro-batch i's routes installed around its i-th call."""
        router_replay, action = megatron_router_replay()

        @functools.wraps(forward_step_func)  # the schedule inspects the signature
        def forward_step(*args: Any, **kwargs: Any) -> Any:
            if self._next >= len(self._targets):
                raise RouterReplayError(
                    f"the schedule runs forward step {self._next + 1}, but routes were given "
                    f"for {len(self._targets)} micro-batches"
                )
            for instance, target in zip(
                router_replay.global_router_replay_instances, self._targets[self._next], strict=True
            ):
                instance.set_target_indices(target)  # current target + backward FIFO
            self._next += 1
            router_replay.set_global_router_replay_action(action.REPLAY_FORWARD)
            try:
                return forward_step_func(*args, **kwargs)
            finally:
                router_replay.set_global_router_replay_action(action.REPLAY_BACKWARD)

        return forward_step


@contextlib.contextmanager
def replaying_schedule(
    microbatch_routes: Sequence[torch.Tensor],
    config,
    *,
    layers: Sequence[int] | None = None,
    model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
) -> Iterator[ScheduleReplay]:
    """Replay `microbatch_routes[i]` for micro-batch i of the schedule run inside the block.

    Args:
        microbatch_routes: per micro-batch, collated `[micro_batch, seq, layers, topk]` routes
            (the whole sequence; a sequence-parallel rank's shard is taken here), in the order
            the data iterator yields the micro-batches.
        config: the model's `TransformerConfig`, checked by `check_replay_config`.
        layers: the route layers of this rank's routers, in construction order (a pipeline
            stage's MoE layers); default all.
        model: this rank's model chunk(s); required with expert bias (see `replaying_routes`).

    Every micro-batch's targets are built and checked before the schedule starts. On a normal
    exit the schedule must have run exactly one forward step per micro-batch. Actions and
    targets are cleared on exit, also on error.
    """
    check_replay_config(config)
    router_replay, _ = megatron_router_replay()
    shard = sequence_shard(config)
    targets = [
        replay_targets(
            routes,
            num_experts=config.num_moe_experts,
            topk=config.moe_router_topk,
            layers=layers,
            shard=shard,
        )
        for routes in microbatch_routes
    ]
    routers = len(router_replay.global_router_replay_instances)
    for index, per_layer in enumerate(targets):
        if len(per_layer) != routers:
            raise RouterReplayError(
                f"micro-batch {index}: {len(per_layer)} route layers for {routers} routers on "
                "this rank; pass `layers` to say which route layers this rank's routers take"
            )
    replay = ScheduleReplay(targets)
    with _expert_bias_fix(config, model):
        try:
            yield replay
            if replay.forward_steps != len(targets):
                raise RouterReplayError(
                    f"the schedule ran {replay.forward_steps} forward steps for "
                    f"{len(targets)} micro-batches of routes"
                )
        finally:
            router_replay.clear_global_router_replay_action()
            router_replay.clear_global_indices()
