"""What a trainer imports to talk to art servers: the HTTP client, the fleet, routed
completions, and the provenance checks (spans, policy age). httpx and numpy only."""

from __future__ import annotations

from art_protocol.client.fleet import Fleet
from art_protocol.client.fleet_types import (
    FleetConfig,
    Outcome,
    PublishResult,
    ReconcileResult,
    ReplicaResult,
    RetryPolicy,
    SlotView,
)
from art_protocol.client.http import ArtClient, ArtError
from art_protocol.client.routes import RoutedCompletion, decode_routed_completion
from art_protocol.policy_age import (
    FutureVersionError,
    batch_factor,
    freshness,
    policy_age,
    throughput_score,
)
from art_protocol.spans import SpanError, validate_spans
from art_protocol.updates import UpdateRequest, UpdateRequestError, UpdateResponse

__all__ = [
    "ArtClient",
    "ArtError",
    "Fleet",
    "FleetConfig",
    "FutureVersionError",
    "Outcome",
    "PublishResult",
    "ReconcileResult",
    "ReplicaResult",
    "RetryPolicy",
    "RoutedCompletion",
    "SlotView",
    "SpanError",
    "UpdateRequest",
    "UpdateRequestError",
    "UpdateResponse",
    "batch_factor",
    "decode_routed_completion",
    "freshness",
    "policy_age",
    "throughput_score",
    "validate_spans",
]
