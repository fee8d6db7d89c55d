"""Pushed adapters and the staging budget over HTTP, on real servers.

`POST /art/v1/lora/update` with `multipart/form-data` (`art_protocol.push`): the adapter's
files travel in the request, are streamed into staging, and then validated, staged and
committed like a path update. Around it, the staging budget: an update the staging directory
has no room for is 507, one over `--art-max-adapter-bytes` is 413, bad parts are 4xx, and in
every refusal nothing stays staged and the slot keeps its version.

Two servers:
- the shared plain plugin server (`lora`, tests/support/server_kinds.py): a trainer directory
  outside its adapter roots (a path update is 403, the push serves it), replay and
  compare-and-swap of pushes;
- `budget`, this module's own (see its fixture), whose staging directory is a small tmpfs;
- both together as a `Fleet` that pushes one adapter to each (each stages in its own
  directory: `/dev/shm` and the tmpfs).

"Serves the new adapter" is checked by greedy tokens against a reference slot that was
started with the same adapter (`ref_b`), on the same server.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from support.adapters import copy_adapter
from support.greedy import greedy_tokens as tokens
from support.stages import end, stage_left_by

from art_protocol.client import ArtClient, ArtError, Fleet
from art_protocol.digest import digest_dir
from art_protocol.push import AdapterBytes, multipart_files
from art_protocol.updates import UpdateRequest
from art_vllm_plugin import serve_process, staging

pytestmark = pytest.mark.serve

#: The budget server's `--art-max-adapter-bytes` (a tiny adapter is about 136 KB).
LIMIT = 256 * 1024
#: Its staging tmpfs: smaller than one adapter, or room for several.
SMALL, ROOMY = "64k", "4m"
_OPS = itertools.count()


def op_id(name: str) -> str:
    return f"push-{name}-{next(_OPS)}-{os.getpid()}"


def _mount(path: Path, size: str, remount: bool = False) -> None:
    options = f"remount,size={size}" if remount else f"size={size}"
    cmd = ["mount", "-o", options, str(path)] if remount else ["mount", "-t", "tmpfs"]
    if not remount:
        cmd += ["-o", options, "tmpfs", str(path)]
    subprocess.run(cmd, check=True, capture_output=True)


class Budget:
    """The budget server and its staging directory (a tmpfs that `resize` changes)."""

    def __init__(self, process, root: Path, shm: Path, tmpfs: bool):
        self.process, self.root, self.shm, self.tmpfs = process, root, shm, tmpfs

    @property
    def url(self) -> str:
        return self.process.url

    def resize(self, size: str) -> None:
        if not self.tmpfs:
            pytest.skip("needs root to mount a tmpfs smaller than the adapter")
        _mount(self.shm, size, remount=True)

    def stages(self) -> set[str]:
        return {p.name for p in self.shm.iterdir()}


@pytest.fixture(scope="module")
def budget(tiny_model, tiny_adapters, tmp_path_factory, server_log):
    """A server of this module's own: its staging directory is the subject of the tests (a
    tmpfs smaller than one adapter when the tests run as root, made bigger by the tests that
    need room), `--art-max-adapter-bytes` 256 KiB, and stages planted before it starts (one
    left by a SIGKILLed process, one of a live process) to watch its start sweep them.
    `--max-cpu-loras 3`: slots policy and ref_b and one lease."""
    root = tmp_path_factory.mktemp("budget")
    shm = root / "shm"
    shm.mkdir()
    tmpfs = os.geteuid() == 0
    if tmpfs:
        try:
            _mount(shm, SMALL)
        except subprocess.CalledProcessError:
            tmpfs = False
    starts = {
        slot: copy_adapter(tiny_adapters / name, root / "start" / slot)
        for slot, name in (("policy", "a"), ("ref_b", "b"))
    }
    _, dead = stage_left_by(shm, "kill")
    live_proc, live = stage_left_by(shm, "live")
    config = serve_process.ServeConfig(
        model=str(tiny_model),
        args=(
            *serve_process.tiny_lora_args(max_loras=2),
            *serve_process.ALLOW_UNAUTHENTICATED,
            *("--max-cpu-loras", "3"),
            "--lora-modules",
            *(f"{slot}={path}" for slot, path in starts.items()),
            *("--art-adapter-root", str(root)),
            *("--art-staging-dir", str(shm), "--art-max-adapter-bytes", "256KiB"),
        ),
        log_path=server_log,
        startup_timeout_s=900.0,
    )
    process = serve_process.start(config)
    try:
        server = Budget(process, root, shm, tmpfs)
        server.planted = {"dead": dead, "live": live}
        yield server
    finally:
        process.stop()
        end(live_proc)
        if tmpfs:
            subprocess.run(["umount", str(shm)], check=False)


@pytest.fixture(scope="module")
def lora(lora_server):
    """The shared plain plugin server (`lora` in tests/support/server_kinds.py)."""
    return lora_server


def slot(url: str, name: str = "policy") -> dict:
    return {s["slot"]: s for s in httpx.get(url + "/art/v1/slots", timeout=60).json()}[name]


def post_parts(url: str, parts: list[tuple]) -> httpx.Response:
    return httpx.post(url + "/art/v1/lora/update", files=parts, timeout=300)


def error(resp: httpx.Response) -> str:
    return resp.json()["error"]["message"]


def take_lease(url: str, version: int) -> httpx.Response:
    body = {"slot": "policy", "version": version, "ttl_s": 300}
    return httpx.post(url + "/art/v1/leases", json=body, timeout=300)


def oversize(src: Path, dst: Path) -> Path:
    """An adapter directory of more than LIMIT bytes (the weights are junk: the size is
    refused before anything is parsed)."""
    copy_adapter(src, dst)
    (dst / "adapter_model.safetensors").write_bytes(os.urandom(2 * LIMIT))
    return dst


# -- the budget server ------------------------------------------------------------------------
def test_its_start_removed_the_stage_a_killed_process_left_and_nothing_else(budget):
    dead, live = budget.planted["dead"], budget.planted["live"]
    assert not dead.exists(), "the SIGKILLed process's stage survived the server's start"
    assert live.exists(), "the stage of a process that still runs was removed"
    log = budget.process.log_path.read_text(errors="replace")
    assert f"left by processes that are gone: {dead}" in log


def test_no_room_in_the_staging_dir_is_507_by_path_and_by_push(budget, tiny_adapters):
    budget.resize(SMALL)
    before, before_tokens, stages = slot(budget.url), tokens(budget.url), budget.stages()
    version = before["version"] + 1
    free = staging.free_bytes(budget.shm)
    b = copy_adapter(tiny_adapters / "b", budget.root / "b-507")
    with ArtClient(budget.url, timeout=300) as art:
        with pytest.raises(ArtError) as by_path:
            art.update("policy", b, version)
        with pytest.raises(ArtError) as by_push:
            art.update_from_dir("policy", b, version)
    for err in (by_path.value, by_push.value):
        assert err.status == 507, err
        assert f"in {budget.shm}" in err.message and f"only {free} bytes are free" in err.message
        assert "nothing was staged" in err.message and "--art-staging-dir" in err.message
    size = sum(f.stat().st_size for f in b.iterdir())
    assert f"needs {size + staging.STAGE_OVERHEAD_BYTES} bytes" in by_path.value.message
    assert f"keeps serving version {before['version']}" in by_path.value.message
    assert slot(budget.url) == before and tokens(budget.url) == before_tokens
    assert budget.stages() == stages


def test_an_adapter_over_the_limit_is_413_by_path_push_and_stream(budget, tiny_adapters):
    budget.resize(ROOMY)  # room for more than the limit: the limit refuses, not the space
    before, stages = slot(budget.url), budget.stages()
    big = oversize(tiny_adapters / "b", budget.root / "big")
    version = before["version"] + 1
    with ArtClient(budget.url, timeout=300) as art:
        with pytest.raises(ArtError) as by_path:
            art.update("policy", big, version)
        with pytest.raises(ArtError) as by_push:
            art.update_from_dir("policy", big, version)
    # Chunked (no Content-Length): refused as the bytes arrive.
    parts = multipart_files(UpdateRequest("policy", None, version), AdapterBytes.read(big))
    built = httpx.Request("POST", budget.url, files=parts)
    body = built.read()
    streamed = httpx.post(
        budget.url + "/art/v1/lora/update",
        content=(body[i : i + 65536] for i in range(0, len(body), 65536)),
        headers={"content-type": built.headers["content-type"]},
        timeout=300,
    )
    assert streamed.status_code == 413, streamed.text
    assert "bytes received so far" in error(streamed)
    assert f"the pushed body is {len(body)} bytes" in by_push.value.message  # by its length
    for message in (by_path.value.message, by_push.value.message, error(streamed)):
        assert f"limit of {LIMIT} bytes" in message and "--art-max-adapter-bytes" in message
        assert "nothing was staged" in message
    assert by_path.value.status == by_push.value.status == 413
    assert slot(budget.url) == before and budget.stages() == stages


def _parts(adapter: AdapterBytes, request: dict | bytes | None, drop=(), extra=()) -> list:
    parts = []
    if request is not None:
        data = request if isinstance(request, bytes) else json.dumps(request).encode()
        parts.append(("request", (None, data, "application/json")))
    for name, data in (
        ("adapter_config.json", adapter.config),
        ("adapter_model.safetensors", adapter.weights),
    ):
        if name not in drop:
            parts.append((name, (name, data, "application/octet-stream")))
    return parts + list(extra)


def test_bad_parts_are_4xx_naming_the_part_and_stage_nothing(budget, tiny_adapters):
    budget.resize(ROOMY)
    before, before_tokens, stages = slot(budget.url), tokens(budget.url), budget.stages()
    b = AdapterBytes.read(tiny_adapters / "b")
    ok = {"slot": "policy", "version": before["version"] + 1}
    cases = {
        "no request part": (_parts(b, None), 400, "no 'request' part"),
        "no weights part": (
            _parts(b, ok, drop=("adapter_model.safetensors",)),
            400,
            "no 'adapter_model.safetensors' part",
        ),
        "a path in a push": (_parts(b, {**ok, "path": "/x"}), 400, "'path' must not be given"),
        "request not JSON": (_parts(b, b"{nope"), 400, "'request' part is not valid JSON"),
        "bad field": (_parts(b, {**ok, "version": -1}), 400, "'version'"),
        "unknown part": (
            _parts(b, ok, extra=[("weights.bin", ("weights.bin", b"x", "text/plain"))]),
            400,
            "unexpected part 'weights.bin'",
        ),
        "part twice": (
            _parts(b, ok, extra=[("adapter_config.json", ("c", b.config, "application/json"))]),
            400,
            "part 'adapter_config.json' appears twice",
        ),
        "unknown slot": (_parts(b, {**ok, "slot": "nope"}), 404, "unknown slot 'nope'"),
        "wrong digest": (
            _parts(b, {**ok, "digest": digest_dir(tiny_adapters / "a")}),
            422,
            f"digest mismatch: the request says {digest_dir(tiny_adapters / 'a')}, the pushed "
            f"adapter is {b.digest()}",
        ),
    }
    for what, (parts, status, fragment) in cases.items():
        resp = post_parts(budget.url, parts)
        assert resp.status_code == status, (what, resp.text)
        assert fragment in error(resp), (what, error(resp))
        assert budget.stages() == stages, f"{what}: something stayed staged"
    truncated = httpx.post(
        budget.url + "/art/v1/lora/update",
        content=b'--xyz\r\nContent-Disposition: form-data; name="request"\r\n\r\n{}',
        headers={"content-type": "multipart/form-data; boundary=xyz"},
        timeout=60,
    )
    assert truncated.status_code == 400 and "closing boundary" in error(truncated)
    assert slot(budget.url) == before and tokens(budget.url) == before_tokens


def test_with_room_a_push_commits_and_serves_the_new_adapter(budget, tiny_adapters):
    budget.resize(ROOMY)
    stages = budget.stages()
    version = slot(budget.url)["version"] + 1
    with ArtClient(budget.url, timeout=300) as art:
        resp = art.update_from_dir("policy", tiny_adapters / "b", version)
    assert resp["version"] == version and resp["digest"] == digest_dir(tiny_adapters / "b")
    assert tokens(budget.url) == tokens(budget.url, "ref_b")
    assert budget.stages() == stages, "the stage was not removed after the commit"


def test_a_pushed_version_can_be_leased_while_it_is_current(budget, tiny_adapters):
    budget.resize(ROOMY)
    version = slot(budget.url)["version"] + 1
    with ArtClient(budget.url, timeout=300) as art:
        art.update_from_dir("policy", tiny_adapters / "b", version)
        lease = take_lease(budget.url, version)
        assert lease.status_code == 200, lease.text
        try:
            art.update_from_dir("policy", tiny_adapters / "a", version + 1)
            assert tokens(budget.url, f"policy@{version}") == tokens(budget.url, "ref_b")
            assert tokens(budget.url) != tokens(budget.url, "ref_b")
        finally:
            httpx.delete(f"{budget.url}/art/v1/leases/{lease.json()['id']}", timeout=60)
    # Replaced and no longer leased: its kept copy is gone, as a deleted path's would be.
    gone = take_lease(budget.url, version)
    assert gone.status_code == 404, gone.text
    assert "no longer available" in error(gone)


# -- the shared server ------------------------------------------------------------------------
def test_a_push_serves_an_adapter_the_server_may_not_read(lora, tiny_adapters, tmp_path):
    trainer = copy_adapter(tiny_adapters / "b", tmp_path / "trainer" / "policy" / "v1")
    version = slot(lora.url)["version"] + 1
    with ArtClient(lora.url, timeout=300) as art:
        with pytest.raises(ArtError) as refused:
            art.update("policy", trainer, version)
        assert refused.value.status == 403, refused.value
        resp = art.update_from_dir("policy", trainer, version, digest=digest_dir(trainer))
    digest = digest_dir(tiny_adapters / "b")
    assert (resp["version"], resp["digest"]) == (version, digest)
    assert resp["receipts"][0]["digest"] == digest
    assert tokens(lora.url) == tokens(lora.url, "ref_b")
    s = slot(lora.url)
    assert (s["version"], s["digest"]) == (version, digest)
    assert not s["path"].startswith(str(tmp_path)), "the server recorded the trainer's path"
    features = httpx.get(lora.url + "/art/v1/capabilities", timeout=60).json()["features"]
    assert features["adapter_push"]["enabled"] is True


def test_push_replay_and_compare_and_swap_are_by_content(lora, tiny_adapters):
    version = slot(lora.url)["version"] + 1
    op = op_id("replay")
    engine = lambda: httpx.get(lora.url + "/art/v1/engine", timeout=60).json()["updates"]  # noqa: E731
    with ArtClient(lora.url, timeout=300) as art:
        first = art.update_from_dir("policy", tiny_adapters / "a", version, operation_id=op)
        commits = engine()
        again = art.update_from_dir("policy", tiny_adapters / "a", version, operation_id=op)
        assert again == {**first, "replayed": True} and engine() == commits
        with pytest.raises(ArtError) as other_bytes:
            art.update_from_dir("policy", tiny_adapters / "b", version, operation_id=op)
        assert other_bytes.value.status == 409 and "different body" in other_bytes.value.message
        with pytest.raises(ArtError) as stale:
            art.update_from_dir("policy", tiny_adapters / "b", version + 1, expected_version=0)
        assert stale.value.status == 409
        assert f"current version is {version}" in stale.value.message
    assert slot(lora.url)["version"] == version


def test_a_fleet_pushes_one_read_to_servers_with_their_own_staging_dirs(
    lora, budget, tiny_adapters, tmp_path
):
    budget.resize(ROOMY)
    trainer = copy_adapter(tiny_adapters / "b", tmp_path / "fleet-v")
    urls = [lora.url, budget.url]
    version = max(slot(u)["version"] for u in urls) + 1
    with Fleet(urls) as fleet:
        result = fleet.publish("policy", trainer, version, push=True)
    assert result.ok, [r.error for r in result.replicas]
    digest = digest_dir(trainer)
    for r in result.replicas:
        assert r.response["operation_id"] == result.operation_id
        assert (r.response["version"], r.response["digest"]) == (version, digest)
        assert tokens(r.url) == tokens(r.url, "ref_b")
