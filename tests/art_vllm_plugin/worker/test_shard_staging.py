"""Each worker stages only its own shard of a streamed full-weight version, and commits it by a
copy where the served form is the loaded form (`worker/shard_stage.py`,
`worker/shard_commit.py`, issue 35 items 3 and 4).

The server: the shared `tp2` server (tests/support/server_kinds.py: `-tp 2`, float32, the
`art_nixl` weight-transfer engine, `--art-weights-staging-bytes` = 3/4 of the model in float32).
The test process is the trainer (`NixlWeightSender`, 96 KiB buckets); both workers of the one
engine read each bucket out of the trainer's registered buffers between two steps and keep
only their slices.

Checked:
- before any stream, `GET /art/v1/weights` says what a version costs each worker: its shard
  is about half the model (the sum of its parameters' loaded forms), and which path its
  commit takes per module: on this CPU build the norms are copied (no weight processing) and
  the linear layers and embeddings rebuilt (the CPU build packs their GEMM weights for oneDNN:
  a linear layer's served `weight` is empty, an embedding gets a packed `cpu_linear`);
- a shard commit failing on rank 1 after its first module puts the served weights back on
  both ranks (500, the old tokens);
- a streamed update commits on both workers with Hugging Face's greedy tokens of the new
  checkpoint, and what each worker then holds for it (the undo of the next update) is its
  shard: at most 1.1x its shard and at most 0.55 of the whole model in float32;
- a second stream, which would need the held shard plus a new one, is over the staging budget:
  refused 507 before a byte moves (the trainer sends nothing), old weights serving;
- a files update whose commit fails on rank 1 after the streamed version puts both ranks back
  on the streamed weights, from the shard each of them holds.

Runs after every other module of the server (`changes_base_weights`).
"""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import load_file
from support.full_weights import SHORT, Server, export, hf_greedy, prompt_ids, tokens, update

from art_megatron_ext.weights import NixlWeightSender
from art_protocol.client import ArtClient, ArtError

pytestmark = [pytest.mark.serve, pytest.mark.changes_base_weights]

#: The one engine of the tp2 server has two workers.
WORKERS = 2
#: The trainer's buckets: the embedding and lm_head (139,520 bytes each) cross a boundary.
BUCKET_BYTES = 96 * 1024


@pytest.fixture(scope="module")
def server(tp2_server, tiny_model):
    return Server(tp2_server, tp2_server.scratch, tiny_model)


@pytest.fixture(scope="module")
def sender(server):
    client = ArtClient(server.url, timeout=600)
    sender = NixlWeightSender.connect(
        client, workers=WORKERS, bucket_bytes=BUCKET_BYTES, timeout_s=120
    )
    yield sender
    sender.close()
    client.close()


def model_bytes_fp32(model_dir) -> int:
    return sum(t.numel() * 4 for t in load_file(str(model_dir / "model.safetensors")).values())


def tensors_of(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def stream(sender, version: int, tensors: dict) -> dict:
    plan = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]

    def produce(sink):
        for name in sorted(tensors):
            sink(name, tensors[name])

    return sender.send(version, plan, produce)


def weights_view(server) -> dict:
    resp = httpx.get(server.url + "/art/v1/weights", timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def workers(server) -> list[dict]:
    (engine,) = weights_view(server)["staging"]["engines"]
    assert len(engine["workers"]) == WORKERS, engine
    return engine["workers"]


def greedy(server) -> list[int]:
    return tokens(server, 0)


def arm_commit_fault(server, rank: int) -> None:
    armed = httpx.post(
        server.url + "/art/v1/test/fault", json={"kind": "commit", "rank": rank}, timeout=60
    )
    assert armed.status_code == 200, armed.text


def test_each_worker_would_stage_half_the_model_and_says_how_it_commits(server):
    whole = model_bytes_fp32(server.model)
    view = weights_view(server)
    assert view["staging"]["budget_bytes"] == whole * 3 // 4
    for w in workers(server):
        assert w["staging"] == "host" and w["held_bytes"] == 0, w
        assert 0.45 * whole <= w["shard_bytes"] <= 0.55 * whole, (w, whole)
        commit = w["commit"]
        # 2 layers x (input, post-attention) + the final norm: no weight processing
        assert commit["copy"] == 5, commit
        # 2 layers x (qkv, o, gate_up, down) + embed_tokens + lm_head: packed on CPU
        assert commit["rebuild"] == 10, commit
        reasons = " ".join(commit["why"])
        # linear layers: packed for oneDNN, their `weight` emptied; embeddings: packed beside
        assert "served as (0,)" in reasons, reasons
        assert "UnquantizedEmbeddingMethod processing sets cpu_linear" in reasons, reasons
        assert "copy: no weight processing" in reasons, reasons


def test_a_failed_shard_commit_puts_the_served_weights_back(server, sender):
    before = weights_view(server)["version"]
    old = greedy(server)
    arm_commit_fault(server, rank=1)
    with pytest.raises(ArtError) as failed:
        stream(sender, server.next_version, tensors_of(export(server, "f", noise=0.05, seed=20)))
    assert failed.value.status == 500, failed.value.message
    assert "after the first module of a shard commit" in failed.value.message
    assert weights_view(server)["version"] == before
    assert greedy(server) == old
    assert all(w["held_bytes"] == 0 for w in workers(server))


def test_a_streamed_version_commits_and_each_worker_holds_only_its_shard(server, sender):
    whole = model_bytes_fp32(server.model)
    new_dir = export(server, "streamed", noise=0.05, seed=21)
    ref = hf_greedy(new_dir, prompt_ids(server), SHORT)
    v = server.version()
    upd = stream(sender, v, tensors_of(new_dir))
    assert upd["version"] == v
    assert greedy(server) == ref
    for w in workers(server):
        assert 0 < w["held_bytes"] <= 1.1 * w["shard_bytes"], w
        assert w["held_bytes"] <= 0.55 * whole, (w, whole)


def test_a_stream_over_the_staging_budget_is_refused_before_a_byte_moves(server, sender):
    before = weights_view(server)["version"]
    old = greedy(server)
    sent = []

    def produce(sink):
        sent.append("called")

    weights = tensors_of(export(server, "over", noise=0.05, seed=22))
    plan = [(name, t.dtype, tuple(t.shape)) for name, t in weights.items()]
    with pytest.raises(ArtError) as refused:
        sender.send(server.next_version, plan, produce)
    assert refused.value.status == 507, refused.value.message
    message = refused.value.message
    assert "--art-weights-staging-bytes" in message and "nothing was sent" in message
    assert sent == []
    assert weights_view(server)["version"] == before and greedy(server) == old


def test_a_failed_files_update_reverts_both_ranks_to_the_held_shards(server):
    streamed = greedy(server)
    arm_commit_fault(server, rank=1)
    nxt = server.next_version
    resp = update(server, export(server, f"files-{nxt}", noise=0.05, seed=nxt), nxt)
    assert resp.status_code == 500, resp.text
    assert greedy(server) == streamed
