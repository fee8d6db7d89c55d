"""Checks every receive path runs on each tensor of an update: one definition, one speed.

`all_finite` is the NaN/infinity check of full-weight updates (files read by the API server,
a stream's tensors on the worker, whatever engine delivered them). Needs torch.
"""

from __future__ import annotations

import torch


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN and no infinity in `tensor`, by its minimum and maximum (one pass, nothing
    allocated; NaN propagates into both, an infinity is one of them): 3.0 GB/s on float32 and
    1.6 on bfloat16 here against 0.2 for `isfinite(t).all()`, which was the slowest step of a
    worker's receive. Dtypes without `aminmax` (float8) are checked as float32."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    try:
        low, high = torch.aminmax(tensor)
    except (RuntimeError, NotImplementedError):
        low, high = torch.aminmax(tensor.to(torch.float32))
    return bool(torch.isfinite(low) & torch.isfinite(high))
