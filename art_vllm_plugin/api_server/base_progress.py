"""How far the full-weight update in flight got, per engine: `progress` of `GET /art/v1/weights`.

Why from files where it can: an engine of several workers receives a stream between two
steps (`worker/base_weights.py`), and answers no utility call until the stream is in, so
asking it how far it got would wait for the very thing it reports. The workers' progress
records (`art_vllm_plugin.stage_progress`) are files in the stage of the API server that
runs the update, which reads them on a thread for its local engines; it asks only an engine
on another host (`art_stage_progress`), for at most `ENGINE_READ_S`. Another API server of the
same server (`--api-server-count`, vLLM's default under data parallelism) has no stage of it:
it asks every engine, within the same bound.

The same reason bounds the rest of the route while an update runs: the engines' registry and
staging figures are read as always, but answered from the last read when they take longer
than `ENGINE_READ_S` (one read in flight at a time, so a client that polls does not queue
reads behind the stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from art_vllm_plugin import stage_progress, staging
from art_vllm_plugin.api_server import slot_publish
from art_vllm_plugin.api_server.stage_deadline import StallRule, engine_progress

#: Longest a `GET /art/v1/weights` waits for an engine while an update runs.
ENGINE_READ_S = 1.0


@dataclass
class RunningStage:
    """The full-weight update staging now on this API server."""

    version: int
    token: str
    stage_dir: Path
    rule: StallRule
    started: float = field(default_factory=time.monotonic)


class StageProgress:
    """The update in flight (`running`, set by `BaseUpdater` around its stage) and its
    progress per engine."""

    def __init__(
        self,
        engine_client,
        engines: list[slot_publish.Engine],
        stall_s: float,
        sole_api_server: bool = False,
    ):
        self.engine_client = engine_client
        self.engines = engines
        #: This is the server's only API server: an update no API server here runs is none.
        self.sole_api_server = sole_api_server
        #: The server's `--art-weights-stall-timeout` (shown for an update another API
        #: server runs).
        self.stall_s = stall_s
        self.running: RunningStage | None = None
        self._read: asyncio.Future | None = None

    async def view(self) -> dict | None:
        """`progress` of `GET /art/v1/weights`: None when no full-weight update stages, else
        its version, how long it has run (known to the API server running it), the stall
        window, and per engine the bytes and tensors its slowest worker received of the
        update's total, the seconds since any of its workers received anything, and each
        worker's record."""
        run = self.running
        if run is None:
            return None if self.sole_api_server else await self._view_of_another()
        local = [e for e in self.engines if not e.remote]
        records = await asyncio.to_thread(_read_local, run.stage_dir, local)
        for engine in self.engines:
            if engine.remote:
                answer = await self._ask(engine, run.token)
                records[engine.dp_rank] = (
                    answer if isinstance(answer, str) else stage_progress.records_of(answer)
                )
        return {
            "version": run.version,
            "running_s": round(time.monotonic() - run.started, 3),
            "stall_timeout_s": run.rule.stall_s,
            "engines": [
                {"engine": e.dp_rank, "error": records[e.dp_rank]}
                if isinstance(records[e.dp_rank], str)
                else engine_progress(run.rule, e.dp_rank, records[e.dp_rank])
                for e in self.engines
            ],
        }

    async def _view_of_another(self) -> dict | None:
        """The view of an update another API server of this server runs (engine 0's
        reservation is one for all of them): each engine says what its workers staged
        (`art_stage_progress`), within `ENGINE_READ_S` (an engine of several workers
        receiving a stream between steps does not answer: its entry says so)."""
        answers = await asyncio.gather(*(self._ask(e, None) for e in self.engines))
        staged = [a for a in answers if isinstance(a, dict)]
        if not staged:
            return None
        engines = []
        for e, answer in zip(self.engines, answers, strict=True):
            if isinstance(answer, str):
                engines.append({"engine": e.dp_rank, "error": answer})
            elif answer is None:
                engines.append({"engine": e.dp_rank, "error": "no full-weight stage here"})
            else:
                rule = StallRule(self.stall_s, answer["total_bytes"], answer["total_tensors"])
                engines.append(engine_progress(rule, e.dp_rank, stage_progress.records_of(answer)))
        return {
            "version": staged[0]["version"],
            "running_s": None,
            "stall_timeout_s": self.stall_s,
            "engines": engines,
        }

    async def _ask(self, engine, token: str | None) -> dict | str | None:
        """The engine's `art_stage_progress` answer, or why there is none (a string)."""
        try:
            return await asyncio.wait_for(
                slot_publish.call(self.engine_client, engine, "art_stage_progress", token),
                ENGINE_READ_S,
            )
        except TimeoutError:
            return (
                f"engine {engine.dp_rank} did not answer within {ENGINE_READ_S:g} s (an engine "
                "of several workers answers once the stream it receives between steps is in)"
            )
        except Exception as exc:
            return f"engine {engine.dp_rank} did not say ({type(exc).__name__}: {exc})"

    async def bounded(self, read) -> tuple[bool, object]:
        """(answered, result) of `read()` (a coroutine function reading the engines): awaited
        whole when no update runs (a fresh read: one started during the update may hold the
        state before its commit), else for at most `ENGINE_READ_S`, with at most one read in
        flight (a later call waits on the same one). An update that stalled still runs on an
        engine whose workers block in its receive, until that ends: its cleanup calls
        (`slot_publish.cleanup_pending`) wait on that engine meanwhile."""
        if self.running is None and not slot_publish.cleanup_pending():
            return True, await read()
        if self._read is None or self._read.done():
            self._read = asyncio.ensure_future(read())
        with contextlib.suppress(asyncio.TimeoutError):
            return True, await asyncio.wait_for(asyncio.shield(self._read), ENGINE_READ_S)
        return False, None


def _read_local(stage_dir: Path, engines) -> dict[int, dict | str]:
    """Each local engine's workers' records (the marker directories are made when the stage
    is, and go with it: an update that just ended shows none)."""
    out: dict[int, dict | str] = {}
    for engine in engines:
        markers = Path(stage_dir) / staging.marker_dir_name(engine.dp_rank)
        out[engine.dp_rank] = stage_progress.read(markers)
    return out
