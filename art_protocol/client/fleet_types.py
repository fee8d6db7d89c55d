"""Typed configuration and results of `art_protocol.client.Fleet`.

Kept apart from the fleet's logic so a trainer can build a config or read a result without
reading the HTTP code; stdlib only.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RetryPolicy:
    """How one replica is retried within one publish.

    Connection errors, timeouts and 5xx are retried with exponential backoff
    (`backoff_initial_s`, times `backoff_multiplier` per retry, at most `backoff_max_s`) until
    `deadline_s` after the publish began, or `max_attempts` tries (None: only the deadline
    bounds it). One attempt waits at most `attempt_timeout_s` and never past the deadline.
    4xx answers are never retried: the replica understood and refused.
    """

    deadline_s: float = 120.0
    attempt_timeout_s: float = 60.0
    backoff_initial_s: float = 0.2
    backoff_multiplier: float = 2.0
    backoff_max_s: float = 5.0
    max_attempts: int | None = None

    def __post_init__(self) -> None:
        for name in ("deadline_s", "attempt_timeout_s", "backoff_initial_s", "backoff_max_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"RetryPolicy.{name} must be a positive number, got {value!r}")
        if self.backoff_multiplier < 1:
            raise ValueError(
                f"RetryPolicy.backoff_multiplier must be >= 1, got {self.backoff_multiplier!r}"
            )
        if self.max_attempts is not None and (
            not isinstance(self.max_attempts, int) or self.max_attempts < 1
        ):
            raise ValueError(
                f"RetryPolicy.max_attempts must be None or an int >= 1, got {self.max_attempts!r}"
            )

    def delays(self) -> Iterator[float]:
        """The sleeps between consecutive attempts: initial, initial*m, ... capped at max."""
        delay = self.backoff_initial_s
        while True:
            yield min(delay, self.backoff_max_s)
            delay *= self.backoff_multiplier


@dataclass(frozen=True)
class FleetConfig:
    """Everything a `Fleet` needs besides its URLs.

    `quarantined_attempts`: tries per publish for a replica already quarantined (default 1,
    no backoff), so a dead replica costs one refused connection per publish instead of the
    whole deadline, while a replica that came back is brought current by the next publish.
    `slots_timeout_s`: the timeout of one `GET /art/v1/slots` (in `slots()`, `reconcile()`
    and when an answer must be checked against the replica's state).
    """

    api_key: str | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    quarantined_attempts: int = 1
    slots_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.quarantined_attempts, int) or self.quarantined_attempts < 1:
            raise ValueError(
                "FleetConfig.quarantined_attempts must be an int >= 1, got "
                f"{self.quarantined_attempts!r}"
            )
        if self.slots_timeout_s <= 0:
            raise ValueError(
                f"FleetConfig.slots_timeout_s must be positive, got {self.slots_timeout_s!r}"
            )


class Outcome(enum.StrEnum):
    """What one replica did with one update."""

    APPLIED = "applied"  # 2xx: the replica now serves the version
    ALREADY_APPLIED = "already_applied"  # this operation (or this version) was there already
    REFUSED = "refused"  # a 4xx: not retried, the replica keeps its version
    FAILED = "failed"  # connection errors, timeouts or 5xx until the deadline/attempts ran out


@dataclass(frozen=True)
class ReplicaResult:
    """One replica's answer to one update (after all its retries)."""

    url: str
    slot: str
    version: int
    outcome: Outcome
    attempts: int
    elapsed_s: float
    status: int | None = None  # HTTP status of the last answer (None: no answer)
    response: Mapping | None = None  # the replica's JSON body on success
    error: str | None = None  # why it did not apply, naming the replica

    @property
    def ok(self) -> bool:
        """The replica serves `version` of `slot` now."""
        return self.outcome in (Outcome.APPLIED, Outcome.ALREADY_APPLIED)


@dataclass(frozen=True)
class PublishResult:
    """The per-replica results of one `Fleet.publish` (one `operation_id` for all)."""

    slot: str
    path: str
    version: int
    operation_id: str
    replicas: tuple[ReplicaResult, ...]

    @property
    def ok(self) -> bool:
        """Every replica serves the new version."""
        return all(r.ok for r in self.replicas)

    @property
    def applied(self) -> list[str]:
        return [r.url for r in self.replicas if r.ok]

    @property
    def failed(self) -> list[ReplicaResult]:
        return [r for r in self.replicas if not r.ok]

    def by_url(self) -> dict[str, ReplicaResult]:
        return {r.url: r for r in self.replicas}


@dataclass(frozen=True)
class SlotView:
    """One slot across the fleet: what each replica reports and what the fleet published.

    `versions[url]` is None when the replica did not answer or does not have the slot;
    `digests[url]` is None also when the replica reports no digest. `target` is the last
    version this fleet published (None if it never published the slot), `target_digest` the
    digest it published with it. A version names content only together with its digest: a
    replica at the target version that reports another digest, or none, is not on the target.
    """

    slot: str
    target: int | None
    versions: Mapping[str, int | None]
    digests: Mapping[str, str | None] = field(default_factory=dict)
    target_digest: str | None = None

    def _on_target(self, url: str) -> bool:
        if self.versions.get(url) != self.target:
            return False
        digest = self.digests.get(url)
        return self.target_digest is None or (digest is not None and digest == self.target_digest)

    @property
    def agreed(self) -> bool:
        """Every replica answered with the same version (and the target, with its digest, if
        there is one)."""
        seen = set(self.versions.values())
        if None in seen or len(seen) != 1:
            return False
        return self.target is None or all(self._on_target(url) for url in self.versions)

    @property
    def behind(self) -> list[str]:
        """Replicas not on the target (unreachable ones, another digest or none included)."""
        if self.target is None:
            return []
        return [url for url in self.versions if not self._on_target(url)]


@dataclass(frozen=True)
class ReconcileResult:
    """What `Fleet.reconcile` re-published, and which replicas are healthy afterwards."""

    updates: tuple[ReplicaResult, ...]
    healthy: tuple[str, ...]
    quarantined: Mapping[str, str]

    @property
    def ok(self) -> bool:
        return not self.quarantined
