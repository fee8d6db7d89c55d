"""Evaluate exactly version N while the slot moves on: an exact lease (`/art/v1/leases`).

Why: a checkpoint's evaluation must score version N's weights, not whatever the slot serves
when the request runs. After step N is published the loop pins it (`POST /art/v1/leases
{"slot", "version", "ttl_s"}` -> model name `slot@N`), evaluates greedily on `slot@N`, keeps
training and publishing N+1, N+2, ..., evaluates `slot@N` again at the end, and releases the
lease (`DELETE /art/v1/leases/{id}`). Exact means: both evaluations give the same tokens, every
span says version N, and the moved slot's greedy tokens differ (so the comparison can fail).
Light client only (httpx).
"""

from __future__ import annotations

import httpx

from art_protocol.client import validate_spans


class LeaseEvaluation:
    def __init__(self, url: str, slot: str, prompts: list[list[int]], max_tokens: int):
        self._http = httpx.Client(base_url=url, timeout=120)
        self.slot = slot
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.lease: dict | None = None
        self.first: list[dict] | None = None

    def _generate(self, model: str, latest: int) -> list[dict]:
        out = []
        for prompt in self.prompts:
            resp = self._http.post(
                "/v1/completions",
                json={
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": self.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            resp.raise_for_status()
            choice = resp.json()["choices"][0]
            spans = validate_spans(choice, len(choice["token_ids"]), latest_version=latest)
            out.append(
                {"tokens": choice["token_ids"], "versions": sorted({s["version"] for s in spans})}
            )
        return out

    def start(self, version: int) -> None:
        """Pin `version` (just published) and evaluate it once."""
        resp = self._http.post(
            "/art/v1/leases", json={"slot": self.slot, "version": version, "ttl_s": 900}
        )
        if resp.status_code != 200:
            raise RuntimeError(f"lease of {self.slot}@{version} refused: {resp.text}")
        self.lease = resp.json()
        self.first = self._generate(self.lease["model"], version)

    def finish(self, latest: int) -> dict:
        """Evaluate the lease again after the slot moved to `latest`; release it; report."""
        assert self.lease is not None and self.first is not None
        version = self.lease["version"]
        again = self._generate(self.lease["model"], version)
        moved = self._generate(self.slot, latest)
        resp = self._http.delete(f"/art/v1/leases/{self.lease['id']}")
        return {
            "model": self.lease["model"],
            "version": version,
            "slot_version_at_end": latest,
            "exact": [a["tokens"] for a in again] == [f["tokens"] for f in self.first],
            "span_versions": sorted({v for e in self.first + again for v in e["versions"]}),
            "differs_from_moved_slot": [m["tokens"] for m in moved] != [a["tokens"] for a in again],
            "released": resp.status_code == 200,
        }

    def close(self) -> None:
        self._http.close()
