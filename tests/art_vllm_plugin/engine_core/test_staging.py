"""Read and validate once, stage on every worker, commit all or nothing.

The server (the shared `tp2` server of tests/support/server_kinds.py) runs two
tensor-parallel workers (`-tp 2`, one core each), so "all workers" means more than one. A
commit failure is injected with the test-only fault hook (`ART_TEST_HOOKS=1` enables
`POST /art/v1/test/fault`): the named worker fails after writing its new weights.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from support.adapters import copy_adapter, edit_config
from support.greedy import PROMPT, greedy_tokens
from support.streamed_ride import ride_a_stream

from art_protocol.client import ArtClient, ArtError, validate_spans
from art_vllm_plugin import staging
from art_vllm_plugin.adapters import (
    WEIGHTS_FILE,
    AdapterError,
    read_and_validate,
    read_signature,
    validate_adapter,
)

#: Room for the ridden generation (the test ends it once the update settled:
#: tests/support/streamed_ride.py); prompt and tokens fit the server's 512-token context.
RIDE_ROOM = 460


def test_update_tensor_dtype_must_match_the_slots_tensor(tiny_adapters, tmp_path):
    reference = read_signature(tiny_adapters / "a")
    dst = copy_adapter(tiny_adapters / "b", tmp_path / "bf16")
    tensors = load_file(dst / WEIGHTS_FILE)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].to(torch.bfloat16)  # an allowed dtype, not the slot's
    save_file(tensors, dst / WEIGHTS_FILE, metadata={"format": "pt"})
    want = reference.dtypes[name]
    with pytest.raises(
        AdapterError, match=f"{name} has dtype BF16, but slot 'policy'.s tensor is {want}"
    ):
        validate_adapter(dst, "policy", reference, max_rank=8)


def test_the_bytes_validated_are_the_bytes_staged(tiny_adapters, tmp_path):
    src = copy_adapter(tiny_adapters / "b", tmp_path / "src")
    files = read_and_validate(src, "policy", read_signature(tiny_adapters / "a"), 8)
    (src / WEIGHTS_FILE).write_bytes(b"rewritten by the trainer")  # after the read
    stage_dir = staging.new_stage_dir(staging.StagingConfig(tmp_path), "policy", 1)
    staging.write_files(stage_dir, files.as_files())
    assert (stage_dir / WEIGHTS_FILE).read_bytes() == (
        tiny_adapters / "b" / WEIGHTS_FILE
    ).read_bytes()
    staging.mark(stage_dir, 0, True)
    staging.mark(stage_dir, 1, False, "adapter\nValueError: bad")
    assert staging.poll(stage_dir, [0, 1]) == ([0], {1: "adapter\nValueError: bad"})
    staging.remove(stage_dir)
    assert not stage_dir.exists()


@pytest.fixture(scope="module")
def server(tp2_server):
    """`-tp 2`, slots policy (a) and ref_b (b), the test-only fault hook."""
    return tp2_server


@pytest.fixture(scope="module")
def scratch(server):
    """This module's adapters, inside the server's allowed adapter roots."""
    return server.scratch


@pytest.fixture(scope="module")
def art(server):
    with ArtClient(server.url, timeout=300) as client:
        yield client


def _version(art) -> int:
    return {s["slot"]: s["version"] for s in art.slots()}["policy"]


@pytest.mark.parametrize("rank", [1, 0])
def test_a_commit_failing_on_one_worker_restores_every_worker_and_is_500(
    server, art, tiny_adapters, rank
):
    before_version, before = _version(art), greedy_tokens(server.url)
    assert before != greedy_tokens(server.url, "ref_b")
    armed = httpx.post(
        server.url + "/art/v1/test/fault", json={"kind": "commit", "rank": rank}, timeout=60
    )
    assert armed.status_code == 200, armed.text
    with pytest.raises(ArtError) as err:
        art.update("policy", tiny_adapters / "b", before_version + 1)
    assert err.value.status == 500, err.value  # the engine failed, not the adapter (422)
    assert f"injected commit failure on rank {rank}" in err.value.message
    assert "every worker restored its previous weights" in err.value.message
    assert f"keeps serving version {before_version}" in err.value.message
    assert _version(art) == before_version
    assert greedy_tokens(server.url) == before, "a worker kept the new weights"
    engine = httpx.get(server.url + "/art/v1/engine", timeout=60).json()
    assert engine["failed_commits"] >= 1
    # The engine is fine: the same update then commits on both workers.
    assert art.update("policy", tiny_adapters / "b", before_version + 1)["version"] == (
        before_version + 1
    )
    assert greedy_tokens(server.url) == greedy_tokens(server.url, "ref_b")
    art.update("policy", tiny_adapters / "a", before_version + 2)
    assert greedy_tokens(server.url) == before


def test_a_commit_riding_a_step_that_fails_on_one_rank_never_reaches_a_forward(
    server, art, tiny_adapters
):
    """The update arrives while the engine steps, so its commit rides a batch
    (engine_core/step_rides.py); worker rank 1 fails it. Both ranks agree before the forward
    and rank 0 puts its weights back there: the running generation never computes a token on
    new or rank-mixed weights (every token is the old weights', labelled so), the answer is
    500 with everything restored, and the engine's stamps needed no correction by the workers'
    labels beyond the failed commit's own batches."""
    before_version = _version(art)
    body = {
        "model": "policy",
        "prompt": PROMPT,
        "max_tokens": RIDE_ROOM,
        "temperature": 0,
        "ignore_eos": True,
    }
    armed = httpx.post(
        server.url + "/art/v1/test/fault", json={"kind": "commit", "rank": 1}, timeout=60
    )
    assert armed.status_code == 200, armed.text
    update = {"slot": "policy", "path": str(tiny_adapters / "b"), "version": before_version + 1}

    def settled(ride) -> bool:
        """Stage and commit rode batches, and the failed commit has been counted."""
        return ride.rides() >= 2 and ride.after["failed_commits"] > ride.before["failed_commits"]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            return await ride_a_stream(client, body, update, tokens_before=2, settled=settled)

    ride = asyncio.run(run())
    upd = ride.update
    assert upd.status_code == 500, upd.text
    assert "injected commit failure on rank 1" in upd.text
    assert "every worker restored its previous weights" in upd.text
    assert ride.rides() == 2  # stage and commit
    assert ride.after["failed_commits"] == ride.before["failed_commits"] + 1
    # the old weights' greedy tokens, as long as the streamed generation ran
    baseline = httpx.post(
        server.url + "/v1/completions",
        json={**body, "max_tokens": len(ride.tokens), "return_token_ids": True},
        timeout=300,
    ).json()
    assert ride.tokens == baseline["choices"][0]["token_ids"]
    spans = validate_spans(ride.choice, len(ride.tokens), latest_version=before_version)
    assert [(s["slot"], s["version"]) for s in spans] == [("policy", before_version)]
    assert _version(art) == before_version
    assert greedy_tokens(server.url) == greedy_tokens(server.url, "policy")


def test_an_adapter_the_workers_loader_refuses_is_422(server, art, tiny_adapters, scratch):
    def bias(cfg):
        cfg["bias"] = "all"  # passes the API's checks; vLLM's loader refuses it

    bad = edit_config(tiny_adapters / "b", scratch / "bias", bias)
    assert json.loads((bad / "adapter_config.json").read_text())["bias"] == "all"
    before_version, before = _version(art), greedy_tokens(server.url)
    with pytest.raises(ArtError) as err:
        art.update("policy", bad, before_version + 1)
    assert err.value.status == 422
    assert "engine refused the adapter" in err.value.message
    assert "bias is not supported" in err.value.message
    assert f"keeps serving version {before_version}" in err.value.message
    assert _version(art) == before_version and greedy_tokens(server.url) == before
