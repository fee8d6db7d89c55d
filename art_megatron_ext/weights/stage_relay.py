"""Carry the tensors of later pipeline stages to the sender on the first stage.

Why: with pipeline parallelism each stage holds only its own layers (the first stage the
embedding, the last the final norm and output layer), while a full-weight update has one
sender (global rank 0, `stream_hf_weights`). Each stage makes its own tensors whole (its
tensor- and expert-parallel gathers, as without stages); in the pipeline group of the sender,
every later stage then sends them, one at a time, to the sender over that group (name, dtype
and shape first, then the bytes), stage after stage, so the sender hands the sink the whole
model in stage order and holds at most one tensor of another stage at a time. The other
pipeline groups run the same gathers (they are collectives of their stages) and send nothing.

Point-to-point over Megatron's pipeline group (`torch.distributed.send`/`recv`); gloo on CPU,
NCCL on GPUs (the tensors are received on the device of the stage's parameters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

Emit = Callable[[str, torch.Tensor], None]
_END = "\0end"


class StageRelay:
    """This rank's part of the relay: `run(own, emit, count)`."""

    def __init__(self, send: bool, device: torch.device):
        from megatron.core import parallel_state as ps

        self.size = (
            ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
        )
        self.device = device
        # NCCL moves the pickled objects through device memory
        self._on = {"device": device} if device.type == "cuda" else {}
        if self.size == 1:
            return
        self.group = ps.get_pipeline_model_parallel_group()
        self.ranks = torch.distributed.get_process_group_ranks(self.group)
        self.stage = ps.get_pipeline_model_parallel_rank()
        # a sender must sit on the first stage: checked on every rank (all raise together)
        later = torch.tensor([int(send and self.stage > 0)], device=device)
        torch.distributed.all_reduce(later, op=torch.distributed.ReduceOp.MAX)
        if later.item():
            raise ValueError(
                "stream_hf_weights: with pipeline stages the sending rank must be on the first "
                "stage (it hands the sink every stage's tensors); nothing was streamed"
            )
        # only the pipeline group whose first stage sends moves tensors
        first_sends = torch.tensor([int(send and self.stage == 0)], device=device)
        torch.distributed.broadcast(first_sends, src=self.ranks[0], group=self.group)
        self.relays = bool(first_sends.item())

    def run(self, own: Iterator[tuple[str, torch.Tensor]], emit: Emit, count: Emit) -> None:
        """Hand this stage's tensors (`own`) and, on the sender's rank, every later stage's to
        `emit`; `count` records a tensor this rank made but does not emit (a later stage's)."""
        if self.size == 1 or self.stage == 0:
            for name, tensor in own:
                emit(name, tensor)
            if self.size > 1 and self.relays:
                for src in self.ranks[1:]:
                    self._receive_from(src, emit)
            return
        for name, tensor in own:
            count(name, tensor)
            if self.relays:
                self._send(name, tensor)
        if self.relays:
            torch.distributed.send_object_list(
                [_END], dst=self.ranks[0], group=self.group, **self._on
            )

    def _send(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.contiguous()
        meta = [(name, tensor.dtype, tuple(tensor.shape))]
        torch.distributed.send_object_list(meta, dst=self.ranks[0], group=self.group, **self._on)
        torch.distributed.send(tensor, dst=self.ranks[0], group=self.group)

    def _receive_from(self, src: int, emit: Emit) -> None:
        while True:
            meta = [None]
            torch.distributed.recv_object_list(meta, src=src, group=self.group, **self._on)
            if meta[0] == _END:
                return
            name, dtype, shape = meta[0]
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            torch.distributed.recv(tensor, src=src, group=self.group)
            emit(name, tensor)
