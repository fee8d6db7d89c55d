"""The NaN/infinity check every full-weight receive path runs (art_vllm_plugin.tensor_checks):
a NaN and either infinity are found in each float dtype an update may carry, by min/max."""

from __future__ import annotations

import pytest
import torch

from art_vllm_plugin.tensor_checks import all_finite


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn]
)
def test_the_finite_check_finds_a_nan_and_either_infinity(dtype):
    clean = torch.linspace(-3, 3, 300).to(dtype)
    assert all_finite(clean) and all_finite(clean[:0])
    bad_values = [float("nan")] + ([] if dtype == torch.float8_e4m3fn else [float("inf"), -1e999])
    for bad in bad_values:
        tensor = clean.clone()
        tensor[123] = bad
        assert not all_finite(tensor), (dtype, bad)
