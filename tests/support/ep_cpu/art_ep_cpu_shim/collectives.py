"""`all_gatherv` / `reduce_scatterv` for vLLM's `CpuCommunicator`, on `torch.distributed`.

Each takes the communicator as `self` (they are set on the class: see the package docstring).
`sizes[r]` is rank r's share along the collective's dimension; None means equal shares.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gather_one(self, tensor: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
    world = self.world_size
    tensor = tensor.contiguous()
    if sizes is None:
        out = tensor.new_empty((world * tensor.shape[0], *tensor.shape[1:]))
        dist.all_gather_into_tensor(out, tensor, group=self.device_group)
        return out
    if len(sizes) != world or tensor.shape[0] != sizes[self.rank_in_group]:
        raise ValueError(
            f"all_gatherv: rank {self.rank_in_group} holds {tensor.shape[0]} rows, sizes {sizes}"
        )
    peak = max(sizes)
    padded = tensor.new_zeros((peak, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    out = tensor.new_empty((world * peak, *tensor.shape[1:]))
    dist.all_gather_into_tensor(out, padded, group=self.device_group)
    return torch.cat([out[r * peak : r * peak + sizes[r]] for r in range(world)])


def all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
    """Rows of every rank, in rank order (dim 0 only, as vLLM's CUDA communicator)."""
    if dim != 0:
        raise NotImplementedError("only dim 0 all-gatherv is supported")
    if isinstance(input_, torch.Tensor):
        return _gather_one(self, input_, sizes)
    return [_gather_one(self, t, sizes) for t in input_]


def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None):
    """The sum over ranks of `input_`, of which this rank keeps its share along `dim`."""
    if dim < 0:
        dim += input_.dim()
    summed = input_.movedim(0, dim).contiguous().clone()
    dist.all_reduce(summed, group=self.device_group)
    rank = self.rank_in_group
    if sizes is None:
        share = summed.shape[0] // self.world_size
        start = rank * share
    else:
        share, start = sizes[rank], sum(sizes[:rank])
    return summed[start : start + share].movedim(0, dim).contiguous()


def reduce_scatterv_into_output(
    self, input_: torch.Tensor, output: torch.Tensor, dim: int = -1, sizes=None
):
    output.copy_(reduce_scatterv(self, input_, dim, sizes))
    return output
