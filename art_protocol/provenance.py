"""Policy provenance: how per-slot and base-weight versions ride on vLLM's per-step label.

vLLM's EngineCore stamps every step's outputs with one string, `_weight_version`, and the
output processor turns the stamps of a request's tokens into contiguous `WeightVersionSpan`s.
A slot update sets that string to an encoding of *all* slot versions, between two steps and
in the same utility call that writes the weights. Every token therefore carries, exactly,
the versions in force in the step that sampled it; the API server decodes the version of the
request's own slot and merges neighbouring spans of equal version into `policy_spans`.

The base weights have a version too (`base_version`: 0 as loaded, +1 per committed
full-weight update), carried in the same label, so each span says which base weights AND
which adapter version made its tokens; a span ends where either changes. A span carries
`base_version` only when it is not 0 (absent = the weights as loaded), so spans of a
LoRA-only run are exactly what they were before base versions existed.

Encoding: `art1|<lora_int_id>=<version>,...` (ids ascending), followed by `|b=<base>` when the
base version is not 0 (so LoRA-only labels are what they always were). Any other label
(vLLM's initial "default", or a label set through vLLM's own weight-version API) means
version 0 everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

PREFIX = "art1|"
_BASE = "|b="


def encode_versions(versions: Mapping[int, int], base_version: int = 0) -> str:
    label = PREFIX + ",".join(f"{lid}={ver}" for lid, ver in sorted(versions.items()))
    return f"{label}{_BASE}{base_version}" if base_version else label


@lru_cache(maxsize=256)
def decode_label(label: str | None) -> tuple[dict[int, int], int]:
    """(slot versions by LoRA id, base version) of an engine label."""
    if not label or not label.startswith(PREFIX):
        return {}, 0
    body, _, base = label[len(PREFIX) :].partition(_BASE)
    out: dict[int, int] = {}
    for item in filter(None, body.split(",")):
        lid, _, ver = item.partition("=")
        out[int(lid)] = int(ver)
    return out, int(base) if base else 0


def decode_versions(label: str | None) -> dict[int, int]:
    """The slot versions of a label (a copy: callers may extend it)."""
    return dict(decode_label(label)[0])


def base_version(label: str | None) -> int:
    return decode_label(label)[1]


def slot_version(label: str | None, lora_int_id: int | None) -> int:
    if lora_int_id is None:
        return 0
    return decode_label(label)[0].get(lora_int_id, 0)


def extend_spans(spans: list[dict[str, Any]], more: Iterable[dict[str, Any]]) -> None:
    """Append spans, merging each into its predecessor when contiguous and of equal slot and
    base versions (another slot's update changes the label but not this slot's version)."""
    for span in more:
        last = spans[-1] if spans else None
        if (
            last
            and last["end"] == span["start"]
            and last["version"] == span["version"]
            and last.get("base_version", 0) == span.get("base_version", 0)
        ):
            last["end"] = span["end"]
        else:
            spans.append(dict(span))


def slot_spans(
    weight_versions: Iterable[Any] | None,
    slot: str | None,
    lora_int_id: int | None,
    start: int = 0,
    end: int | None = None,
) -> list[dict[str, Any]]:
    """This slot's merged spans from vLLM `WeightVersionSpan(version, start, end)` objects,
    clipped to tokens `[start, end)` (`end=None`: no upper clip)."""
    spans: list[dict[str, Any]] = []
    for wv in weight_versions or ():
        lo = max(wv.start, start)
        hi = wv.end if end is None else min(wv.end, end)
        if lo < hi:
            span = {
                "start": lo,
                "end": hi,
                "slot": slot,
                "version": slot_version(wv.version, lora_int_id),
            }
            base = base_version(wv.version)
            if base:  # absent = 0, the loaded base weights (LoRA-only spans stay as they were)
                span["base_version"] = base
            extend_spans(spans, [span])
    return spans


def policy_spans(
    weight_versions: Iterable[Any] | None,
    num_tokens: int,
    slot: str | None,
    lora_int_id: int | None,
) -> list[dict[str, Any]]:
    """Half-open spans over a choice's completion tokens: contiguous, covering all of them.

    `weight_versions` are vLLM `WeightVersionSpan(version, start, end)` objects (or None when
    no label was reported, e.g. zero tokens).
    """
    spans = slot_spans(weight_versions, slot, lora_int_id)
    covered = spans[-1]["end"] if spans else 0
    if covered != num_tokens or (spans and spans[0]["start"] != 0):
        raise RuntimeError(
            f"policy spans {spans} do not cover the {num_tokens} completion tokens; "
            "refusing to report partial provenance"
        )
    return spans
