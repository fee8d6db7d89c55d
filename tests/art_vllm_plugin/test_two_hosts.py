"""Updates reach data-parallel engines on another host (issue 23 item 3).

vLLM's multi-node data parallelism, simulated on this host: the "head" runs the API server and
engine 0 (`--data-parallel-size 2 --data-parallel-size-local 1`), a second `vllm serve
--headless --data-parallel-start-rank 1` runs engine 1, as the second host of a deployment
would. Each "host" has its own staging directory (`ART_STAGING_DIR`), and the trainer's
directory is outside every adapter root: the trainer pushes its files. Engine 1 cannot rely on
the head's staging directory (on two hosts it would not see it), so the head sends it the bytes
in the stage call and it stages on its own host (`engine_core/relayed_stages.py`), which it
counts in `/art/v1/engine?engine=1` (`relayed_stages`); engine 0 stages from the head's
directory as before.

Checked: a path update from the trainer's directory is refused (403) and the push commits on
both engines with a receipt from each; both serve the new adapter (greedy tokens equal the
reference slot's); a stage that fails on engine 1 leaves both engines on the old version; no
stage is left in either staging directory. Full weights: a files update is refused (501:
engine 1 cannot read the head's stage) and a streamed one (`art_gloo`, both processes run
`--weight-transfer-config`) commits on both engines, engine 1 keeping its workers' markers on
its own host; both then serve the new weights. That test runs last: it moves the base weights.
A LoRA adapter streamed over the same group (no files, no body) commits on both engines, engine
1's workers receiving it with their markers on their own host.

The module starts its own pair of processes: the layout (two processes, two staging
directories, no shared adapter root) is the subject of every test here.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from support.adapter_stream import Adapter, stream
from support.adapters import copy_adapter
from support.greedy import greedy_tokens as tokens

from art_megatron_ext.weights import GlooWeightSender
from art_protocol.client import ArtClient, ArtError
from art_protocol.digest import digest_dir
from art_vllm_plugin import serve_process

pytestmark = pytest.mark.serve


class TwoHosts:
    def __init__(self, head, headless, staging: dict[int, Path], root: Path):
        self.head, self.headless, self.staging, self.root = head, headless, staging, root

    @property
    def url(self) -> str:
        return self.head.url

    def engine(self, rank: int) -> dict:
        resp = httpx.get(f"{self.url}/art/v1/engine", params={"engine": rank}, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def stages(self) -> dict[int, list[str]]:
        return {rank: sorted(p.name for p in d.iterdir()) for rank, d in self.staging.items()}


def _config(model, args, env, log_path) -> serve_process.ServeConfig:
    return serve_process.ServeConfig(
        model=str(model), args=args, env=env, log_path=log_path, startup_timeout_s=900.0
    )


@pytest.fixture(scope="module")
def two_hosts(tiny_model, tiny_adapters, tmp_path_factory, server_log):
    root = tmp_path_factory.mktemp("two_hosts")
    staging = {rank: root / f"host{rank}-shm" for rank in (0, 1)}
    for d in staging.values():
        d.mkdir()
    starts = {
        slot: copy_adapter(tiny_adapters / name, root / "start" / slot)
        for slot, name in (("policy", "a"), ("ref_b", "b"))
    }
    cpus = sorted(os.sched_getaffinity(0))
    common = (
        *serve_process.tiny_lora_args(max_loras=2),
        *("--data-parallel-size", "2", "--data-parallel-size-local", "1"),
        *("--data-parallel-address", "127.0.0.1"),
        *("--data-parallel-rpc-port", str(serve_process.free_port())),
        *("--weight-transfer-config", '{"backend": "art_gloo"}'),
    )
    headless_config = _config(
        tiny_model,
        (*common, "--headless", "--data-parallel-start-rank", "1"),
        {
            "ART_STAGING_DIR": str(staging[1]),
            "ART_TEST_HOOKS": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(cpus[1 % len(cpus)]),
        },
        server_log.with_name(server_log.stem + "-headless.log"),
    )
    head_config = _config(
        tiny_model,
        (
            *common,
            *serve_process.ALLOW_UNAUTHENTICATED,
            *("--api-server-count", "1"),
            "--lora-modules",
            *(f"{slot}={path}" for slot, path in starts.items()),
        ),
        {
            "ART_STAGING_DIR": str(staging[0]),
            "ART_TEST_HOOKS": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(cpus[0]),
        },
        server_log,
    )
    headless = _start_headless(headless_config)
    try:
        head = serve_process.start(head_config)
        try:
            yield TwoHosts(head, headless, staging, root)
        finally:
            head.stop()
    finally:
        headless.stop()


def _start_headless(config: serve_process.ServeConfig) -> serve_process.ServerProcess:
    """The second "host": no HTTP server to wait for; the head's start waits for its engine."""
    env = {k: v for k, v in os.environ.items() if k not in config.unset_env}
    env.update(serve_process.VLLM_RUN_ENV)
    env.update(config.env)
    with config.log_path.open("w") as log:
        proc = subprocess.Popen(
            serve_process.build_command(config, serve_process.free_port()),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    return serve_process.ServerProcess(config, 0, proc, config.log_path)


def engine_versions(url: str, name: str = "policy") -> dict[int, int]:
    slots = {s["slot"]: s for s in httpx.get(url + "/art/v1/slots", timeout=60).json()}
    return {e["engine"]: e["version"] for e in slots[name]["engines"]}


def test_a_push_commits_on_both_hosts_each_staging_on_its_own(two_hosts, tiny_adapters):
    trainer = copy_adapter(tiny_adapters / "b", two_hosts.root / "trainer" / "policy" / "v1")
    relayed = {rank: two_hosts.engine(rank)["relayed_stages"] for rank in (0, 1)}
    with ArtClient(two_hosts.url, timeout=300) as art:
        with pytest.raises(ArtError) as refused:  # the server may not read the trainer's dir
            art.update("policy", trainer, 1)
        assert refused.value.status == 403, refused.value
        resp = art.update_from_dir("policy", trainer, 1)
    digest = digest_dir(trainer)
    assert resp["version"] == 1 and resp["digest"] == digest
    assert [(r["engine"], r["version"], r["digest"]) for r in resp["receipts"]] == [
        (0, 1, digest),
        (1, 1, digest),
    ]
    assert engine_versions(two_hosts.url) == {0: 1, 1: 1}
    # Engine 1 staged from bytes written on its own host; engine 0 from the head's directory.
    assert two_hosts.engine(1)["relayed_stages"] == relayed[1] + 1
    assert two_hosts.engine(0)["relayed_stages"] == relayed[0]
    reference = tokens(two_hosts.url, "ref_b")
    for _ in range(4):  # the engines take turns: both answer with the pushed adapter
        assert tokens(two_hosts.url, "policy") == reference
    assert two_hosts.stages() == {0: [], 1: []}, "a stage was left behind"


def test_a_stage_that_fails_on_the_remote_engine_changes_no_engine(two_hosts, tiny_adapters):
    before = engine_versions(two_hosts.url)
    armed = httpx.post(
        two_hosts.url + "/art/v1/test/fault",
        json={"kind": "stage", "rank": 0, "engine": 1},
        timeout=60,
    )
    assert armed.status_code == 200, armed.text
    with ArtClient(two_hosts.url, timeout=300) as art, pytest.raises(ArtError) as failed:
        art.update_from_dir("policy", tiny_adapters / "a", before[0] + 1)
    assert failed.value.status == 500, failed.value
    assert "engine 1 worker rank 0 failed to stage" in str(failed.value)
    assert engine_versions(two_hosts.url) == before
    assert two_hosts.stages() == {0: [], 1: []}, "a stage was left behind"


def test_a_streamed_adapter_commits_on_both_hosts(two_hosts, tiny_adapters):
    """No files and no HTTP body: the trainer streams adapter b's tensors over its group;
    engine 1's workers receive them too and keep their markers on their own host, and the
    publish relays the adapter's files there as for a push."""
    before = engine_versions(two_hosts.url)
    version = max(before.values()) + 1
    relayed = two_hosts.engine(1)["relayed_stages"]
    b = Adapter(tiny_adapters / "b")
    with ArtClient(two_hosts.url, timeout=300) as art:
        sender = GlooWeightSender.connect(art, workers=2, timeout_s=120)
        try:
            resp = stream(sender, "policy", version, b)
        finally:
            sender.close()
    assert resp["version"] == version and resp["digest"] == b.digest()
    assert [(r["engine"], r["version"]) for r in resp["receipts"]] == [(0, version), (1, version)]
    assert engine_versions(two_hosts.url) == {0: version, 1: version}
    # its receive markers, then the publish's relayed stage, both on its own host
    assert two_hosts.engine(1)["relayed_stages"] == relayed + 2
    reference = tokens(two_hosts.url, "ref_b")
    for _ in range(4):  # the engines take turns: both answer with the streamed adapter
        assert tokens(two_hosts.url, "policy") == reference
    assert two_hosts.stages() == {0: [], 1: []}, "a stage was left behind"


def test_full_weights_reach_the_remote_engine_as_a_stream(two_hosts, tiny_model):
    model = str(tiny_model)
    before = tokens(two_hosts.url, model)
    relayed = two_hosts.engine(1)["relayed_stages"]
    g = torch.Generator().manual_seed(5)
    new = {
        name: (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype)
        for name, t in load_file(str(tiny_model / "model.safetensors")).items()
    }
    plan = [(name, t.dtype, tuple(t.shape)) for name, t in new.items()]
    with ArtClient(two_hosts.url, timeout=300) as art:
        with pytest.raises(ArtError) as files:
            art.update_weights(str(tiny_model), 1)
        assert files.value.status == 501 and "stream the weights instead" in files.value.message
        sender = GlooWeightSender.connect(art, workers=2, timeout_s=120)
        try:
            resp = sender.send(1, plan, lambda sink: [sink(n, t) for n, t in new.items()])
        finally:
            sender.close()
    assert resp["version"] == 1 and sorted(r["engine"] for r in resp["receipts"]) == [0, 1]
    assert [two_hosts.engine(rank)["base_version"] for rank in (0, 1)] == [1, 1]
    assert two_hosts.engine(1)["relayed_stages"] == relayed + 1  # its markers, on its host
    after = [tokens(two_hosts.url, model) for _ in range(4)]  # the engines take turns
    assert after[0] != before and all(t == after[0] for t in after)
    assert two_hosts.stages() == {0: [], 1: []}, "a stage was left behind"
