"""What the weight-stream tests do on every rank: collect a stream, randomize a model.
Not collected by pytest."""

from __future__ import annotations

import torch


def collect_stream(model, shape, **kwargs) -> tuple[list, object]:
    """([(hf name, numpy array)], receipt) of `stream_hf_weights(model, shape)`. numpy, not
    torch: the result crosses the process boundary, where torch tensors travel as shared
    memory that dies with the rank's process."""
    from art_megatron_ext.weights import stream_hf_weights

    got: list[tuple[str, torch.Tensor]] = []
    receipt = stream_hf_weights(model, shape, lambda n, t: got.append((n, t.clone())), **kwargs)
    return [(n, t.numpy()) for n, t in got], receipt


def randomize_(model, rank: int) -> None:
    """Every parameter random, different on every rank (each EP rank's experts differ)."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * rank + i)))
