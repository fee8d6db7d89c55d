"""MoE routes on the training side: the binary route bundle (`bundle.py`), collation into the
batch tensor, multi-turn segment chains included (`collate.py`), router replay in Megatron-core
(`replay.py`) and inside its micro-batched pipeline schedules (`schedule.py`).

The bundle format is specified in `docs/formats.md`; `bundle.py` is its only implementation.

Names are resolved lazily (PEP 562): `bundle.py` needs only numpy, and the trainer-side client
(`art_vllm_plugin.client.routes`, no torch) imports it through this package.
"""

from importlib import import_module

_NAMES = {
    "bundle": (
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
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
