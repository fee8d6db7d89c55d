"""Attach LoRA sites to the targeted linears of a Megatron-core model."""

from __future__ import annotations

import re

import torch

from .config import LoraConfig
from .site import COLUMN, ROW, LoraSite, SiteInfo
from .slots import install_recompute_capture

_LOCAL_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


class UnsupportedLinear(TypeError):
    """A targeted module is not a linear this package can wrap (named in the message)."""


def _group_size_rank(group) -> tuple[int, int]:
    if group is None or not torch.distributed.is_initialized():
        return 1, 0
    return group.size(), group.rank()


def _layer_number(path: str, modules: dict[str, torch.nn.Module]) -> int | None:
    """Megatron's 1-based global `layer_number` of the transformer layer holding `path`."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 1, -1):
        number = getattr(modules.get(".".join(parts[:cut])), "layer_number", None)
        if parts[cut - 2] == "layers" and isinstance(number, int):
            return number
    return None


def _expert_index(path: str, modules: dict[str, torch.nn.Module]) -> int | None:
    """Global expert index of a `SequentialMLP` expert linear (EP rank * local count + i)."""
    match = _LOCAL_EXPERT.search(f".{path}.")
    if match is None:
        return None
    experts = modules[path[: path.index(".local_experts.")]]
    return local_expert_offset(experts) + int(match.group(1))


def local_expert_offset(experts: torch.nn.Module) -> int:
    """Global index of the first local expert of an experts module (SequentialMLP/TEGroupedMLP)."""
    ep_rank = _group_size_rank(getattr(experts, "ep_group", None))[1]
    return ep_rank * int(experts.num_local_experts)


def describe_linear(
    path: str, module: torch.nn.Module, modules: dict[str, torch.nn.Module]
) -> SiteInfo:
    """What a LoRA site needs to know about the Megatron linear at `path`."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    target = path.rsplit(".", 1)[-1]
    if isinstance(module, ColumnParallelLinear):
        if module.gather_output:
            raise UnsupportedLinear(f"{path}: ColumnParallelLinear with gather_output=True")
        kind, in_local, out_local = COLUMN, module.input_size, module.output_size_per_partition
    elif isinstance(module, RowParallelLinear):
        kind, in_local, out_local = ROW, module.input_size_per_partition, module.output_size
    else:
        raise UnsupportedLinear(
            f"{path}: {type(module).__name__} is not a Megatron ColumnParallelLinear or "
            "RowParallelLinear (LoRA needs the linear's own input: build the model with the "
            "local spec, or a TE spec without layernorm fused into the linear)"
        )
    tp_size, tp_rank = _group_size_rank(module.tp_group)
    config = module.config
    qkv_layout = None
    if target == "linear_qkv":
        if getattr(config, "attention_output_gate", False):
            raise UnsupportedLinear(f"{path}: QKV with an attention output gate")
        groups = config.num_query_groups or config.num_attention_heads
        if groups % tp_size:
            raise UnsupportedLinear(
                f"{path}: {groups} query groups do not split over tensor-parallel size {tp_size}"
            )
        qkv_layout = (groups, config.num_attention_heads // groups, config.kv_channels)
    return SiteInfo(
        path=path,
        target=target,
        kind=kind,
        in_features=module.input_size,
        out_features=module.output_size,
        in_local=in_local,
        out_local=out_local,
        tp_size=tp_size,
        tp_rank=tp_rank,
        sequence_parallel=bool(getattr(module, "sequence_parallel", False)) and tp_size > 1,
        explicit_expert_comm=bool(module.explicit_expert_comm),
        input_is_parallel=bool(getattr(module, "input_is_parallel", True)),
        layer_number=_layer_number(path, modules),
        expert_index=_expert_index(path, modules),
        gated=bool(config.gated_linear_unit) and target == "linear_fc1",
        in_shared_experts=".shared_experts." in f".{path}.",
        qkv_layout=qkv_layout,
    )


def attach_lora(
    model: torch.nn.Module, config: LoraConfig, *, freeze_base: bool = True
) -> list[LoraSite]:
    """Add a LoRA site (child `lora` + forward hook) to every targeted linear of `model`.

    Creates slot `config.slot` (rank, alpha, seeded A, zero B) at every site unless it is
    None. With `freeze_base`, every parameter that is not a LoRA parameter stops requiring
    gradients. Returns the sites in module order. Raises `UnsupportedLinear` naming the first
    targeted module that cannot be wrapped, before changing anything.
    """
    from .grouped import describe_grouped_linear, is_grouped_linear

    modules = dict(model.named_modules())
    found = []
    for path, module in modules.items():
        if path.rsplit(".", 1)[-1] not in config.targets or isinstance(module, LoraSite):
            continue
        if hasattr(module, "lora"):
            raise ValueError(f"{path} already has a LoRA site; attach_lora runs once per model")
        if is_grouped_linear(module):
            found.append((module, describe_grouped_linear(path, module, modules)))
        else:
            found.append((module, describe_linear(path, module, modules)))
    if not found:
        raise ValueError(f"no module of the model matches LoRA targets {config.targets}")
    if freeze_base:
        for p in model.parameters():
            p.requires_grad_(False)
        _make_embedding_output_require_grad(model)
    install_recompute_capture()
    sites = []
    for module, info in found:
        site = _make_site(module, info, config)
        module.lora = site
        site.hook_handle = module.register_forward_hook(site.hook, with_kwargs=True)
        _route_sharded_state_dict(module, site)
        if config.slot is not None:
            site.add_slot(config.slot, config.rank, config.alpha, config.init_seed)
        sites.append(site)
    return sites


def _route_sharded_state_dict(module: torch.nn.Module, site: LoraSite) -> None:
    """Megatron linears build their dist-checkpoint entries from `self.state_dict()`, which
    now includes `lora.*`, and would declare those replicated over TP (wrong for the split
    factor: only one rank's shard would be saved). Let the site declare its own entries."""
    original = getattr(module, "sharded_state_dict", None)
    if original is None:
        return

    def sharded_state_dict(prefix: str = "", sharded_offsets=(), metadata=None):
        entries = original(prefix, sharded_offsets, metadata)
        lora_prefix = f"{prefix}lora."
        for key in [k for k in entries if k.startswith(lora_prefix)]:
            del entries[key]
        entries.update(site.sharded_state_dict(lora_prefix, sharded_offsets, metadata))
        return entries

    module.sharded_state_dict = sharded_state_dict


def _embedding_output_requires_grad(module, args, output):
    if torch.is_grad_enabled() and torch.is_tensor(output) and not output.requires_grad:
        output.requires_grad_(True)
    return output


def _make_embedding_output_require_grad(model: torch.nn.Module) -> None:
    """With a frozen embedding, Megatron's (reentrant) activation checkpoint would see inputs
    that need no gradient and drop the gradients of every LoRA parameter inside it; marking
    the embedding output as requiring grad (as HF's `enable_input_require_grads`) keeps them.
    Later pipeline stages receive activations that already require grad."""
    embedding = getattr(model, "embedding", None)
    if isinstance(embedding, torch.nn.Module):
        embedding.register_forward_hook(_embedding_output_requires_grad)


def _make_site(module: torch.nn.Module, info: SiteInfo, config: LoraConfig) -> LoraSite:
    from .grouped import GroupedLoraSite, grouped_weight

    grouped = info.kind.startswith("grouped")
    weight = grouped_weight(module) if grouped else module.weight
    cls = GroupedLoraSite if grouped else LoraSite
    dtype = config.dtype or weight.dtype
    site = cls(info, module.tp_group, config.padding, dtype=dtype, device=weight.device)
    site.replicated_allreduce = bool(getattr(weight, "allreduce", True))
    return site
