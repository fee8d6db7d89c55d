"""MoE routes on the training side: collation of route bundles into the batch tensor,
multi-turn segment chains included (`collate.py`), router replay in Megatron-core
(`replay.py`) and inside its micro-batched pipeline schedules (`schedule.py`).

The bundle codec itself lives in the light shared package (`art_protocol.route_bundle`, the
only implementation of the format in `docs/formats.md`); its names are re-exported here.
Names are resolved lazily (PEP 562), so the bundle names import no torch.
"""

from importlib import import_module

_NAMES = {
    "art_protocol.route_bundle": (
        "BUNDLE_MAGIC",
        "BUNDLE_VERSION",
        "RouteBundle",
        "RouteBundleError",
        "decode_route_bundle",
        "encode_route_bundle",
        "route_dtype_for",
    ),
    "collate": (
        "CollatedRoutes",
        "RouteChain",
        "RoutePlacement",
        "RouteSegment",
        "RouteValidationError",
        "chain_routes",
        "collate_padded_routes",
        "collate_routes",
    ),
    "replay": (
        "ReplayControl",
        "RouterReplayError",
        "check_replay_config",
        "check_replay_supported",
        "replay_targets",
        "replaying_routes",
        "sequence_shard",
    ),
    "schedule": ("ScheduleReplay", "replaying_schedule"),
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    path = module if "." in module else f"{__name__}.{module}"
    value = getattr(import_module(path), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
