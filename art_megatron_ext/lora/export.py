"""Write a slot as a PEFT LoRA adapter directory; read one back into a slot.

`export_peft` is collective: every rank of the job calls it. Tensor-parallel shards are
gathered to the first rank of each site's tensor-parallel group, fused QKV and gate/up are
split into the Hugging Face modules (see `hf_layout`), padding is dropped, and the pieces held
by other pipeline stages / expert ranks are gathered to global rank 0 alone (no other rank
receives the adapter), which writes
`adapter_config.json` and `adapter_model.safetensors` (written to temporary names, then
renamed, so a reader never sees half a directory).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from art_protocol.adapter_stream import config_bytes

from .hf_layout import PEFT_PREFIX, HfNaming, hf_modules, split_fused_b
from .padding import logical_view
from .site import LoraSite
from .sites import finish_lora_param_sync, iter_lora_sites


def _dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _gather(tensor: torch.Tensor, site: LoraSite, everywhere: bool) -> list[torch.Tensor] | None:
    """This tensor from every rank of the site's tensor-parallel group, in rank order: on every
    rank (`everywhere`), else only on the group's first rank (None on the others)."""
    if site.info.tp_size == 1:
        return [tensor]
    tensor = tensor.contiguous()
    if everywhere:
        out = [torch.empty_like(tensor) for _ in range(site.info.tp_size)]
        torch.distributed.all_gather(out, tensor, group=site.tp_group)
        return out
    first = site.info.tp_rank == 0
    out = [torch.empty_like(tensor) for _ in range(site.info.tp_size)] if first else None
    torch.distributed.gather(tensor, out, group=site.tp_group, group_dst=0)
    return out


def _site_tensors(
    site: LoraSite, adapter, naming: HfNaming, everywhere: bool = True
) -> dict[str, torch.Tensor]:
    """HF key -> full logical tensor for one slot at one site (collective over its TP group);
    without `everywhere`, only the TP group's first rank gets them ({} on the others)."""
    a = logical_view(adapter.a).detach()
    b = logical_view(adapter.b).detach()
    column = site.info.kind.endswith("column")
    if column:
        a_shards, b_shards = [a], _gather(b, site, everywhere)
    else:
        a_shards, b_shards = _gather(a, site, everywhere), [b]
    if a_shards is None or b_shards is None:
        return {}
    grouped = site.info.num_local_experts is not None
    experts = range(site.info.num_local_experts) if grouped else [None]
    out: dict[str, torch.Tensor] = {}
    for e in experts:
        pick = (lambda t, e=e: t[e]) if grouped else (lambda t: t)
        full_a = torch.cat([pick(s) for s in a_shards], dim=1)
        parts = split_fused_b(site.info, [pick(s) for s in b_shards])
        expert = None if e is None else site.info.expert_index + e
        modules = hf_modules(site.info, naming, expert)
        r = adapter.rank
        for p, (module, part_b) in enumerate(zip(modules, parts, strict=True)):
            if adapter.parts > 1:  # stacked: this part's own A block and B columns
                part_a, part_b = full_a[p * r : (p + 1) * r], part_b[:, p * r : (p + 1) * r]
            else:
                part_a = full_a
            out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = part_a.clone()
            out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = part_b.clone()
    return out


def _first_replica(info) -> bool:
    """Whether this rank holds the first replica of a site's (TP-gathered) tensors.

    Dense parameters are replicated over data parallelism, routed-expert parameters over
    expert data parallelism (each expert-parallel rank holds different experts)."""
    try:
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return True
        if info.expert_index is not None and not info.in_shared_experts:
            return parallel_state.get_expert_data_parallel_rank() == 0
        return parallel_state.get_data_parallel_rank() == 0
    except (ImportError, AssertionError, RuntimeError):
        return True


