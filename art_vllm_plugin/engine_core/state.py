"""What one EngineCore knows: the plugin's state, one object per engine.

It hangs on the engine (`compat.attach_state`) and every patched method and utility call
reaches it through `engine_state(core)`. With data parallelism each engine has its own.
Created on first use, not in `__init__`: EngineCore loads the general plugins inside its own
`__init__`, so a patched `__init__` would miss the engine being built. Tests build a fresh
`EngineCoreState` and attach it to a stand-in engine.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from art_protocol.provenance import decode_label, encode_versions
from art_vllm_plugin import compat, staging
from art_vllm_plugin.engine_core.slot_registry import SlotRecord, SlotRegistry


@dataclass
class StagedInEngine:
    """An update staged on this engine's workers; a full-weight update has the LoRA id
    `slot_registry.BASE_ID` and the name `slot_registry.BASE`."""

    lora_int_id: int
    name: str
    version: int
    ranks: list[int]
    stall_s: float  # step-loop time already spent on this update (the stage call)
    #: When it was staged: one its API server never committed or aborted is abandoned after
    #: `slot_registry.RESERVATION_TTL_S` (`abandoned_updates`).
    at: float = field(default_factory=time.monotonic)
    #: A full-weight stage: its workers' marker directory on this host, where they keep
    #: their progress records, and the update's (bytes, tensors) (`art_stage_progress`).
    markers: str | None = None
    totals: tuple[int, int] | None = None


@dataclass
class CommittedInEngine:
    """What a commit replaced in this engine, until the update is finished everywhere, and
    when it was made (an API server that died between commit and finish leaves one behind;
    it is final after `slot_registry.RESERVATION_TTL_S`)."""

    lora_int_id: int  # `slot_registry.BASE_ID` for a full-weight update
    previous_version: int
    previous_record: SlotRecord | None
    at: float = field(default_factory=time.monotonic)


@dataclass
class SlotUpdates:
    """In-flight updates of this engine and the versions its slots (and its base weights)
    serve."""

    versions: dict[int, int] = field(default_factory=dict)  # lora_int_id -> version
    #: Version of the base weights this engine serves: 0 as loaded, +1 per committed
    #: full-weight update (carried in the label beside the slot versions).
    base_version: int = 0
    #: Where the base weights of `base_version` can be read again (a worker's revert): the
    #: directory of a full-weight update, None for the served model's own files.
    base_path: str | None = None
    updates: int = 0
    failed_commits: int = 0
    staged: dict[str, StagedInEngine] = field(default_factory=dict)
    committed: dict[str, CommittedInEngine] = field(default_factory=dict)
    stalls_ms: deque = field(default_factory=lambda: deque(maxlen=4096))  # stage + commit
    commit_stalls_ms: deque = field(default_factory=lambda: deque(maxlen=4096))


@dataclass
class BatchStamps:
    """Scheduled batches and the labels they were scheduled with (`batch_stamps`)."""

    scheduled: int = 0  # batches scheduled so far
    completed: int = 0  # batches whose outputs were made
    #: id(scheduler output) -> (the engine's label when scheduled, that label with leases)
    pending: OrderedDict[int, tuple[str | None, str | None]] = field(default_factory=OrderedDict)
    output_label: str | None = None
    #: Outputs whose label the worker recorded at the forward, and how many of those differed
    #: from the engine's stamp (the worker's label is used; nonzero means the executor
    #: reordered a swap and a forward).
    worker_labelled: int = 0
    label_mismatches: int = 0
    last_output_t: float | None = None
    busy_step_s: float = 0.0  # sum of intervals between consecutive outputs while busy
    busy_steps: int = 0
    #: The engine's scheduler records labels (`install.install_engine_scheduler`).
    scheduler_stamped: bool = False

    def mean_step_ms(self) -> float | None:
        return self.busy_step_s / self.busy_steps * 1000.0 if self.busy_steps else None


@dataclass
class Rides:
    """Worker work riding the step loop (`step_rides`): queued, boarding the batch being
    scheduled, and riding batches whose output has not come back (by id of the batch)."""

    pending: list = field(default_factory=list)
    boarding: list = field(default_factory=list)
    riding: dict[int, list] = field(default_factory=dict)
    stepped: int = 0  # rides a scheduled batch carried
    swept_at: float = 0.0  # last look for abandoned updates (`abandoned_updates`)
    flushed: int = 0  # rides sent as an RPC because the engine was not stepping


@dataclass
class LeaseLabels:
    """Exact leases pinned on this engine: lease LoRA id -> its fixed version."""

    pinned: dict[int, int] = field(default_factory=dict)

    def extend(self, label: str | None) -> str | None:
        """`label` with every pinned lease id's version added (unchanged when none is)."""
        if not self.pinned:
            return label
        versions, base = decode_label(label)
        return encode_versions({**versions, **self.pinned}, base)

    def current_if_pinned(self, engine_label: str | None) -> str | None:
        """The engine's current label extended with the pinned leases; None when none is
        pinned (vLLM's own stamp then stands)."""
        return self.extend(engine_label) if self.pinned else None


@dataclass
class EngineCoreState:
    updates: SlotUpdates = field(default_factory=SlotUpdates)
    registry: SlotRegistry = field(default_factory=SlotRegistry)
    stamps: BatchStamps = field(default_factory=BatchStamps)
    leases: LeaseLabels = field(default_factory=LeaseLabels)
    rides: Rides = field(default_factory=Rides)
    registry_reads: int = 0  # `art_registry_snapshot` calls
    #: Test-only (ART_TEST_HOOKS=1, `art_test_hold_at_step`): once this many steps have
    #: completed, the engine freezes its running requests itself (then None again).
    hold_at_step: int | None = None
    #: CPUs EngineCore was confined to (`core_pinning`), None when left alone.
    cpu_layout: list[int] | None = None
    cpu_layout_applied: bool = False
    #: `--art-routes`: the MoE layer ids a route row holds (`route_rows`), and how many
    #: layers vLLM's native capture has a slot for; None until the busy loop starts.
    route_layers: list[int] | None = None
    route_total_layers: int = 0
    #: The engine's `/art/metrics` figures pusher (`figures_push`), None with one API server;
    #: decided at the first step.
    figures: Any = None
    figures_decided: bool = False
    #: Stages written on this engine's host for updates whose bytes came in the stage call
    #: (`relayed_stages`): token -> (stage directory, this engine's marker directory).
    relayed: dict[str, tuple[str, str]] = field(default_factory=dict)
    relayed_total: int = 0  # relayed stages written on this engine's host
    #: Engine 0: the commit window held by an API server, or a client's pause or resume
    #: waiting for none (`commit_windows`); None when free.
    commit_window: Any = None

    def drop_relayed(self, token: str) -> bool:
        """Remove the relayed stage of `token`, if any (its update ended or was abandoned)."""
        entry = self.relayed.pop(token, None)
        if entry is None:
            return False
        staging.remove(entry[0])
        return True


def engine_state(core) -> EngineCoreState:
    """This engine's state (created on first use)."""
    state = compat.attached_state(core)
    if state is None:
        state = compat.attach_state(core, EngineCoreState())
    return state


def weight_label(updates: SlotUpdates) -> str:
    """The label of the weights this engine serves: every slot's version and the base's."""
    return encode_versions(updates.versions, updates.base_version)
