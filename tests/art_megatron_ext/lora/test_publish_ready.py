"""`export_ready`: atomic, digest-stamped, immutable adapter versions (one rank and gloo x2).

- The version directory appears complete, with a manifest whose digest is `digest_dir` of the
  files written, and the same adapter bytes as a plain `export_peft`.
- A failure before the rename (and a process killed before it) leaves no `v<N>`; the next
  export of that version succeeds and removes the stale temporary.
- An existing version is refused with a clear error, on every rank, before any gather.
- On two gloo ranks every rank returns the same `AdapterReady` and only rank 0 writes.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
from support.train_ranks import run_ranks

from art_megatron_ext.lora import publish_ready
from art_megatron_ext.lora.export import export_peft
from art_megatron_ext.lora.publish_ready import (
    MANIFEST_FILE,
    AdapterVersionExists,
    BackgroundPublisher,
    export_ready,
    read_manifest,
    version_dir,
)
from art_protocol.digest import digest_dir

SHAPE = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=64,
)


def _visible(root: Path, slot: str) -> list[str]:
    return sorted(p.name for p in (root / slot).iterdir() if not p.name.startswith("."))


def _hidden(root: Path, slot: str) -> list[str]:
    return sorted(p.name for p in (root / slot).iterdir() if p.name.startswith("."))


def test_version_appears_complete_with_manifest_digest(make_lora_gpt, randomize_b, tmp_path):
    model = make_lora_gpt()
    randomize_b(model, "default", seed=3)
    seen = []
    ready = export_ready(
        model,
        "default",
        tmp_path,
        version=4,
        step=17,
        base_model_name_or_path="tiny",
        on_ready=seen.append,
    )
    final = version_dir(tmp_path, "default", 4)
    assert ready.path == str(final.resolve()) and seen == [ready]
    assert (ready.slot, ready.version, ready.step) == ("default", 4, 17)
    assert ready.digest == digest_dir(final)
    manifest = read_manifest(final)
    assert manifest["digest"] == digest_dir(final) == ready.digest
    assert (manifest["slot"], manifest["version"], manifest["step"]) == ("default", 4, 17)
    assert manifest["created"] == ready.created
    assert sorted(p.name for p in final.iterdir()) == sorted(
        ["adapter_config.json", "adapter_model.safetensors", MANIFEST_FILE]
    )
    assert _visible(tmp_path, "default") == ["v4"] and _hidden(tmp_path, "default") == []
    plain = tmp_path / "plain"
    export_peft(model, "default", plain, "tiny")
    assert digest_dir(plain) == ready.digest  # the same bytes as a plain export
    assert ready.update_body() == {
        "slot": "default",
        "path": ready.path,
        "version": 4,
        "digest": ready.digest,
    }


def test_existing_version_is_refused_and_untouched(make_lora_gpt, randomize_b, tmp_path):
    model = make_lora_gpt()
    randomize_b(model, "default", seed=3)
    first = export_ready(model, "default", tmp_path, version=1, step=1, base_model_name_or_path="t")
    randomize_b(model, "default", seed=4)
    with pytest.raises(AdapterVersionExists, match=r"v1 already exists; versions are immutable"):
        export_ready(model, "default", tmp_path, version=1, step=2, base_model_name_or_path="t")
    assert digest_dir(first.path) == first.digest and read_manifest(first.path)["step"] == 1
    assert _hidden(tmp_path, "default") == []
    second = export_ready(
        model, "default", tmp_path, version=2, step=2, base_model_name_or_path="t"
    )
    assert second.digest != first.digest


def test_bad_arguments_are_named(make_lora_gpt, tmp_path):
    model = make_lora_gpt()
    with pytest.raises(ValueError, match="version must be a non-negative integer, got -1"):
        export_ready(model, "default", tmp_path, version=-1, step=0, base_model_name_or_path="t")
    with pytest.raises(ValueError, match="slot must be a plain directory name"):
        export_ready(model, "a/b", tmp_path, version=0, step=0, base_model_name_or_path="t")
    assert not tmp_path.joinpath("default").exists()


def test_failure_before_rename_leaves_no_version(make_lora_gpt, tmp_path, monkeypatch):
    model = make_lora_gpt()

    def no_rename(src, dst):
        raise OSError(28, "No space left on device (injected)")

    with monkeypatch.context() as m:
        m.setattr(publish_ready.os, "rename", no_rename)
        with pytest.raises(OSError, match="injected"):
            export_ready(model, "default", tmp_path, version=3, step=0, base_model_name_or_path="t")
    assert _visible(tmp_path, "default") == [] and _hidden(tmp_path, "default") == []
    ready = export_ready(model, "default", tmp_path, version=3, step=0, base_model_name_or_path="t")
    assert ready.digest == digest_dir(version_dir(tmp_path, "default", 3))


def test_background_publisher_runs_in_order_off_the_caller():
    import threading

    order, threads = [], set()

    def publish(ready):
        time.sleep(0.01 if ready == 0 else 0.0)
        order.append(ready)
        threads.add(threading.get_ident())
        return ready * 10

    with BackgroundPublisher(publish) as pub:
        futures = [pub.submit(i) for i in range(3)]
        assert [f.result() for f in futures] == [0, 10, 20]
    assert order == [0, 1, 2] and threading.get_ident() not in threads


# ---- a process killed between writing and renaming ------------------------------------------


def _killed_export(root: str, marker: str) -> None:
    """Child: export until just before the rename, say so, then wait to be killed."""
    from megatron.core import parallel_state

    from art_megatron_ext.lora import LoraConfig, attach_lora
    from art_megatron_ext.lora.cpu_runtime import cpu_megatron
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{root}/rdzv", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(1, 1)
    with cpu_megatron():
        torch.manual_seed(0)
        model = build_gpt(GptShape(**SHAPE))
        attach_lora(model, LoraConfig(rank=4, alpha=8.0))

        def hang(src, dst):
            Path(marker).write_text(str(src))
            time.sleep(600)

        publish_ready.os.rename = hang
        export_ready(model, "default", root, version=7, step=7, base_model_name_or_path="t")


def test_killed_export_leaves_no_partial_version(make_lora_gpt, tmp_path):
    marker = tmp_path / "before_rename"
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_killed_export, args=(str(tmp_path), str(marker)), daemon=True)
    child.start()
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.is_alive(), "the export child died before reaching the rename"
            assert time.monotonic() < deadline, "the export child never reached the rename"
            time.sleep(0.1)
    finally:
        child.kill()
        child.join()
    partial = Path(marker.read_text())
    assert partial.is_dir() and partial.name.startswith(".v7.tmp-")  # it was all written...
    assert (partial / MANIFEST_FILE).exists()
    assert _visible(tmp_path, "default") == []  # ...and nothing is visible under v7
    ready = export_ready(
        make_lora_gpt(), "default", tmp_path, version=7, step=7, base_model_name_or_path="t"
    )
    assert _visible(tmp_path, "default") == ["v7"] and _hidden(tmp_path, "default") == []
    assert ready.digest == digest_dir(ready.path)


# ---- two gloo ranks ------------------------------------------------------------------------


def _two_rank_worker(rank: int, world_size: int, root: str) -> dict:
    from megatron.core import parallel_state

    from art_megatron_ext.lora import LoraConfig, attach_lora
    from art_megatron_ext.lora.cpu_runtime import cpu_megatron
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    parallel_state.initialize_model_parallel(1, 1)  # data parallel x2: rank 0 writes
    out: dict = {}
    try:
        with cpu_megatron():
            torch.manual_seed(0)
            model = build_gpt(GptShape(**SHAPE))
            attach_lora(model, LoraConfig(rank=4, alpha=8.0))
            made: list = []
            ready = export_ready(
                model,
                "default",
                root,
                version=0,
                step=5,
                base_model_name_or_path="t",
                on_ready=made.append,
            )
            out["ready"] = ready
            out["on_ready_calls"] = len(made)
            try:
                export_ready(model, "default", root, version=0, step=6, base_model_name_or_path="t")
            except AdapterVersionExists as exc:
                out["refused"] = str(exc)
            blocker = os.path.join(root, "blocker")  # a file where a directory must go
            if rank == 0:
                Path(blocker).write_text("")
            torch.distributed.barrier()
            try:
                export_ready(
                    model, "default", blocker, version=0, step=7, base_model_name_or_path="t"
                )
            except OSError as exc:
                out["unwritable"] = str(exc)
            torch.distributed.barrier()
    finally:
        parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    root = tempfile.mkdtemp(prefix="art_publish_ready_")
    os.makedirs(os.path.join(root, "default"))
    return root, run_ranks(_two_rank_worker, world_size=2, args=(root,))


def test_two_ranks_return_the_same_ready_and_rank0_alone_calls_back(two_ranks):
    root, results = two_ranks
    assert results[0]["ready"] == results[1]["ready"]
    ready = results[0]["ready"]
    assert ready.digest == digest_dir(ready.path) == read_manifest(ready.path)["digest"]
    assert [r["on_ready_calls"] for r in results] == [1, 0]
    assert _visible(Path(root), "default") == ["v0"] and _hidden(Path(root), "default") == []


def test_two_ranks_refuse_an_existing_version_together(two_ranks):
    _, results = two_ranks
    for r in results:  # both ranks raise (no rank left waiting in a gather)
        assert "v0 already exists" in r["refused"]


def test_two_ranks_hear_of_an_unwritable_root_together(two_ranks):
    _, results = two_ranks
    for r in results:  # rank 0's failure reaches rank 1 (no rank left waiting)
        assert "cannot prepare" in r["unwritable"] and "blocker" in r["unwritable"]
