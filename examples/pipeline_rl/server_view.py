"""What the server says at the end of a run: the slot, one completion's spans, `/art/metrics`.

The loop's numbers come from spans and metrics the trainer read while it ran; this prints the
raw pieces once, so a reader sees what the plugin adds to a stock vLLM server.
"""

from __future__ import annotations

import httpx

METRIC_FIELDS = (
    "schema_version",
    "engine_step",
    "num_running",
    "num_waiting",
    "kv_cache_usage",
    "generation_tokens_per_s",
    "updates_total",
)


def show(
    url: str, slot: str, prompt: str = "3 + 4 =", max_tokens: int = 8, full: bool = False
) -> dict:
    """Print the slot's version and digest (with `full`, the base weights': `slot` is then the
    served model's name), a completion's `policy_spans` and the metrics."""
    with httpx.Client(base_url=url, timeout=60) as http:
        if full:
            base = http.get("/art/v1/weights").raise_for_status().json()
            slots = {slot: {**base, "slot": slot, "alias": None}}
        else:
            slots = {s["slot"]: s for s in http.get("/art/v1/slots").raise_for_status().json()}
        choice = (
            http.post(
                "/v1/completions",
                json={"model": slot, "prompt": prompt, "max_tokens": max_tokens, "seed": 0},
            )
            .raise_for_status()
            .json()["choices"][0]
        )
        metrics = http.get("/art/metrics").raise_for_status().json()
    current = slots[slot]
    view = {
        "slot": {k: current.get(k) for k in ("slot", "version", "alias", "digest")},
        "policy_spans": choice["policy_spans"],
        "metrics": {k: metrics.get(k) for k in (*METRIC_FIELDS, "base_version")},
        "metrics_slot": metrics.get("slots", {}).get(slot),
    }
    print(
        "\n== What the server says\n"
        f"GET /art/v1/slots: {slot} at version {current['version']} ({current.get('alias')}), "
        f"digest {current.get('digest')}\n"
        f"POST /v1/completions model={slot}: text {choice['text']!r}, "
        f"policy_spans {choice['policy_spans']}\n"
        f"GET /art/metrics: {view['metrics']}\n"
        f"  slots[{slot!r}]: {view['metrics_slot']}",
        flush=True,
    )
    return view
