"""The HTTP client for one server's `/art/*` routes (httpx; no vLLM, no torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from art_protocol.adapter_stream import adapter_stream_body
from art_protocol.push import AdapterBytes, multipart_files
from art_protocol.updates import ROUTE as UPDATE_ROUTE
from art_protocol.updates import UpdateRequest
from art_protocol.weight_transfer import INIT_ROUTE, TransferPlan
from art_protocol.weight_updates import BASE_SLOT, body_of, weights_update
from art_protocol.weight_updates import ROUTE as WEIGHTS_ROUTE


class ArtError(RuntimeError):
    """An `/art/*` call was refused; `status` is the HTTP status, the message the server's."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class ArtClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ArtClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _json(self, resp: httpx.Response) -> Any:
        if resp.status_code >= 400:
            try:
                message = resp.json()["error"]["message"]
            except Exception:
                message = resp.text
            raise ArtError(resp.status_code, message)
        return resp.json()

    def update(
        self,
        slot: str,
        path: str,
        version: int,
        *,
        operation_id: str | None = None,
        expected_version: int | None = None,
        digest: str | None = None,
    ) -> dict:
        """Publish a new adapter to a slot; returns the server's `UpdateResponse` as JSON
        ({slot, version, step, receipts, elapsed_ms, ...}). A bad argument raises
        `UpdateRequestError` before anything is sent."""
        request = UpdateRequest(slot, str(path), version, operation_id, expected_version, digest)
        return self._json(self._http.post(UPDATE_ROUTE, json=request.to_json()))

    def update_from_dir(
        self,
        slot: str,
        local_dir: str | Path | AdapterBytes,
        version: int,
        *,
        operation_id: str | None = None,
        expected_version: int | None = None,
        digest: str | None = None,
    ) -> dict:
        """Push the adapter in `local_dir` (a directory on *this* machine, read once, or its
        `AdapterBytes`) to a slot: its two files travel in the request (`art_protocol.push`),
        so the server needs no access to the directory. Answers, refusals and the optional
        fields are those of `update`; the server refuses an adapter over its
        `--art-max-adapter-bytes` (413) or one its staging directory has no room for (507).
        A bad argument or an unreadable file raises `ValueError` before anything is sent."""
        request = UpdateRequest(slot, None, version, operation_id, expected_version, digest)
        adapter = local_dir if isinstance(local_dir, AdapterBytes) else AdapterBytes.read(local_dir)
        return self._json(self._http.post(UPDATE_ROUTE, files=multipart_files(request, adapter)))

    def update_weights(
        self,
        path: str,
        version: int,
        *,
        operation_id: str | None = None,
        expected_version: int | None = None,
        digest: str | None = None,
    ) -> dict:
        """Publish new full (base) weights: `path` is a directory of safetensors in the served
        model's names, readable by the server (`art_megatron_ext.weights.write_hf_checkpoint`
        writes one); `version` the new base version. Answers and refusals as for `update`
        (`slot` in the response is `BASE_SLOT`); `digest` is `art_protocol.weights_digest`'s."""
        request = weights_update(str(path), version, operation_id, expected_version, digest)
        return self._json(self._http.post(WEIGHTS_ROUTE, json=body_of(request)))

    def init_weight_transfer(self, init_info: dict, *, timeout: float | None = None) -> dict:
        """Have every worker of every engine join the trainer's weight-transfer group
        (`init_info` is the server's engine's: for `art_gloo`, `master_address`,
        `master_port`, `world_size`); answers once they all joined, so call it while the
        trainer joins too (`art_megatron_ext.weights.GlooWeightSender` does both)."""
        resp = self._http.post(INIT_ROUTE, json={"init_info": init_info}, timeout=timeout)
        return self._json(resp)

    def update_weights_stream(
        self,
        plan: TransferPlan,
        version: int,
        *,
        operation_id: str | None = None,
        expected_version: int | None = None,
        digest: str | None = None,
        timeout: float | None = None,
    ) -> dict:
        """Publish new full weights that the trainer streams over the transfer group (`plan`:
        what the stream carries, `art_protocol.weight_transfer`). Blocks until the update
        committed or was refused, so the stream is sent meanwhile, from another thread
        (`GlooWeightSender.send` does this). Answers as `update_weights`."""
        request = UpdateRequest(BASE_SLOT, None, version, operation_id, expected_version, digest)
        body = {**body_of(request), "transfer": plan.to_json()}
        return self._json(self._http.post(WEIGHTS_ROUTE, json=body, timeout=timeout))

    def update_lora_stream(
        self,
        plan: TransferPlan,
        slot: str,
        version: int,
        adapter_config: dict,
        *,
        operation_id: str | None = None,
        expected_version: int | None = None,
        digest: str | None = None,
        timeout: float | None = None,
    ) -> dict:
        """Publish an adapter to a slot whose tensors the trainer streams over the transfer
        group (`plan`; `adapter_config`: its adapter_config.json as a dict;
        `art_protocol.adapter_stream`). Blocks until the update committed or was refused, so
        the stream is sent meanwhile, from another thread (`StreamSender.send_adapter` does
        this). Answers as `update`."""
        request = UpdateRequest(slot, None, version, operation_id, expected_version, digest)
        body = adapter_stream_body(request, plan, adapter_config)
        return self._json(self._http.post(UPDATE_ROUTE, json=body, timeout=timeout))

    def weights(self) -> dict:
        """The base weights the server serves: {version, digest, updates, blocked, ...}."""
        return self._json(self._http.get("/art/v1/weights"))

    def slots(self) -> list[dict]:
        return self._json(self._http.get("/art/v1/slots"))

    def capabilities(self) -> dict:
        return self._json(self._http.get("/art/v1/capabilities"))

    def latest_versions(self) -> dict[str, int]:
        """{slot: version published now}: the `latest_version` for `validate_spans`."""
        return {s["slot"]: s["version"] for s in self.slots()}
