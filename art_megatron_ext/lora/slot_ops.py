"""Model-wide slot operations: add, load (from a PEFT directory), drop.

Each applies to every LoRA site of the model and checks all sites before changing any, so a
refused operation leaves every slot as it was.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .hf_layout import PEFT_PREFIX, HfNaming, fuse_b_shard, hf_modules
from .site import LoraSite, SlotHasLiveGradients


def lora_sites(model: torch.nn.Module) -> list[LoraSite]:
    return [m for m in model.modules() if isinstance(m, LoraSite)]


def _refuse_live_gradients(sites: list[LoraSite], slot: str) -> None:
    busy = [s.info.path for s in sites if slot in s.slots and s.slots[slot].holds_live_gradients()]
    if busy:
        raise SlotHasLiveGradients(
            f"slot {slot!r} still holds gradients at {len(busy)} site(s), e.g. {busy[0]}; "
            "finish the step (optimizer.step() then zero_grad(set_to_none=True)) before "
            "loading into it. Every slot keeps its current weights."
        )


def add_slot(model: torch.nn.Module, slot: str, rank: int, alpha: float, seed: int = 0) -> None:
    """A fresh trainable slot at every site (PEFT-style A, zero B). Refused if it exists."""
    sites = lora_sites(model)
    taken = [s.info.path for s in sites if slot in s.slots]
    if taken:
        raise ValueError(f"slot {slot!r} already exists (e.g. at {taken[0]}); drop it first")
    for site in sites:
        site.add_slot(slot, rank, alpha, seed)


def drop_slot(model: torch.nn.Module, slot: str) -> None:
    """Remove `slot` from every site holding it (its parameters go with it)."""
    sites = [s for s in lora_sites(model) if slot in s.slots]
    if not sites:
        raise KeyError(f"no LoRA site holds slot {slot!r}")
    for site in sites:
        site.drop_slot(slot)


def _read_peft(adapter_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r} (want 'LORA')")
    for flag in ("use_rslora", "use_dora"):
        if config.get(flag):
            problems.append(f"{flag}=true")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if config.get(pattern):
            problems.append(f"a non-empty {pattern}")
    if problems:
        raise ValueError(f"{adapter_dir}: unsupported adapter ({', '.join(problems)})")
    raw = load_file(str(adapter_dir / "adapter_model.safetensors"))
    tensors = {k.removeprefix(PEFT_PREFIX): v for k, v in raw.items()}
    return config, tensors


def _part_rows(info, index: int, present_rows: dict[int, int]) -> int:
    if info.target == "linear_qkv":
        groups, q_per_group, head_dim = info.qkv_layout
        return groups * head_dim * (q_per_group if index == 0 else 1)
    return next(iter(present_rows.values()))  # gate and up have the same width


def _read_parts(modules: list[str], tensors) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{part index: (A, B)} of the HF modules of one site (or expert) the adapter targets."""
    return {
        i: (tensors[f"{m}.lora_A.weight"], tensors[f"{m}.lora_B.weight"])
        for i, m in enumerate(modules)
        if f"{m}.lora_A.weight" in tensors
    }


def _shares_a(found: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> bool:
    a_parts = [a for a, _ in found.values()]
    return all(torch.equal(a_parts[0], a) for a in a_parts[1:])


def _fused_full(site: LoraSite, n_parts: int, found, stacked: bool):
    """(full A, [full B per part]) for one site or expert; missing parts are zero.

    Shared A: A is the common A and each B keeps its columns. Stacked: A is every part's A
    one after the other and part p's B occupies only the columns of block p.
    """
    a0, _ = next(iter(found.values()))
    rank, width = a0.shape
    rows = {i: b.shape[0] for i, (_, b) in found.items()}
    if not stacked:
        b_parts = [
            found[i][1] if i in found else torch.zeros(_part_rows(site.info, i, rows), rank)
            for i in range(n_parts)
        ]
        return a0, b_parts
    a_full = torch.zeros(n_parts * rank, width, dtype=a0.dtype)
    b_parts = []
    for i in range(n_parts):
        b = torch.zeros(_part_rows(site.info, i, rows), n_parts * rank, dtype=a0.dtype)
        if i in found:
            a_full[i * rank : (i + 1) * rank] = found[i][0]
            b[:, i * rank : (i + 1) * rank] = found[i][1]
        b_parts.append(b)
    return a_full, b_parts


def _local_pair(site: LoraSite, full_a: torch.Tensor, b_parts: list[torch.Tensor]):
    info = site.info
    if info.kind.endswith("column"):
        return full_a, fuse_b_shard(info, b_parts, info.tp_rank, info.tp_size)
    return full_a.chunk(info.tp_size, dim=1)[info.tp_rank], b_parts[0]


def import_peft(
    model: torch.nn.Module,
    slot: str,
    adapter_dir: str | os.PathLike,
    *,
    naming: HfNaming | None = None,
) -> int:
    """Load a PEFT LoRA directory into `slot` (created or overwritten); returns sites loaded.

    Every rank loads its own shards (no communication). Fused parts (q/k/v, gate/up) that
    share lora_A (as `export_peft` writes them) load as one rank-r slot; parts with their own
    A (as PEFT trains them) load stacked (rank parts*r, block-diagonal B, see `LoraAdapter`).
    A part the adapter does not target gets zeros. Sites the adapter does not target lose
    `slot`. Refused before any change if the
    slot holds live gradients or an adapter tensor matches no site of a single-process model.
    """
    where = Path(adapter_dir)
    config, tensors = _read_peft(where)
    alpha = float(config["lora_alpha"])
    sites = lora_sites(model)
    _refuse_live_gradients(sites, slot)
    plan, used = [], set()
    for site in sites:
        info = site.info
        experts = range(info.num_local_experts) if info.num_local_experts else [None]
        per_expert = []
        for e in experts:
            modules = hf_modules(info, naming, None if e is None else info.expert_index + e)
            used.update(f"{m}.lora_{ab}.weight" for m in modules for ab in "AB")
            per_expert.append((len(modules), _read_parts(modules, tensors)))
        # one A shared by the fused parts when the adapter has it so, else one A per part
        stacked = any(found and not _shares_a(found) for _, found in per_expert)
        if stacked and info.kind.endswith("row"):
            raise ValueError(f"{where}: row-parallel site {info.path} has no fused parts")
        pairs = [
            _local_pair(site, *_fused_full(site, n, found, stacked)) if found else None
            for n, found in per_expert
        ]
        parts = per_expert[0][0] if stacked else 1
        plan.append((site, pairs, parts))
    unused = sorted(set(tensors) - used)
    single = not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1)
    if unused and single:
        raise ValueError(f"{where}: {len(unused)} tensors match no LoRA site, e.g. {unused[0]}")
    loaded = 0
    for site, pairs, parts in plan:
        if all(p is None for p in pairs):
            if slot in site.slots:
                site.drop_slot(slot)
            continue
        if len(pairs) == 1:
            a, b = pairs[0]
        else:
            template = next(p for p in pairs if p is not None)
            pairs = [
                p or (torch.zeros_like(template[0]), torch.zeros_like(template[1])) for p in pairs
            ]
            a, b = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        site.load_slot(slot, a, b, alpha, parts=parts)
        loaded += 1
    return loaded
