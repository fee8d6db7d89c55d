"""Stages for engines on another host: the adapter's bytes come in the stage call itself.

Why: an update is staged as files that the workers read (`art_vllm_plugin.staging`). The API
server writes them to its own staging directory, which the workers of an engine on another
host (vLLM's multi-node data parallelism: `--data-parallel-size-local` below
`--data-parallel-size`, the other hosts running `--headless`) cannot see. vLLM already
connects the API server to every engine, remote ones included, for its utility calls, so the
bytes ride that channel: `art_stage_relayed` writes them to a stage directory on the engine's
own host (`ART_STAGING_DIR` there, else `/dev/shm`), then stages from it exactly as
`slot_updates.art_stage_lora_update` does. The API server reads that engine's markers through
`art_stage_markers` and removes the directory with `art_drop_relayed` once the update ended;
an abort or an abandoned update removes it too (`abandoned_updates`).

Cost: the engine writes the adapter's bytes once, on its busy loop, inside the stage call (a
tmpfs write: about a millisecond per MB here); the local engines stage as before.

A streamed LoRA adapter (`art_receive_adapter_relayed`) needs no bytes here either: the
workers receive the trainer's stream, and only their markers need a directory on this host
(the publish that follows relays the adapter's files as above).

A streamed full-weight update (`art_stage_base_relayed`) needs no bytes here: the workers
receive the trainer's stream themselves; only their markers need a directory on this host,
and the digest each worker received is read back with `art_stage_ready_texts`, and how far
each got while it receives with `base_updates.art_stage_progress` (the stage's deadline).
"""

from __future__ import annotations

from art_vllm_plugin import staging
from art_vllm_plugin.engine_core import adapter_streams, base_updates, slot_updates
from art_vllm_plugin.engine_core.state import engine_state


def _stage_dir_for(config: staging.StagingConfig, name: str, version: int, files: dict) -> str:
    what = f"adapter {name}@{version} on this engine's host"
    config.check_space(sum(len(b) for b in files.values()), what)
    stage_dir = staging.new_stage_dir(config, name, version)
    try:
        staging.write_files(stage_dir, files)
    except OSError as exc:
        staging.remove(stage_dir)
        raise config.refusal_for(exc, what) from exc
    return str(stage_dir)


def art_stage_relayed(
    self,
    token: str,
    lora_int_id: int,
    name: str,
    files: dict[str, bytes],
    version: int,
    digest: str,
    engine: int,
) -> dict:
    """Write `files` to a stage on this host and stage from it (`engine`: this engine's DP
    rank, which names its marker directory). Answers like `art_stage_lora_update`; a stage
    this host has no room for is refused (`kind` "staging", with the HTTP `status`)."""
    try:
        stage_dir = _stage_dir_for(staging.StagingConfig.create(None, None), name, version, files)
    except (staging.StagingRefused, staging.StagingDirError) as exc:
        status = getattr(exc, "status", 500)
        return {"ok": False, "kind": "staging", "status": status, "error": str(exc)}
    markers = staging.marker_dir(stage_dir, engine)
    res = slot_updates.art_stage_lora_update(
        self, token, lora_int_id, name, stage_dir, version, str(markers), digest
    )
    return _keep(self, token, res, stage_dir, markers)


def _keep(self, token: str, res: dict, stage_dir, markers) -> dict:
    """Remember a relayed stage that staged (its markers are read through this engine),
    remove one that did not."""
    if res["ok"]:
        state = engine_state(self)
        state.relayed[token] = (str(stage_dir), str(markers))
        state.relayed_total += 1
    else:
        staging.remove(stage_dir)
    return res


def _with_relayed_markers(self, token: str, name: str, version: int, engine: int, start):
    """`start(markers)` with the workers' markers in a fresh stage directory on this host
    (`engine`: this engine's DP rank), kept while it answers ok (`_keep`); a stage this host
    cannot make is refused (`kind` "staging", with the HTTP `status`)."""
    try:
        config = staging.StagingConfig.create(None, None)
        stage_dir = staging.new_stage_dir(config, name, version)
    except (staging.StagingRefused, staging.StagingDirError, OSError) as exc:
        status = getattr(exc, "status", 500)
        return {"ok": False, "kind": "staging", "status": status, "error": str(exc)}
    markers = staging.marker_dir(stage_dir, engine)
    return _keep(self, token, start(str(markers)), stage_dir, markers)


def art_stage_base_relayed(
    self, token: str, plan: dict, version: int, digest: str | None, engine: int
) -> dict:
    """Stage a streamed full-weight update with the workers' markers in a directory on this
    host (`engine`: this engine's DP rank). Answers like `art_stage_base_update`."""
    return _with_relayed_markers(
        self,
        token,
        "base",
        version,
        engine,
        lambda markers: base_updates.art_stage_base_update(
            self, token, plan, version, markers, digest
        ),
    )


def art_receive_adapter_relayed(self, token: str, plan: dict, engine: int) -> dict:
    """Have this engine's workers receive a streamed LoRA adapter with their markers in a
    directory on this host (`engine`: this engine's DP rank); none of them writes the
    adapter (engine 0's worker 0 does, on the API server's host). Answers like
    `adapter_streams.art_receive_adapter`."""
    return _with_relayed_markers(
        self,
        token,
        "receive",
        0,
        engine,
        lambda markers: adapter_streams.art_receive_adapter(self, token, plan, markers, None),
    )


def art_stage_ready_texts(self, token: str, ranks: list[int]) -> dict[int, str]:
    """What each worker wrote in its ready marker of the relayed stage `token` (a stream:
    the digest it received)."""
    entry = engine_state(self).relayed.get(token)
    if entry is None:
        return {}
    return {rank: staging.ready_text(entry[1], rank) for rank in ranks}


def art_stage_markers(self, token: str, ranks: list[int]) -> tuple[list[int], dict[int, str]]:
    """This engine's workers' markers of the relayed stage `token`: (ranks ready, {rank:
    error}); `staging.poll` on this host."""
    entry = engine_state(self).relayed.get(token)
    if entry is None:
        return [], dict.fromkeys(ranks, "engine\nno relayed stage of this update on the engine")
    return staging.poll(entry[1], ranks)


def art_drop_relayed(self, token: str) -> bool:
    """Remove the relayed stage of `token` (its update ended; the workers hold what they
    staged in memory)."""
    return engine_state(self).drop_relayed(token)
