"""MoE routes on the training side: the binary route bundle (`bundle.py`), collation into the
batch tensor, multi-turn segment chains included (`collate.py`), router replay in Megatron-core
(`replay.py`) and inside its micro-batched pipeline schedules (`schedule.py`).

The bundle format is specified in `docs/formats.md`; `bundle.py` is its only implementation.
"""

from art_megatron_ext.routing.bundle import (
    BUNDLE_MAGIC,
    BUNDLE_VERSION,
    RouteBundle,
    RouteBundleError,
    decode_route_bundle,
    encode_route_bundle,
    route_dtype_for,
)
from art_megatron_ext.routing.collate import (
    CollatedRoutes,
    RouteChain,
    RoutePlacement,
    RouteSegment,
    RouteValidationError,
    chain_routes,
    collate_padded_routes,
    collate_routes,
)
from art_megatron_ext.routing.replay import (
    ReplayControl,
    RouterReplayError,
    check_replay_config,
    check_replay_supported,
    replay_targets,
    replaying_routes,
    sequence_shard,
)
from art_megatron_ext.routing.schedule import ScheduleReplay, replaying_schedule

__all__ = [
    "BUNDLE_MAGIC",
    "BUNDLE_VERSION",
    "CollatedRoutes",
    "ReplayControl",
    "RouteBundle",
    "RouteBundleError",
    "RouteChain",
    "RoutePlacement",
    "RouteSegment",
    "RouteValidationError",
    "RouterReplayError",
    "ScheduleReplay",
    "chain_routes",
    "check_replay_config",
    "check_replay_supported",
    "collate_padded_routes",
    "collate_routes",
    "decode_route_bundle",
    "encode_route_bundle",
    "replay_targets",
    "replaying_routes",
    "replaying_schedule",
    "route_dtype_for",
    "sequence_shard",
]
