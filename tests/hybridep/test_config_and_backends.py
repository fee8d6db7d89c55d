"""Typed tunables and backend selection (single process, no process group needed)."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from hybridep import BackendUnavailable, HybridEPConfig, select_backend
from hybridep.backends import HybridEPBackend, cuda_unavailable_reason
from hybridep.backends.torch_ref import TorchBackend


def test_config_defaults_are_valid_and_frozen():
    config = HybridEPConfig()
    assert config.token_chunk == 64
    with pytest.raises(AttributeError):
        config.num_sms_dispatch = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_sms_dispatch", 0),
        ("num_sms_preprocessing", -1),
        ("num_blocks_permute", -1),
        ("token_chunk", 1.5),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        HybridEPConfig(**{field: value})


def test_megatron_kwargs_overlay_the_base_config():
    base = HybridEPConfig(num_sms_combine=4)
    config = HybridEPConfig.from_megatron_kwargs(
        num_sms_dispatch_api=24, num_sms_preprocessing_api=108, num_blocks_permute=None, base=base
    )
    assert (config.num_sms_dispatch, config.num_sms_preprocessing) == (24, 108)
    assert config.num_sms_combine == 4 and config.num_blocks_permute == 0


def test_no_config_field_is_dead():
    """Every tunable reaches a launch: a field the kernels ignore would be a silent no-op."""
    import inspect

    from hybridep.backends import cuda

    source = inspect.getsource(cuda)
    names = [f.name for f in fields(HybridEPConfig)]
    assert [n for n in names if f"config.{n}" not in source] == []


def test_torch_backend_is_selected_by_name():
    assert select_backend("torch", None) is TorchBackend
    missing = [
        m
        for m in ("preprocess", "dispatch", "permute", "unpermute", "combine")
        if not callable(getattr(TorchBackend, m, None))
    ]
    assert not missing and hasattr(HybridEPBackend, "unavailable_reason")


def test_unknown_backend_name_is_refused():
    with pytest.raises(ValueError, match="'tpu'"):
        select_backend("tpu", None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cuda_backend_raises_on_cpu_and_auto_picks_torch():
    assert "no CUDA device" in cuda_unavailable_reason(None)
    with pytest.raises(BackendUnavailable, match="no CUDA device"):
        select_backend("cuda", None)
    assert select_backend("auto", None) is TorchBackend


def test_cuda_backend_reports_why_when_its_module_is_missing(monkeypatch):
    import hybridep.backends as backends

    monkeypatch.setattr(backends.torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(backends._BACKEND_CLASSES, "cuda", ("hybridep.backends._absent", "X"))
    with pytest.raises(BackendUnavailable, match=r"importing hybridep\.backends\._absent failed"):
        select_backend("cuda", None)
    assert select_backend("auto", None) is TorchBackend


@pytest.mark.parametrize("bad", [0, -1.0, "10", True])
def test_barrier_timeout_is_a_positive_number_of_seconds(bad):
    assert HybridEPConfig().barrier_timeout_s == 60.0
    assert HybridEPConfig(barrier_timeout_s=2.5).barrier_timeout_s == 2.5
    with pytest.raises(ValueError, match="barrier_timeout_s"):
        HybridEPConfig(barrier_timeout_s=bad)
