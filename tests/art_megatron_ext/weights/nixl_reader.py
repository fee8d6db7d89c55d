"""A reference reader of the `art_nixl` wire, written from its rules
(`art_protocol.weight_transfer`, section `art_nixl`) and nothing of the serving side: the
training environment has no vLLM, and a second reading of the rules checks the sender against
the rules rather than against the worker that was written with it.

Run by `test_nixl_sender.py`: `python nixl_reader.py --port P --rank R --workers N --device D
--out FILE`. It joins (its agent, the trainer's, one registered buffer of the bucket size on
`D`), sets `test/joined/<rank>`, waits for `test/job` (a plan), sets its ready key, reads
every bucket with a NIXL READ into its buffer, counts it pulled, and writes to FILE (torch)
`{"end": the end record's digest, "digest": the digest of what it read, "tensors": {name:
tensor on the host}, "buckets": n}`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch

from art_protocol import nixl_wire as wire
from art_protocol.nixl_api import new_agent
from art_protocol.weight_transfer import ready_key
from art_protocol.weights_digest import WeightsDigest


def read_bucket(agent, remote: str, trainer, buffer: torch.Tensor, record) -> None:
    address, _, dev_id = trainer.buffers[record.buffer]
    mem = "VRAM" if buffer.is_cuda else "DRAM"
    local = agent.get_xfer_descs(
        [(buffer.data_ptr(), record.used, max(buffer.get_device(), 0))], mem
    )
    source = agent.get_xfer_descs([(address, record.used, dev_id)], trainer.mem)
    handle = agent.initialize_xfer("READ", local, source, remote)
    state = agent.transfer(handle)
    while state == "PROC":
        time.sleep(0)
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"READ of buffer {record.buffer} ended {state}")


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--port", "--rank", "--workers"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    store = torch.distributed.TCPStore(
        "127.0.0.1", args.port, is_master=False, timeout=datetime.timedelta(seconds=300)
    )
    trainer = wire.TrainerBuffers.from_bytes(store.get(wire.TRAINER_KEY))
    agent = new_agent(f"reader-{args.rank}")
    remote = agent.add_remote_agent(store.get(wire.METADATA_KEY))
    buffer = torch.empty(trainer.bucket_bytes, dtype=torch.uint8, device=args.device)
    registered = agent.register_memory(buffer)
    store.set(f"test/joined/{args.rank}", b"1")

    store.wait(["test/job"])
    plan = json.loads(store.get("test/job"))
    store.set(ready_key(plan["round"], args.rank), b"1")
    parts: dict[int, list[torch.Tensor]] = {}
    n = 0
    while True:
        store.wait([wire.bucket_key(plan["round"], n)])
        record = wire.decode(store.get(wire.bucket_key(plan["round"], n)))
        if not isinstance(record, wire.Bucket):
            break
        read_bucket(agent, remote, trainer, buffer, record)
        host = buffer[: record.used].cpu()
        if store.add(wire.pulled_key(plan["round"], n), 1) == args.workers:
            store.set(wire.all_pulled_key(plan["round"], n), b"1")
        for e in record.entries:
            parts.setdefault(e.index, []).append(host[e.offset : e.offset + e.size].clone())
        n += 1
    tensors, digest = {}, WeightsDigest()
    for i, chunks in parts.items():
        name, dtype, shape = plan["names"][i], plan["dtypes"][i], plan["shapes"][i]
        flat = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
        digest.update(name, dtype, shape, flat.numpy())
        tensors[name] = flat.view(getattr(torch, dtype)).reshape(shape)
    end = record.digest if isinstance(record, wire.End) else f"abort: {record.reason}"
    result = {"end": end, "digest": digest.hexdigest(), "tensors": tensors, "buckets": n}
    torch.save(result, args.out)
    agent.deregister_memory(registered)


if __name__ == "__main__":
    main()
