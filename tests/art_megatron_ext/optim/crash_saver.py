"""Crash driver for test_checkpoint_crash.py (run as a script, not collected by pytest).

Why a separate process that forks: importing torch takes seconds on the shared box, so one
driver imports it once and then, for each kill, forks a saver child that continues the
checkpoint from the last committed step, saving in a loop and reporting each committed step
through a pipe (`--async-save`: saves on the background thread). After the child's first
commit the driver SIGKILLs it at a random moment, loads the directory and prints one JSON
line of facts per kill; the test asserts on them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import struct
import time
from pathlib import Path

import torch

from art_megatron_ext.optim import AsyncCheckpointer, CheckpointConfig, ShardedCheckpointer

BLOCKS, BLOCK_LEN = 8, 2048


def state_for(step: int) -> dict:
    """Every tensor encodes the step, so a mix of two generations is detectable."""
    return {
        "step": step,
        "blocks": [torch.full((BLOCK_LEN,), float(step * 100 + i)) for i in range(BLOCKS)],
        "tag": f"step-{step}",
    }


def content_matches(state: dict, step: int) -> bool:
    expected = state_for(step)
    return (
        state["step"] == step
        and state["tag"] == expected["tag"]
        and len(state["blocks"]) == BLOCKS
        and all(torch.equal(a, b) for a, b in zip(state["blocks"], expected["blocks"], strict=True))
    )


def saver_child(directory: Path, write_fd: int, async_save: bool) -> None:
    """Runs in the forked child until killed.

    With `async_save` the saves run on the background thread: the loop reports a step when
    its commit completes, and overwrites its own tensors right after each snapshot (as a
    training step would), so a save that wrote live tensors instead of the snapshot would
    commit wrong content.
    """
    checkpointer = ShardedCheckpointer(CheckpointConfig(directory))
    loaded = checkpointer.load()
    step = loaded.step if loaded is not None else 0
    background = AsyncCheckpointer(checkpointer) if async_save else None
    while True:
        step += 1
        if background is None:
            checkpointer.save(state_for(step), step=step, objective="rl")
            os.write(write_fd, struct.pack("<q", step))
            continue
        state = state_for(step)
        saving = background.save(state, step=step, objective="rl")
        saving.add_done_callback(
            lambda done, step=step: (
                done.exception() is None and os.write(write_fd, struct.pack("<q", step))
            )
        )
        for block in state["blocks"]:
            block.fill_(-1.0)


def first_report(read_fd: int) -> bytes:
    """Block until the child reported its first commit (8 bytes), or exited."""
    data = b""
    while len(data) < 8 and (chunk := os.read(read_fd, 8 - len(data))):
        data += chunk
    return data


def last_reported(read_fd: int, data: bytes = b"") -> int | None:
    while chunk := os.read(read_fd, 65536):
        data += chunk
    usable = len(data) - len(data) % 8
    steps = struct.unpack(f"<{usable // 8}q", data[:usable])
    return steps[-1] if steps else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay", type=float, default=0.08)
    parser.add_argument("--async-save", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    for kill in range(args.kills):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            os.close(read_fd)
            try:
                saver_child(args.dir, write_fd, args.async_save)
            finally:
                os._exit(1)
        os.close(write_fd)
        # The kill moment is counted from the child's first commit, not from the fork: every
        # child makes progress however slow the host is, and the random delay still lands
        # the kill anywhere in the following saves.
        first = first_report(read_fd)
        time.sleep(rng.uniform(0.0, args.max_delay))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        reported = last_reported(read_fd, first)
        os.close(read_fd)
        committed = ShardedCheckpointer(CheckpointConfig(args.dir)).latest()
        listed = {r.name for r in committed.files} if committed else set()
        debris = (
            sorted(
                p.name
                for p in args.dir.glob("*")
                if p.name not in listed and p.name != "CURRENT.json"
            )
            if args.dir.exists()
            else []
        )
        loaded = ShardedCheckpointer(CheckpointConfig(args.dir)).load()
        fact = {
            "kill": kill,
            "killed_by_sigkill": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
            "last_reported": reported,
            "loaded_step": None if loaded is None else loaded.step,
            "content_matches": None
            if loaded is None
            else content_matches(loaded.state, loaded.step),
            "debris": debris,
        }
        print(json.dumps(fact), flush=True)


if __name__ == "__main__":
    main()
