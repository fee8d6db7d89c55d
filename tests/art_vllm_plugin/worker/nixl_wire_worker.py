"""One worker of the `art_nixl` wire test, in a process of its own (no vLLM): the receiving end
(`art_vllm_plugin.worker.nixl_receiver.NixlReceiver`) joined to the trainer's store.

Run by `test_nixl_wire.py` (`LocalWorkers`): `python nixl_wire_worker.py --port P --rank R
--workers N --stall S --out DIR`. It joins (its agent, the trainer's, one registered receive
buffer), sets `test/joined/<rank>`, then for each job `k` (`test/job/<k>`: the plan and the
request's digest, as the server's update info carries them, and a stall deadline for this
stream when the test sets one; or `{"stop": true}`) receives one
stream, saves what arrived to `DIR/<k>-<rank>.pt`, and answers `test/result/<k>/<rank>`:
`{"digest": ...}` or `{"error": type name, "message": ...}`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from types import SimpleNamespace

import torch

from art_vllm_plugin.worker.nixl_receiver import NixlReceiver


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--port", "--rank", "--workers"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--stall", type=float, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    store = torch.distributed.TCPStore(
        "127.0.0.1", args.port, is_master=False, timeout=datetime.timedelta(seconds=300)
    )
    receiver = NixlReceiver(store, args.rank, args.workers, "cpu", args.stall)
    store.set(f"test/joined/{args.rank}", b"1")
    k = 0
    while True:
        store.wait([f"test/job/{k}"])
        job = json.loads(store.get(f"test/job/{k}"))
        if job.get("stop"):
            break
        plan = job["plan"]
        info = SimpleNamespace(
            names=plan["names"],
            dtype_names=plan["dtypes"],
            shapes=plan["shapes"],
            round=plan["round"],
            digest=job["digest"],
        )
        receiver.stall_timeout_s = job["stall_s"] or args.stall
        got: dict[str, torch.Tensor] = {}
        try:
            result = {"digest": receiver.receive(info, got.__setitem__)}
        except Exception as exc:
            result = {"error": type(exc).__name__, "message": str(exc)}
        torch.save(got, os.path.join(args.out, f"{k}-{args.rank}.pt"))
        store.set(f"test/result/{k}/{args.rank}", json.dumps(result).encode())
        k += 1
    receiver.close()


if __name__ == "__main__":
    main()
