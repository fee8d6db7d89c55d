"""How `grouped_gemm` picks its backend: once per process, honouring the kernel build cache,
never falling back from an explicit request (CPU; the GPU and the machine are stood in for).

The machine probe (CUTLASS headers, a valid cached build, nvcc on PATH) reads the file system,
so it must run once per process and input class, not once per GEMM; a cached build loads
without nvcc, so `auto` must take it; `cutlass` asked for where it cannot run must raise with
the reason and what to set.
"""

from __future__ import annotations

import importlib
import logging
from types import SimpleNamespace

import pytest
import torch

from art_megatron_ext.ops import GroupedGemmBackendError

gg = importlib.import_module("art_megatron_ext.ops.grouped_gemm")  # the module, not the op
cg = importlib.import_module("art_megatron_ext.ops.cutlass_grouped_gemm")


@pytest.fixture(autouse=True)
def fresh_backend_cache():
    """Each test starts and ends with nothing resolved (the cache is per process)."""
    gg.reset_backend_cache()
    yield
    gg.reset_backend_cache()


class _FakeSm90Tensor:
    """What backend resolution reads of a bf16 tensor on an sm_90 GPU."""

    is_cuda, dtype, device = True, torch.bfloat16, "cuda:0"


@pytest.fixture
def sm90_machine(monkeypatch):
    """An sm_90 GPU with CUTLASS headers; `probes` counts each file-system probe. Tests set
    `state.nvcc` (found on PATH?) and `state.cached` (a valid cached build?)."""
    state = SimpleNamespace(nvcc=True, cached=False, probes={"which": 0, "cutlass": 0, "cache": 0})

    def which(name):
        state.probes["which"] += 1
        return f"/usr/bin/{name}" if state.nvcc else None

    def find_cutlass():
        state.probes["cutlass"] += 1
        return SimpleNamespace(version="4.2.0", include_dirs=())

    def find_cached(spec, config=None):
        state.probes["cache"] += 1
        return object() if state.cached else None

    monkeypatch.setattr(gg.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(cg.shutil, "which", which)
    monkeypatch.setattr(cg, "find_cutlass", find_cutlass)
    monkeypatch.setattr(cg.kbuild, "find_cached", find_cached)
    monkeypatch.delenv(cg.CUTLASS_DIR_ENV, raising=False)
    monkeypatch.delenv(cg.kbuild.CACHE_DIR_ENV, raising=False)
    return state


def _cpu_operands():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(6, 16, generator=gen), torch.randn(2, 16, 8, generator=gen)


def test_auto_probes_the_machine_once_across_many_grouped_gemm_calls(
    sm90_machine, monkeypatch, caplog
):
    """Five GEMMs on inputs CUTLASS could take (the tensor check is stood in for, so they run
    on CPU through torch): one probe of each kind and one log line naming the choice and why."""
    sm90_machine.nvcc = False  # no nvcc and no cached build: auto must take torch
    monkeypatch.setattr(gg, "_tensor_reason", lambda x, w: None)
    x, w = _cpu_operands()
    with caplog.at_level(logging.INFO, logger=gg.logger.name):
        outs = [gg.grouped_gemm(x, w, [4, 2]) for _ in range(5)]
    assert sm90_machine.probes == {"which": 1, "cutlass": 1, "cache": 1}
    torch.testing.assert_close(outs[-1], torch.cat([x[:4] @ w[0], x[4:] @ w[1]]))
    records = [r for r in caplog.records if r.name == gg.logger.name]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert "'torch'" in message and "nvcc" in message and "no valid cached build" in message


def test_a_valid_cached_build_is_used_without_nvcc(sm90_machine, caplog):
    sm90_machine.nvcc, sm90_machine.cached = False, True
    x = w = _FakeSm90Tensor()
    with caplog.at_level(logging.INFO, logger=gg.logger.name):
        assert gg.resolve_backend("auto", x, w) == "cutlass"
        assert gg.resolve_backend("cutlass", x, w) == "cutlass"
    assert sm90_machine.probes["which"] == 0  # the cache answered; PATH was never searched
    assert [r.getMessage() for r in caplog.records].count(
        "grouped_gemm(backend='auto') uses 'cutlass' for cuda:0 torch.bfloat16 inputs: "
        "sm_90 GPU, bfloat16, CUTLASS headers and a cached build or nvcc"
    ) == 1


def test_requested_cutlass_without_nvcc_or_cache_raises_naming_what_to_set(sm90_machine):
    sm90_machine.nvcc = False
    x = w = _FakeSm90Tensor()
    for _ in range(2):  # raised on every call, from the cached answer
        with pytest.raises(GroupedGemmBackendError) as err:
            gg.resolve_backend("cutlass", x, w)
        message = str(err.value)
        assert "backend='cutlass'" in message and "nvcc" in message
        assert cg.kbuild.CACHE_DIR_ENV in message and "backend='auto' or 'torch'" in message
    assert sm90_machine.probes == {"which": 1, "cutlass": 1, "cache": 1}


def test_requested_cutlass_without_headers_names_the_override(sm90_machine, monkeypatch):
    def no_headers():
        raise cg.CutlassHeadersMissing(f"CUTLASS headers not found: ${cg.CUTLASS_DIR_ENV} unset")

    monkeypatch.setattr(cg, "find_cutlass", no_headers)
    with pytest.raises(GroupedGemmBackendError, match=r"\$ART_CUTLASS_DIR"):
        gg.resolve_backend("cutlass", _FakeSm90Tensor(), _FakeSm90Tensor())


def test_setting_an_override_probes_again(sm90_machine, monkeypatch, tmp_path):
    """The answer is cached per `$ART_CUTLASS_DIR` / `$ART_PIPELINE_KERNEL_CACHE` value."""
    x = w = _FakeSm90Tensor()
    gg.resolve_backend("auto", x, w)
    gg.resolve_backend("auto", x, w)
    monkeypatch.setenv(cg.kbuild.CACHE_DIR_ENV, str(tmp_path))
    gg.resolve_backend("auto", x, w)
    assert sm90_machine.probes["cache"] == 2


def test_cpu_inputs_never_probe_the_machine(sm90_machine):
    x, w = _cpu_operands()
    for _ in range(3):
        gg.grouped_gemm(x, w, [3, 3])
    with pytest.raises(GroupedGemmBackendError, match="needs an sm_90 GPU"):
        gg.grouped_gemm(x, w, [3, 3], backend="cutlass")
    assert sm90_machine.probes == {"which": 0, "cutlass": 0, "cache": 0}
