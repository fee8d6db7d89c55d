"""Attach LoRA sites to the targeted linears of a Megatron-core model."""

from __future__ import annotations

import torch

from .. import compat
from .active_slot import install_recompute_capture
from .config import LoraConfig
from .layer_position import expert_index, group_size_rank, layer_number
from .site import COLUMN, ROW, LoraSite, SiteInfo


class UnsupportedLinear(TypeError):
    """A targeted module is not a linear this package can wrap (named in the message)."""


class BypassedLinear(UnsupportedLinear):
    """A targeted linear its parent never calls in this configuration, so LoRA on it would
    train nothing; the message names the setting and how to proceed."""


def describe_linear(
    path: str, module: torch.nn.Module, modules: dict[str, torch.nn.Module]
) -> SiteInfo:
    """What a LoRA site needs to know about the Megatron linear at `path`.

    Local-spec linears (`ColumnParallelLinear`, `RowParallelLinear`) are read through their
    Megatron attributes, Transformer Engine wrappers (`TEColumnParallelLinear`,
    `TERowParallelLinear`, `TELayerNormColumnParallelLinear`) through the attributes the
    wrapper and TE set (see `compat.te_linear_class`); TE is never imported.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        if module.gather_output:
            raise UnsupportedLinear(f"{path}: ColumnParallelLinear with gather_output=True")
        return _site_info(
            path,
            module,
            modules,
            kind=COLUMN,
            in_local=module.input_size,
            out_local=module.output_size_per_partition,
            in_features=module.input_size,
            out_features=module.output_size,
            tp_group=module.tp_group,
            sequence_parallel=bool(getattr(module, "sequence_parallel", False)),
            explicit_expert_comm=bool(module.explicit_expert_comm),
            input_is_parallel=True,
        )
    if isinstance(module, RowParallelLinear):
        return _site_info(
            path,
            module,
            modules,
            kind=ROW,
            in_local=module.input_size_per_partition,
            out_local=module.output_size,
            in_features=module.input_size,
            out_features=module.output_size,
            tp_group=module.tp_group,
            sequence_parallel=bool(getattr(module, "sequence_parallel", False)),
            explicit_expert_comm=bool(module.explicit_expert_comm),
            input_is_parallel=bool(getattr(module, "input_is_parallel", True)),
        )
    if compat.te_linear_class(module) is not None:
        return _describe_te_linear(path, module, modules)
    raise UnsupportedLinear(
        f"{path}: {type(module).__name__} is not a linear LoRA can wrap. Supported: Megatron's "
        "ColumnParallelLinear and RowParallelLinear (local spec), TEColumnParallelLinear, "
        "TERowParallelLinear and TELayerNormColumnParallelLinear (TE specs), and grouped expert "
        "linears (TEColumnParallelGroupedLinear, TERowParallelGroupedLinear). Build the model "
        "from Megatron's local or Transformer Engine GPT layer spec, or leave this module out "
        "of LoraConfig.targets."
    )


def _describe_te_linear(path: str, module, modules) -> SiteInfo:
    """A TE wrapper: local shapes from `weight` ([out, in] shard); `parallel_mode` None on a
    column/row wrapper means Megatron left communication to the token dispatcher (experts)."""
    te_class = compat.te_linear_class(module)
    name = type(module).__name__
    if te_class == compat.TE_DUPLICATED:
        raise UnsupportedLinear(
            f"{path}: {name} (Megatron TELinear, parallel_mode 'duplicated') is not a LoRA target;"
            " LoRA wraps TEColumnParallelLinear, TERowParallelLinear and "
            "TELayerNormColumnParallelLinear"
        )
    if getattr(module.weight, "gtp_remat_size", None) not in (None, 1):
        raise UnsupportedLinear(f"{path}: {name} with GTP weight rematerialization")
    layernorm = te_class == compat.TE_LAYERNORM_COLUMN
    if layernorm and (
        getattr(module, "return_layernorm_output", False)
        or getattr(module, "return_layernorm_output_gathered", False)
    ):
        raise UnsupportedLinear(
            f"{path}: {name} already returns its layernorm output to its caller; LoRA needs "
            "that output (return_layernorm_output) for itself"
        )
    tp_group = compat.te_tp_group(module)
    tp_size = group_size_rank(tp_group)[0]
    out_local, in_local = (int(n) for n in module.weight.shape)
    column = te_class in (compat.TE_COLUMN, compat.TE_LAYERNORM_COLUMN)
    return _site_info(
        path,
        module,
        modules,
        kind=COLUMN if column else ROW,
        in_local=in_local,
        out_local=out_local,
        in_features=in_local if column else in_local * tp_size,
        out_features=out_local * tp_size if column else out_local,
        tp_group=tp_group,
        sequence_parallel=bool(getattr(module, "sequence_parallel", False)),
        explicit_expert_comm=module.parallel_mode is None,
        input_is_parallel=True,
        layernorm_input=layernorm,
    )


def _site_info(
    path: str,
    module,
    modules,
    *,
    kind: str,
    in_local: int,
    out_local: int,
    in_features: int,
    out_features: int,
    tp_group,
    sequence_parallel: bool,
    explicit_expert_comm: bool,
    input_is_parallel: bool,
    layernorm_input: bool = False,
) -> SiteInfo:
    target = path.rsplit(".", 1)[-1]
    tp_size, tp_rank = group_size_rank(tp_group)
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
        in_features=in_features,
        out_features=out_features,
        in_local=in_local,
        out_local=out_local,
        tp_size=tp_size,
        tp_rank=tp_rank,
        sequence_parallel=sequence_parallel and tp_size > 1,
        explicit_expert_comm=explicit_expert_comm,
        input_is_parallel=input_is_parallel,
        layer_number=layer_number(path, modules),
        expert_index=expert_index(path, modules),
        gated=bool(config.gated_linear_unit) and target == "linear_fc1",
        in_shared_experts=".shared_experts." in f".{path}.",
        qkv_layout=qkv_layout,
        layernorm_input=layernorm_input,
    )


def attach_lora(
    model: torch.nn.Module, config: LoraConfig, *, freeze_base: bool = True
) -> list[LoraSite]:
    """Add a LoRA site (child `lora` + forward hook) to every targeted linear of `model`.

    Creates slot `config.slot` (rank, alpha, seeded A, zero B) at every site unless it is
    None. With `freeze_base`, every parameter that is not a LoRA parameter stops requiring
    gradients. Returns the sites in module order. Raises `UnsupportedLinear` naming the first
    targeted module that cannot be wrapped, before changing anything; its subclass
    `BypassedLinear` when the module would never be called (expert linears of a `TEGroupedMLP`
    with `use_transformer_engine_op_fuser`). A `HybridModel` works as the `GPTModel` of the same
    shape (sites numbered by GPT layer); `layer_position.UnsupportedLayerPattern`, also
    before changing anything, when its layer pattern does not pair into GPT layers.
    """
    from .grouped import describe_grouped_linear, is_grouped_linear

    modules = dict(model.named_modules())
    found = []
    for path, module in modules.items():
        if path.rsplit(".", 1)[-1] not in config.targets or isinstance(module, LoraSite):
            continue
        if hasattr(module, "lora"):
            raise ValueError(f"{path} already has a LoRA site; attach_lora runs once per model")
        _refuse_bypassed_linear(path, modules)
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
        if info.layernorm_input:  # TE's LayerNormLinear then also returns the normalized input
            module.return_layernorm_output = True
        module.lora = site
        site.hook_handle = module.register_forward_hook(site.hook, with_kwargs=True)
        _route_sharded_state_dict(module, site)
        if config.slot is not None:
            site.add_slot(config.slot, config.rank, config.alpha, config.init_seed)
        sites.append(site)
    return sites


def _refuse_bypassed_linear(path: str, modules: dict[str, torch.nn.Module]) -> None:
    """Refuse a linear whose parent computes around it: Megatron's `TEGroupedMLP` with the TE
    op fuser runs fused ops over its experts' weights and never calls `linear_fc1` /
    `linear_fc2`. A site there would attach, count and export, yet never change an output or
    get a gradient, so the adapter would silently stay at its initial value."""
    parent_path = path.rpartition(".")[0]
    parent = modules.get(parent_path)
    if parent is None or not compat.te_grouped_mlp_bypasses_linears(parent):
        return
    flag = compat.TE_OP_FUSER_FLAG
    raise BypassedLinear(
        f"{path}: {type(parent).__name__} at {parent_path} runs Transformer Engine's op-fuser "
        f"path (TransformerConfig.{flag}=True), which computes the experts from fused ops and "
        "never calls linear_fc1 or linear_fc2, so LoRA on them would train nothing. To train "
        f"expert LoRA, build the model with {flag}=False (TEGroupedMLP then calls both "
        f"linears); to keep {flag}, leave linear_fc1 and linear_fc2 out of LoraConfig.targets "
        "(which also leaves out dense MLPs). Nothing was attached."
    )


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
    tp_group = compat.te_tp_group(module) if compat.te_linear_class(module) else module.tp_group
    site = cls(info, tp_group, config.padding, dtype=dtype, device=weight.device)
    site.replicated_allreduce = bool(getattr(weight, "allreduce", True))
    return site
