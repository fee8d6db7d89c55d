"""The in-place write of a full-weight update (`compat.reload_weights_in_place`), run through
vLLM's own layerwise reload on a two-layer model built here.

Why a model of our own: the served model's layers are too large to read by hand, and what is
checked is the reload's bookkeeping, which vLLM keeps per layer whatever the layer is. Each
layer has one fused parameter loaded in two halves (as `gate_up_proj` is from `gate_proj` and
`up_proj`), and a weight-processing method (a vLLM `QuantizeMethodBase`, as every linear layer
has) that reads vLLM's current config, as FP8 MoE kernels and DeepEP all2all set-up do.

Checked:
- the write runs inside vLLM's config context, with the runner's config, as vLLM wraps its
  own reloads (`set_current_vllm_config`);
- a write that raises inside `load_weights` in the middle of a layer leaves every layer with
  the tensors the forward reads (the same storage) and no layer armed, and the old weights
  written back after it are exact; without the undo the half-loaded layer would be processed
  from a mix of both passes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from art_vllm_plugin import compat

pytestmark = pytest.mark.serve

layerwise = pytest.importorskip("vllm.model_executor.model_loader.reload.layerwise")
base_config = pytest.importorskip("vllm.model_executor.layers.quantization.base_config")
vllm_config_module = pytest.importorskip("vllm.config.vllm")


class _Processing(base_config.QuantizeMethodBase):
    """Weight processing that needs vLLM's current config (it raises without one)."""

    def __init__(self, seen: list):
        self.seen = seen

    def create_weights(self, layer, *args, **kwargs):  # the layer makes its own
        pass

    def apply(self, layer, *args, **kwargs):
        raise NotImplementedError

    def process_weights_after_loading(self, layer):
        self.seen.append(vllm_config_module.get_current_vllm_config())


def _load_half(param, loaded_weight, half: int):
    """A fused parameter's loader: row `half` of the parameter (as gate or up rows)."""
    param.data[half].copy_(loaded_weight)


class _Fused(nn.Module):
    def __init__(self, seen: list):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2, 4), requires_grad=False)
        self.weight.weight_loader = _load_half
        self.quant_method = _Processing(seen)


class _Model(nn.Module):
    """`layers.<i>.gate` and `layers.<i>.up` load the two halves of layer i's weight."""

    def __init__(self):
        super().__init__()
        self.seen: list = []
        self.layers = nn.ModuleList([_Fused(self.seen), _Fused(self.seen)])

    def load_weights(self, weights):
        loaded = set()
        for name, tensor in weights:
            _, i, half = name.split(".")
            param = self.layers[int(i)].weight
            param.weight_loader(param, tensor, ("gate", "up").index(half))
            loaded.add(name)
        return loaded


def _checkpoint(value: float) -> dict[str, torch.Tensor]:
    return {
        f"layers.{i}.{half}": torch.full((4,), value + 10 * i + h)
        for i in range(2)
        for h, half in enumerate(("gate", "up"))
    }


def _values(model: _Model) -> list[list[float]]:
    return [layer.weight.data.tolist() for layer in model.layers]


@pytest.fixture
def worker():
    """A worker whose runner serves `_Model`, loaded from the checkpoint of 1.0 and recorded
    for reloading as vLLM's loader does at start."""
    model = _Model()
    model.load_weights(_checkpoint(1.0).items())
    layerwise.record_metadata_for_reloading(model)
    config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    runner = SimpleNamespace(
        vllm_config=config, get_model=lambda: model, device=torch.device("cpu")
    )
    return SimpleNamespace(model_runner=runner, model=model)


def test_the_write_runs_in_the_runners_config_context(worker):
    compat.reload_weights_in_place(worker, iter(_checkpoint(2.0).items()))
    assert _values(worker.model) == [
        [[2.0] * 4, [3.0] * 4],
        [[12.0] * 4, [13.0] * 4],
    ]
    config = worker.model_runner.vllm_config
    assert worker.model.seen and all(seen is config for seen in worker.model.seen)


def _failing_mid_layer(weights: dict):
    """Every tensor up to `layers.1.gate`, then a failure: layer 1 holds half a pass."""
    for name, tensor in weights.items():
        yield name, tensor
        if name == "layers.1.gate":
            raise RuntimeError("the stream broke in the middle of layer 1")


def test_a_write_failing_in_the_middle_of_a_layer_is_undone_exactly(worker):
    model = worker.model
    kernel = [layer.weight for layer in model.layers]  # what the forward reads
    with pytest.raises(RuntimeError, match="middle of layer 1"):
        compat.reload_weights_in_place(worker, _failing_mid_layer(_checkpoint(5.0)))
    # every layer holds the tensors the forward reads, and no layer is left armed
    assert [layer.weight for layer in model.layers] == kernel
    assert not any(layerwise.get_layerwise_info(m).can_load() for m in model.modules())
    assert _values(model)[1] == [[11.0] * 4, [12.0] * 4]  # layer 1 was never written
    # the old weights written back are exact, in the same storage
    compat.reload_weights_in_place(worker, iter(_checkpoint(1.0).items()))
    assert _values(model) == [[[1.0] * 4, [2.0] * 4], [[11.0] * 4, [12.0] * 4]]
    assert all(a is b for a, b in zip((m.weight for m in model.layers), kernel, strict=True))
