"""Exact versioned aliases: model name `slot@N` means exactly version N of that slot.

If the slot is not at version N when the request arrives, it is refused (409) instead of being
served by other weights. If an update lands between admission and the end of generation, the
tokens' spans show it and the response is refused (409) as well: a client that asked for
`policy@7` never receives a token from another version.

The version an alias is checked against is EngineCore's (the slot registry every API server
shares): before an alias request is resolved, the API server re-reads the registry (one
utility call), so an update that returned through another API server is seen. Requests that
name no alias pay nothing. The hooks that do this around vLLM's handlers are in
`api_server/alias_requests.py`; exact leases (`slot@N` pinned) resolve before slot aliases
(`ApiServerState.resolve_alias`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ALIAS = re.compile(r"^(?P<slot>.+)@(?P<version>\d+)$")


class AliasRefused(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Alias:
    slot: str
    version: int

    @property
    def name(self) -> str:
        return f"{self.slot}@{self.version}"


def is_alias(model: str | None) -> bool:
    """Whether `model` has the form `slot@N` (of any slot)."""
    return ALIAS.match(model or "") is not None


def resolve(model: str | None, slots: dict) -> Alias | None:
    """The alias named by `model`, if it is one of a known slot; raises if not servable."""
    match = ALIAS.match(model or "")
    if match is None or match["slot"] not in slots:
        return None
    alias = Alias(match["slot"], int(match["version"]))
    current = slots[alias.slot].version
    if current > alias.version:
        raise AliasRefused(f"{alias.name} is no longer served; current is {alias.slot}@{current}")
    if current < alias.version:
        raise AliasRefused(f"{alias.name} is not published yet; current is {alias.slot}@{current}")
    return alias


def check_choices(alias: Alias, choices) -> None:
    """Refuse a response any of whose tokens came from another version."""
    for choice in choices:
        for span in getattr(choice, "policy_spans", None) or []:
            if span["version"] != alias.version:
                raise AliasRefused(
                    f"{alias.name} was replaced by {alias.slot}@{span['version']} during "
                    f"generation (tokens {span['start']}..{span['end']}); response withheld"
                )
