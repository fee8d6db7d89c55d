"""Export on several ranks hands the object collectives host tensors only.

Why: `gather_object` / `all_gather_object` pickle their payload; a pickled CUDA tensor is
recreated on its source GPU index by the receiver, which fails where each process sees one
GPU and otherwise allocates on a peer's GPU. These CPU tests make the LoRA tensors look like
GPU tensors to the export (a CPU tensor subclass that reports `cuda:1` until it is copied to
the host), run `export_peft` and `collect_peft_tensors(dst=None)` on 2 gloo ranks (PP=2, so
both ranks send pieces), and record what each object collective is handed.
"""

from __future__ import annotations

import pytest
import torch
from support.gpt_shapes import SMALL
from support.train_ranks import run_ranks


def _is_host_copy(func, args, kwargs) -> bool:
    if func is torch.Tensor.cpu:
        return True
    if func is not torch.Tensor.to:
        return False
    targets = [*args[1:], kwargs.get("device")]
    return any(str(t) == "cpu" for t in targets if isinstance(t, (str, torch.device)))


class _DeviceResident(torch.Tensor):
    """A CPU tensor that reports itself as living on `cuda:1` (what a LoRA tensor on a GPU
    looks like to export) until `.to("cpu")` / `.cpu()` copies it into a plain tensor."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 1)

    @property
    def is_cuda(self) -> bool:
        return True

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_host_copy(func, args, kwargs):
            return args[0].as_subclass(torch.Tensor).clone()
        return super().__torch_function__(func, types, args, kwargs)


def _tensors_in(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            yield from _tensors_in(value)


def _plain(obj):
    """The payload with every tensor as a plain tensor (what the real collective is given
    after the check, so the ranks stay in step even when the check fails)."""
    if torch.is_tensor(obj):
        return obj.as_subclass(torch.Tensor)
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def _worker(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state

    from art_megatron_ext.lora import LoraConfig, attach_lora, iter_lora_sites
    from art_megatron_ext.lora import export as export_mod
    from art_megatron_ext.lora.cpu_runtime import cpu_megatron
    from art_megatron_ext.lora.padding import logical_view
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    d = torch.distributed
    parallel_state.initialize_model_parallel(1, world_size)
    saved = {name: getattr(d, name) for name in ("gather_object", "all_gather_object")}
    bad: list[str] = []
    handed: list[int] = []
    try:
        with cpu_megatron():
            torch.manual_seed(0)
            model = build_gpt(GptShape(**SMALL), pipeline_parallel=world_size)
            attach_lora(model, LoraConfig(rank=4, alpha=8.0))
            g = torch.Generator().manual_seed(rank + 1)
            params = []
            with torch.no_grad():
                for entry in iter_lora_sites(model):
                    view = logical_view(entry.adapter.b)
                    view.copy_(torch.randn(view.shape, generator=g))
                    params += [entry.adapter.a, entry.adapter.b]
            pointers = {p.untyped_storage().data_ptr() for p in params}
            reference, _ = export_mod.collect_peft_tensors(model, "default", dst=None)

            def check(name, payload):
                for t in _tensors_in(payload):
                    handed.append(1)
                    if type(t) is not torch.Tensor or t.device.type != "cpu":
                        bad.append(f"{name}: {type(t).__name__} on {t.device}")
                    elif t.untyped_storage().data_ptr() in pointers:
                        bad.append(f"{name}: a view of a LoRA parameter")

            def gather_object(obj, object_gather_list=None, *args, **kwargs):
                check("gather_object", obj)
                return saved["gather_object"](_plain(obj), object_gather_list, *args, **kwargs)

            def all_gather_object(object_list, obj, *args, **kwargs):
                check("all_gather_object", obj)
                return saved["all_gather_object"](object_list, _plain(obj), *args, **kwargs)

            d.gather_object, d.all_gather_object = gather_object, all_gather_object
            on_device = lambda t, shape=None: logical_view(t, shape).as_subclass(  # noqa: E731
                _DeviceResident
            )
            export_mod.logical_view = on_device
            try:
                everywhere, _ = export_mod.collect_peft_tensors(model, "default", dst=None)
                to_rank0, _ = export_mod.collect_peft_tensors(model, "default", dst=0)
            finally:
                export_mod.logical_view = logical_view
    finally:
        d.gather_object, d.all_gather_object = saved["gather_object"], saved["all_gather_object"]
        parallel_state.destroy_model_parallel()
    results = {"everywhere": everywhere, "to_rank0": to_rank0}
    return {
        "bad": sorted(set(bad)),
        "handed": len(handed),
        "result_types": sorted(
            {f"{type(t).__name__}:{t.device}" for r in results.values() for t in r.values()}
        ),
        "reference": {k: v.numpy() for k, v in reference.items()},
        "everywhere": {k: v.as_subclass(torch.Tensor).numpy() for k, v in everywhere.items()},
        "to_rank0": {k: v.as_subclass(torch.Tensor).numpy() for k, v in to_rank0.items()},
    }


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, world_size=2)


def test_object_collectives_receive_only_host_tensors(ranks):
    for rank, result in enumerate(ranks):
        assert result["handed"] > 0, f"rank {rank} handed no tensor to an object collective"
        assert result["bad"] == [], f"rank {rank} handed device tensors: {result['bad']}"


def test_gathered_adapter_is_on_the_host_and_unchanged(ranks):
    for result in ranks:
        assert result["result_types"] == ["Tensor:cpu"]
        assert result["everywhere"].keys() == result["reference"].keys()
        for key, value in result["reference"].items():
            assert (result["everywhere"][key] == value).all(), key
    assert ranks[0]["to_rank0"].keys() == ranks[0]["reference"].keys()
    assert all((ranks[0]["to_rank0"][k] == v).all() for k, v in ranks[0]["reference"].items())
    assert ranks[1]["to_rank0"] == {}