def _on_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors in host memory (a blocking copy for device tensors; CPU ones as is).

    Why: `gather_object` / `all_gather_object` pickle their payload, and a pickled CUDA
    tensor records its device index; unpickling recreates it on that index of the receiving
    process, which fails where each process sees one GPU and otherwise allocates on a peer's
    GPU. So nothing reaches an object collective as a device tensor."""
    return {key: value.detach().to("cpu") for key, value in tensors.items()}


def collect_peft_tensors(
    model: torch.nn.Module, slot: str, naming: HfNaming | None = None, *, dst: int | None = 0
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """(HF key -> tensor, {"r": ..., "lora_alpha": ...}) for `slot`; collective.

    Finishes a pending Megatron parameter all-gather of the LoRA parameters first
    (`finish_lora_param_sync`), so an export right after an optimizer step under
    `overlap_param_gather` reads the updated adapter. The tensors are gathered to global
    rank `dst` only (the other ranks get an empty dict, and
    never hold another rank's pieces), or to every rank with `dst=None`; they are on the
    host (see `_on_host`). The (rank, alpha) check runs on every rank, so all of them raise
    the same error."""
    naming = naming or HfNaming()
    everywhere = dst is None
    finish_lora_param_sync(model)  # a step's all-gather may still wait for the next forward
    tensors: dict[str, torch.Tensor] = {}
    shapes: set[tuple[int, float]] = set()
    for entry in iter_lora_sites(model):
        if entry.slot != slot:
            continue
        site_tensors = _site_tensors(entry.site, entry.adapter, naming, everywhere)  # TP coll.
        if _first_replica(entry.site.info):
            tensors.update(_on_host(site_tensors))
        shapes.add((entry.adapter.rank, entry.adapter.alpha))
    if _dist() and torch.distributed.get_world_size() > 1:
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        all_shapes = [None] * world
        torch.distributed.all_gather_object(all_shapes, shapes)  # a few ints per rank
        shapes = set().union(*all_shapes)
        gathered = [None] * world if everywhere or rank == dst else None
        if everywhere:
            torch.distributed.all_gather_object(gathered, tensors)
        else:
            torch.distributed.gather_object(tensors, gathered, dst=dst)
        tensors = {}
        for part in gathered or ():
            for key, value in part.items():
                tensors.setdefault(key, value)
    if not shapes:
        raise KeyError(f"no LoRA site of the model holds slot {slot!r}")
    if len(shapes) != 1:
        raise ValueError(
            f"slot {slot!r} mixes (rank, alpha) pairs {sorted(shapes)}; PEFT "
            "export here needs one rank and alpha per slot"
        )
    ((rank, alpha),) = shapes
    return tensors, {"r": rank, "lora_alpha": alpha}


def adapter_config(rank: int, alpha: float, targets: list[str], base: str) -> dict:
    """The `adapter_config.json` PEFT and vLLM read for a plain LoRA adapter."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
        "init_lora_weights": True,
    }


def peft_adapter(
    model: torch.nn.Module,
    slot: str,
    base_model_name_or_path: str,
    *,
    naming: HfNaming | None = None,
    dtype: torch.dtype | None = None,
    dst: int = 0,
) -> tuple[dict[str, torch.Tensor], dict]:
    """(HF key -> host tensor, `adapter_config.json` as a dict) of slot `slot`, as
    `export_peft` writes them, on global rank `dst` (the other ranks get ({}, {})): what a
    trainer streams to the server (`StreamSender.send_adapter`) instead of writing files.
    Collective over the default process group when one is initialized. `dtype` casts the
    tensors (default: the parameters' dtype)."""
    tensors, shape = collect_peft_tensors(model, slot, naming, dst=dst)
    if _dist() and torch.distributed.get_rank() != dst:
        return {}, {}  # rank `dst` alone received the tensors
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    tensors = {k: v.contiguous().cpu() for k, v in sorted(tensors.items())}
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})
    config = adapter_config(shape["r"], shape["lora_alpha"], targets, base_model_name_or_path)
    return tensors, config


def export_peft(
    model: torch.nn.Module,
    slot: str,
    out_dir: str | os.PathLike,
    base_model_name_or_path: str,
    *,
    naming: HfNaming | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write slot `slot` of `model` as a PEFT adapter directory; returns `out_dir`.

    Collective over the default process group when one is initialized; rank 0 writes.
    `dtype` casts the written tensors (default: the parameters' dtype).
    """
    from safetensors.torch import save_file

    tensors, config = peft_adapter(model, slot, base_model_name_or_path, naming=naming, dtype=dtype)
    out = Path(out_dir)
    if _dist() and torch.distributed.get_rank() != 0:
        return out  # rank 0 alone received the tensors
    out.mkdir(parents=True, exist_ok=True)
    tmp_weights = out / ".adapter_model.safetensors.tmp"
    tmp_config = out / ".adapter_config.json.tmp"
    save_file(tensors, str(tmp_weights), metadata={"format": "pt"})
    tmp_config.write_bytes(config_bytes(config))  # as the server writes a streamed one
    os.replace(tmp_weights, out / "adapter_model.safetensors")
    os.replace(tmp_config, out / "adapter_config.json")
    return out
