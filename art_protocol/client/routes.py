"""Decode an `application/vnd.art.routes` response: the completion dict and, per choice, a
`[rows, moe_layers, topk]` numpy view of the received bytes (no copy).

Why its own module: trainers read thousands of these; the routes are most of the bytes, and
the format lets them arrive without a base64 pass or a JSON parse over them. The layout is
in `docs/formats.md` ("Routed completion"); `art_protocol.routed_completion` writes it and
`art_protocol.route_bundle` is the route bundle's one implementation. numpy and the
standard library only.

    routed = decode_routed_completion(resp.content)
    routed.completion["choices"][i]["route_spans"]  # versions, as policy_spans
    routed.routes[i]                                # rows of choice i (read-only view)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from art_protocol.routed_completion import MEDIA_TYPE, RoutedBodyError, split_body


@dataclass(frozen=True)
class RoutedCompletion:
    """A decoded body. `routes[i]` belongs to `completion["choices"][i]`; its row 0 is prompt
    position `completion["choices"][i]["routes"]["prompt_start"]`."""

    completion: dict[str, Any]
    routes: list[np.ndarray]
    num_experts: int

    def choice_routes(self, index: int) -> np.ndarray:
        """Routes of the choice whose `index` field is `index`."""
        for choice, routes in zip(self.completion["choices"], self.routes, strict=True):
            if choice["index"] == index:
                return routes
        raise KeyError(f"no choice with index {index}")


def decode_routed_completion(data: bytes | bytearray | memoryview) -> RoutedCompletion:
    """Split and check the body; the routes are views into `data`.

    Raises:
        RoutedBodyError: a malformed body, or a bundle whose trajectory count or row counts
            disagree with the choices.
        RouteBundleError: a malformed route bundle (from the bundle reader).
    """
    from art_protocol.route_bundle import decode_route_bundle

    split = split_body(data)
    bundle = decode_route_bundle(split.bundle)
    choices = split.completion.get("choices", [])
    if len(bundle.routes) != len(choices):
        raise RoutedBodyError(
            f"route bundle holds {len(bundle.routes)} trajectories for {len(choices)} choices"
        )
    for choice, routes in zip(choices, bundle.routes, strict=True):
        rows = (choice.get("routes") or {}).get("rows")
        if rows != routes.shape[0]:
            raise RoutedBodyError(
                f"choice {choice.get('index')}: JSON says {rows} route rows, bundle holds "
                f"{routes.shape[0]}"
            )
    return RoutedCompletion(
        completion=split.completion, routes=list(bundle.routes), num_experts=bundle.num_experts
    )


__all__ = ["MEDIA_TYPE", "RoutedBodyError", "RoutedCompletion", "decode_routed_completion"]
