"""What one worker knows: the plugin's state, one object per worker.

It hangs on the worker's model runner (`compat.attach_state`), the object every worker-side
hook can reach: the worker's RPCs (`worker.model_runner`) and the runner's own patched
methods. A worker's LoRA manager is given the same object when an update commits, so vLLM's
adapter loader (patched on the manager) finds the committed weights. Tests build a fresh
`WorkerState` instead of resetting anything.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from art_vllm_plugin import compat


@dataclass
class StagedUpdate:
    lora_int_id: int
    model: Any = None  # packed CPU LoRAModel once staged
    writes: Any = None  # `slot_writes.SlotWrites`: what the commit writes, once staged
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class Undo:
    """What a commit replaced on this worker, to put back if another worker failed."""

    lora_int_id: int
    committed: Any
    registered: Any
    #: The worker's label before the commit (put back with the weights).
    label: str | None = None


@dataclass
class StagedBase:
    """A full-weight update read into host memory, waiting for its commit."""

    tensors: dict | None = None  # HF name -> tensor, once staged
    error: str | None = None
    streamed: bool = False  # came as a stream (no files to read it again from)
    #: A stream's stage: this worker's shard (`shard_stage.ShardStage`), committed by
    #: `shard_commit`; None for files (read whole, written through vLLM's layerwise reload).
    shard: Any = None


@dataclass
class BaseUndo:
    """What a full-weight commit replaced: where the previous weights can be read again
    (`held`: the shard of a streamed version, `shard_stage.ShardStage`, else `previous_dir`,
    else None: the served model's own files) and the worker's label before it."""

    previous_dir: str | None
    label: str | None
    held: Any = None


@dataclass
class WorkerState:
    staged: dict[str, StagedUpdate] = field(default_factory=dict)  # by update token
    undo: dict[str, Undo] = field(default_factory=dict)
    #: Full-weight updates staged, and the undo of those committed and not final (by token).
    staged_base: dict[str, StagedBase] = field(default_factory=dict)
    undo_base: dict[str, BaseUndo] = field(default_factory=dict)
    #: The current base version's shard when it came as a stream (its only copy to revert
    #: to, `shard_stage.ShardStage`); None when it can be read from files.
    held_base: Any = None
    #: This worker's parameters in their loaded form (`shard_stage.layout`), made once.
    shard_layout: Any = None
    #: Test-only fault armed by `art_test_inject_fault` ("commit" or "stage").
    fault: str | None = None
    #: Each updated slot's committed LoRAModel (by LoRA id): what vLLM's loader returns.
    committed: dict[int, Any] = field(default_factory=dict)
    #: The job queue of each staging lane whose thread started (`stager`).
    stage_jobs: dict[str, queue.SimpleQueue] = field(default_factory=dict)
    #: Route capture of this worker's V1 runner (`--art-routes`), once its model is loaded.
    routes: Any = None
    #: Held by a forward and by a slot swap: neither runs inside the other (`forward_labels`).
    weights_lock: threading.RLock = field(default_factory=threading.RLock)
    #: The policy label of the weights this worker holds now; None: the start weights.
    label: str | None = None
    #: The label the last forward ran with (its sampled output carries it).
    forward_label: str | None = None
    #: Results of the rides the last forward ran before it, until its sampled output
    #: carries them (`step_rides`).
    forward_rides: list | None = None


def worker_state(worker_or_runner) -> WorkerState:
    """The worker's state, given the worker or its model runner (created on first use)."""
    home = compat.worker_model_runner(worker_or_runner) or worker_or_runner
    state = compat.attached_state(home)
    if state is None:
        state = compat.attach_state(home, WorkerState())
    return state


def lora_manager_state(worker_manager) -> WorkerState | None:
    """The state of the worker a LoRA manager belongs to, once an update committed there
    (`lora_slot_writer` attaches it); None before: vLLM's loader then runs unchanged."""
    return compat.attached_state(worker_manager)
