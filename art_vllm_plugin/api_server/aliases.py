"""Exact versioned aliases: model name `slot@N` means exactly version N of that slot.

If the slot is not at version N when the request arrives, it is refused (409) instead of being
served by other weights. If an update lands between admission and the end of generation, the
tokens' spans show it and the response is refused (409) as well: a client that asked for
`policy@7` never receives a token from another version.

The version an alias is checked against is EngineCore's (the slot registry every API server
shares): before an alias request is resolved, `install_refresh` has the API server re-read the
registry (one utility call), so an update that returned through another API server is seen.
Requests that name no alias pay nothing.
"""

from __future__ import annotations

import functools
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


def resolve(model: str | None, slots: dict) -> Alias | None:
    """The alias named by `model`, if it is one of a known slot; raises if not servable."""
    from art_vllm_plugin.api_server import leases  # exact leases: `slot@N` pinned

    leased = leases.resolve_alias(model)
    if leased is not None:
        return leased
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


_REFRESH_MARK = "__art_alias_refresh__"


def _wrap_refresh(original, registry_ref: list):
    @functools.wraps(original)
    async def create(self, request, raw_request=None):
        model = getattr(request, "model", None)
        if registry_ref and ALIAS.match(model or "") is not None:
            await registry_ref[0].refresh()
        return await original(self, request, raw_request)

    return create


_REGISTRY_REF: list = []


def install_refresh(registry) -> None:
    """Wrap the completion and chat handlers (outside the alias check of `response_spans`)
    so an alias request first reads the slot registry from EngineCore."""
    from art_vllm_plugin import compat

    _REGISTRY_REF[:] = [registry]
    for cls, name in (
        (compat.serving_completion_class(), "create_completion"),
        (compat.serving_chat_class(), "create_chat_completion"),
    ):
        if getattr(cls, _REFRESH_MARK, False):
            continue
        setattr(cls, name, _wrap_refresh(getattr(cls, name), _REGISTRY_REF))
        setattr(cls, _REFRESH_MARK, True)
