"""One host read of the token counts per blocking dispatch (issue 38 item 4).

`Buffer` exchanges every rank's token count on the host before a blocking dispatch (it must:
growing the buffer is collective, and uneven counts must raise on every rank before anything
moves). The backend's preprocess used to read and compare them again; now the Buffer says it
did (`token_counts_checked`) and the backend does not read them a second time. Real gloo
ranks with the torch backend; the CUDA backend's side is in test_cuda_binding.py.
"""

from __future__ import annotations

import torch
from support.train_ranks import run_ranks


def _recorded_preprocess_calls(rank: int, world: int) -> list[dict]:
    import torch.distributed as dist

    import hybridep

    buf = hybridep.Buffer(dist.group.WORLD, 8, 16, 2, backend="torch")
    calls, inner = [], buf.backend.preprocess

    def recording(routing_map, **kwargs):
        calls.append(dict(kwargs))
        return inner(routing_map, **kwargs)

    buf.backend.preprocess = recording
    gen = torch.Generator().manual_seed(rank)
    routing = torch.rand(6, world * 2, generator=gen) < 0.5
    hidden = torch.randn(6, 8, generator=gen).to(torch.bfloat16)
    probs = torch.rand(6, world * 2, generator=gen) * routing
    for budget in (None, 32):  # blocking, then a static budget
        buf.dispatch_with_permute(
            hidden=hidden, routing_map=routing, probs=probs, num_of_experts_per_rank=2,
            pad_multiple=4, num_permuted_tokens=budget,
        )  # fmt: skip
    return calls


def test_the_buffer_tells_the_backend_it_compared_the_counts_when_blocking():
    for calls in run_ranks(_recorded_preprocess_calls, world_size=2):
        assert [c["token_counts_checked"] for c in calls] == [True, False], calls
