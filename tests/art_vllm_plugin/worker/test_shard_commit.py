"""A worker's shard stage and its commit (`worker/shard_stage.py`, `worker/shard_commit.py`),
on a model built here and recorded for reloading as vLLM's loader records a served model.

Why a model of our own: the served tiny model on this CPU build has only two forms (norms
copied, every linear layer and embedding packed for oneDNN and rebuilt: the tp2 server test
shows that), while on a GPU an unquantized linear layer's processing does nothing and its
commit is a copy. Here each form is one module, with vLLM's own weight-processing base class:
- `norm`: no quant method (no processing): a copy;
- `proj`: an unquantized method whose processing leaves the layer as loaded (as
  `UnquantizedLinearMethod` does on CUDA), found so by the probe: a copy;
- `packed`: an unquantized method whose processing sets `cpu_linear` (as on the CPU build):
  rebuilt by vLLM's per-layer steps and processed again.
Each loader takes rows 2:4 of a 4-row checkpoint tensor (a tensor-parallel rank 1 of 2).

Checked: the stage holds the shard only (half of each checkpoint tensor), written through the
model's own loaders on a shadow while the live weights stay as they are; the copy keeps
every tensor's storage (what a CUDA graph captured) with the new values; the rebuilt layer
gets its new processed form in its old storage; a stage made after vLLM's layerwise reload
ran still writes (that reload leaves its wrapper on the recorded loaders, which drops every
tensor outside a reload); a commit failing after its first module leaves no layer armed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from art_vllm_plugin import compat
from art_vllm_plugin.worker import shard_commit, shard_stage

pytestmark = pytest.mark.serve

layerwise = pytest.importorskip("vllm.model_executor.model_loader.reload.layerwise")
base_config = pytest.importorskip("vllm.model_executor.layers.quantization.base_config")


class UnquantizedLinearMethod(base_config.QuantizeMethodBase):
    """Named as vLLM's (the probe looks at the name); processing as on CUDA: nothing."""

    def create_weights(self, layer, *args, **kwargs):
        pass

    def apply(self, layer, *args, **kwargs):
        raise NotImplementedError

    def process_weights_after_loading(self, layer):
        pass


class UnquantizedEmbeddingMethod(UnquantizedLinearMethod):
    """Processing as on the CPU build: a packed copy the forward reads (`cpu_linear`)."""

    def process_weights_after_loading(self, layer):
        packed = layer.weight.data * 2
        layer.cpu_linear = lambda: packed


def _rank1_rows(param, loaded):
    """Rows 2:4 of the checkpoint tensor: tensor-parallel rank 1 of 2."""
    param.data.copy_(loaded.narrow(0, 2, 2))


class _Layer(nn.Module):
    def __init__(self, shape, method=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape), requires_grad=False)
        self.weight.weight_loader = _rank1_rows
        if method is not None:
            self.quant_method = method


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = _Layer((2,))
        self.proj = _Layer((2, 3), UnquantizedLinearMethod())
        self.packed = _Layer((2, 3), UnquantizedEmbeddingMethod())

    def load_weights(self, weights):
        loaded = set()
        for name, tensor in weights:
            param = self.get_submodule(name.rsplit(".", 1)[0]).weight
            param.weight_loader(param, tensor)
            loaded.add(name)
        return loaded


def _checkpoint(value: float) -> dict[str, torch.Tensor]:
    rows = torch.arange(4, dtype=torch.float32)
    return {
        "norm.weight": value + rows,
        "proj.weight": (value + rows)[:, None].repeat(1, 3),
        "packed.weight": (10 * value + rows)[:, None].repeat(1, 3),
    }


@pytest.fixture
def worker():
    model = _Model()
    model.load_weights(_checkpoint(1.0).items())
    for layer in (model.proj, model.packed):
        layer.quant_method.process_weights_after_loading(layer)
    layerwise.record_metadata_for_reloading(model)
    config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    runner = SimpleNamespace(vllm_config=config, get_model=lambda: model, device="cpu")
    return SimpleNamespace(model_runner=runner, model=model, rank=1)


def _stage(model, value: float) -> shard_stage.ShardStage:
    stage = shard_stage.ShardStage(model, shard_stage.layout(model), pin=False)
    stage.load_weights(_checkpoint(value).items())
    stage.seal()  # as after a stream: values only, nothing of the live modules of then
    assert stage.shadow is None
    assert all(type(t) is torch.Tensor and not t.__dict__ for t in stage.tensors.values())
    return stage


def test_the_stage_holds_the_shard_and_leaves_the_live_weights(worker):
    model = worker.model
    stage = _stage(model, 2.0)
    whole = sum(t.numel() * t.element_size() for t in _checkpoint(2.0).values())
    assert stage.nbytes == shard_stage.layout_bytes(shard_stage.layout(model)) == whole // 2
    assert stage.ignored == [] and stage.unwritten() == []
    staged = {m: s["weight"] for m, s in stage.by_module()}
    assert staged[model.norm].tolist() == [4.0, 5.0]
    assert staged[model.packed].tolist() == [[22.0] * 3, [23.0] * 3]
    assert model.norm.weight.tolist() == [3.0, 4.0]  # the live weights are as they were


def test_each_module_takes_the_path_its_form_allows(worker):
    model = worker.model
    chosen = shard_commit.paths(_stage(model, 2.0))
    assert chosen[id(model.norm)] == ("copy", "no weight processing")
    assert chosen[id(model.proj)] == (
        "copy",
        "UnquantizedLinearMethod processing leaves it as loaded",
    )
    assert chosen[id(model.packed)] == (
        "rebuild",
        "UnquantizedEmbeddingMethod processing sets cpu_linear",
    )


def test_the_commit_copies_in_place_and_rebuilds_the_packed_layer(worker):
    model = worker.model
    served = {name: p for name, p in model.named_parameters()}
    pointers = {name: p.data_ptr() for name, p in served.items()}
    done = shard_commit.commit(worker, _stage(model, 2.0))
    assert done["copy"]["modules"] == 2 and done["rebuild"]["modules"] == 1
    after = dict(model.named_parameters())
    assert all(after[n] is served[n] and after[n].data_ptr() == pointers[n] for n in served)
    assert model.norm.weight.tolist() == [4.0, 5.0]
    assert model.proj.weight.tolist() == [[4.0] * 3, [5.0] * 3]
    assert model.packed.weight.tolist() == [[22.0] * 3, [23.0] * 3]
    assert model.packed.cpu_linear().tolist() == [[44.0] * 3, [46.0] * 3]  # processed again


def test_a_stage_after_vllms_layerwise_reload_still_writes(worker):
    model = worker.model
    compat.reload_weights_in_place(worker, iter(_checkpoint(3.0).items()))
    assert model.norm.weight.tolist() == [5.0, 6.0]
    stage = _stage(model, 4.0)
    assert stage.ignored == []
    shard_commit.commit(worker, stage)
    assert model.norm.weight.tolist() == [6.0, 7.0]
    assert model.packed.cpu_linear().tolist() == [[84.0] * 3, [86.0] * 3]


def test_a_commit_failing_after_its_first_module_leaves_no_layer_armed(worker):
    model = worker.model
    with pytest.raises(shard_commit.InjectedCommitFailure):
        shard_commit.commit(worker, _stage(model, 2.0), fail_after_first=True)
    assert not any(layerwise.get_layerwise_info(m).can_load() for m in model.modules())
    assert model.proj.weight.tolist() == [[3.0] * 3, [4.0] * 3]  # not reached: as loaded
