"""MoE routes on the training side: the binary route bundle (`bundle.py`), collation into the
batch tensor (`collate.py`), and router replay in Megatron-core (`replay.py`).

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
    RoutePlacement,
    RouteValidationError,
    collate_padded_routes,
    collate_routes,
)
from art_megatron_ext.routing.replay import (
    ReplayControl,
    RouterReplayError,
    check_replay_supported,
    replay_targets,
    replaying_routes,
)

__all__ = [
    "BUNDLE_MAGIC",
    "BUNDLE_VERSION",
    "CollatedRoutes",
    "ReplayControl",
    "RouteBundle",
    "RouteBundleError",
    "RoutePlacement",
    "RouteValidationError",
    "RouterReplayError",
    "check_replay_supported",
    "collate_padded_routes",
    "collate_routes",
    "decode_route_bundle",
    "encode_route_bundle",
    "replay_targets",
    "replaying_routes",
    "route_dtype_for",
]
