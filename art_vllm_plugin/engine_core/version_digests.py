"""One label, one set of weights: each version an engine committed stays bound to its digest.

Why: tokens are labelled `slot@N`. With data parallelism an update commits on every engine or
on none: when one engine fails to commit, the engines that did revert, the slot's version goes
back to N-1 and engine 0 admits N again. Tokens already labelled N on the engine that
committed first were computed by the weights of that first attempt; if the trainer then
re-exports N with other bytes, one label would name two sets of weights. So the first commit of
N on an engine binds N to its digest there, and the binding outlives a revert: an update of N
with the same digest (a retry) is accepted, one with another digest is refused, naming the
version and both digests.

Each engine checks its own bindings when an update is staged there, and an update is refused
if any engine refuses it, so a version that *any* engine ever committed is covered. Bindings of
versions below a slot's settled version are dropped (such versions are refused as stale
anyway); what is kept is at most the versions committed and reverted since the last update
that settled. Every engine also remembers the digest it checked at staging, per slot, for a
commit call that carries none (direct callers; the API server always sends it).

Plain Python, no vLLM: unit-tested directly, held by the slot registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class VersionDigests:
    #: slot -> version -> the digest its first commit on this engine carried
    bound: dict[str, dict[int, str]] = field(default_factory=dict)
    #: slot -> (token, digest) of the update staged last (for a commit that sends no digest)
    staged: dict[str, tuple[str, str]] = field(default_factory=dict)

    def refusal(self, slot: str, version: int, digest: str) -> str | None:
        """Why `digest` may not be committed as `version` of `slot`; None when it may."""
        first = self.bound.get(slot, {}).get(version)
        if first is None or first == digest:
            return None
        return (
            f"version {version} of slot {slot!r} was already committed with digest {first} "
            f"(tokens labelled {slot}@{version} came from those weights); this update's digest "
            f"is {digest}: a version names one set of weights, publish these as a new version"
        )

    def note_staged(self, slot: str, token: str, digest: str) -> None:
        self.staged[slot] = (token, digest)

    def staged_digest(self, slot: str, token: str) -> str | None:
        token_digest = self.staged.get(slot)
        return token_digest[1] if token_digest and token_digest[0] == token else None

    def bind(self, slot: str, version: int, digest: str) -> None:
        """`version` of `slot` was committed with `digest` (the first binding stays)."""
        self.bound.setdefault(slot, {}).setdefault(version, digest)

    def settle(self, slot: str, version: int) -> None:
        """`version` is final for `slot`: forget bindings below it."""
        versions = self.bound.get(slot)
        if versions:
            for v in [v for v in versions if v < version]:
                del versions[v]
