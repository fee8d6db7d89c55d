"""`ArtGroupedMLP`'s expert weights go through Megatron's `dist_checkpointing` at expert
parallel 2 and back at 1, each expert landing where it belongs (2 gloo ranks, one spawn).

Every global expert g gets known weights (and a known LoRA A/B) drawn from a generator seeded
by g, so a check needs no gathering: after a load, local expert e of EP rank r must hold
expert r * L + e's values. The cases, in one worker:
- ep2 -> ep1: saved at EP=2 (2 experts a rank), loaded at EP=1 (all 4 on both ranks);
- ep1 -> ep2: that EP=1 load saved again, loaded at EP=2 (equal to the EP=2 original);
- ep2 -> ep2: the EP=2 checkpoint loaded at the same layout (before the fix each EP rank
  received rank 0's experts: the weights were declared data-parallel replicas);
- megatron -> ours: Megatron's `SequentialMLP` saved at EP=2 (its per-expert [out, in]
  weights, gated FC1 as [gate; up]) loads into `ArtGroupedMLP` at EP=1, so our checkpoint
  keys and global shapes are Megatron's.
The LoRA cases are the same round trips for the grouped LoRA sites on our expert linears.
"""

from __future__ import annotations

import os

import pytest
import torch
from support.train_ranks import run_ranks

EXPERTS = 4
RANK = 4
PREFIX = "decoder.layers.0.mlp."


def _config():
    from support.megatron_cpu import moe_test_config

    return moe_test_config(
        num_moe_experts=EXPERTS,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
    )  # SwiGLU: FC1 saved as its gate and up halves, as Megatron does


def _known_weights(g: int, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert g's weights in our layout: fc1 [hidden, 2 * ffn], fc2 [ffn, hidden]."""
    gen = torch.Generator().manual_seed(100 + g)
    ffn = cfg.moe_ffn_hidden_size
    return (
        torch.randn(cfg.hidden_size, 2 * ffn, generator=gen),
        torch.randn(ffn, cfg.hidden_size, generator=gen),
    )


def _known_lora(g: int, target: str, a_shape, b_shape) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + 10 * g + (target == "linear_fc2"))
    return torch.randn(a_shape, generator=gen), torch.randn(b_shape, generator=gen)


def _lora_views(layer):
    from art_megatron_ext.lora.padding import logical_view

    for target in ("linear_fc1", "linear_fc2"):
        adapter = getattr(layer.experts, target).lora.slots["default"]
        yield target, logical_view(adapter.a), logical_view(adapter.b)


def _build(ep: int, seed: int, lora: bool, sequential: bool = False):
    """A MoE layer at `model.decoder.layers.0.mlp` with ArtGroupedMLP (or SequentialMLP)
    experts, all weights drawn from `seed` (so a rebuilt layer differs from the saved one)."""
    from support.decoder_layer import in_a_decoder_layer
    from support.megatron_cpu import build_moe_layer

    from art_megatron_ext.lora import LoraConfig, attach_lora
    from art_megatron_ext.moe import GroupedMLPOptions, art_moe_layer_spec

    torch.manual_seed(seed)
    cfg = _config()
    if sequential:
        layer = build_moe_layer(cfg)
    else:
        layer = art_moe_layer_spec(EXPERTS, GroupedMLPOptions("torch"))(config=cfg, layer_number=1)
        assert layer.experts.num_local_experts == EXPERTS // ep
    model = in_a_decoder_layer(layer)
    if lora:
        attach_lora(model, LoraConfig(rank=RANK, targets=("linear_fc1", "linear_fc2")))
        with torch.no_grad():
            for _, a, b in _lora_views(layer):
                a.normal_(generator=torch.Generator().manual_seed(seed))
                b.normal_(generator=torch.Generator().manual_seed(seed + 1))
    return model, layer, cfg


def _first_expert(layer) -> int:
    return layer.experts.ep_group.rank() * layer.experts.num_local_experts


@torch.no_grad()
def _set_known(layer, cfg, lora: bool) -> None:
    first = _first_expert(layer)
    for e in range(layer.experts.num_local_experts):
        w1, w2 = _known_weights(first + e, cfg)
        if hasattr(layer.experts, "local_experts"):  # SequentialMLP: [out, in] per expert
            layer.experts.local_experts[e].linear_fc1.weight.copy_(w1.t())
            layer.experts.local_experts[e].linear_fc2.weight.copy_(w2.t())
        else:
            layer.experts.weight1[e].copy_(w1)
            layer.experts.weight2[e].copy_(w2)
    if lora:
        for target, a, b in _lora_views(layer):
            for e in range(a.shape[0]):
                ka, kb = _known_lora(first + e, target, a.shape[1:], b.shape[1:])
                a[e].copy_(ka)
                b[e].copy_(kb)


def _diffs(layer, cfg, lora: bool) -> dict:
    """Largest |loaded - known| over this rank's experts, per tensor kind."""
    first = _first_expert(layer)
    out = {"fc1": 0.0, "fc2": 0.0}
    for e in range(layer.experts.num_local_experts):
        w1, w2 = _known_weights(first + e, cfg)
        out["fc1"] = max(out["fc1"], (layer.experts.weight1[e] - w1).abs().max().item())
        out["fc2"] = max(out["fc2"], (layer.experts.weight2[e] - w2).abs().max().item())
    if lora:
        for target, a, b in _lora_views(layer):
            for e in range(a.shape[0]):
                ka, kb = _known_lora(first + e, target, a.shape[1:], b.shape[1:])
                diff = max((a[e] - ka).abs().max().item(), (b[e] - kb).abs().max().item())
                out[f"{target}.lora"] = max(out.get(f"{target}.lora", 0.0), diff)
    return out


def _save(layer, path: str) -> None:
    from megatron.core import dist_checkpointing

    if torch.distributed.get_rank() == 0:
        os.makedirs(path)
    torch.distributed.barrier()
    dist_checkpointing.save(layer.sharded_state_dict(prefix=PREFIX), path)


def _load(model, layer, path: str) -> None:
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(layer.sharded_state_dict(prefix=PREFIX), path)
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    assert not [k for k in missing if ".experts." in k] and not unexpected, (missing, unexpected)


def _case(fn) -> dict:
    """Run one case; a failure is returned (it is raised on every rank alike), not raised."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        return fn()
    except (Exception, CheckpointException) as exc:  # reported by the test reading the case
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def _worker(rank: int, world_size: int, root: str) -> dict:
    from support.megatron_cpu import cpu_shim, megatron_parallel

    def save_ep2():
        with megatron_parallel(ep=2):
            _, layer, cfg = _build(ep=2, seed=1, lora=True)
            _set_known(layer, cfg, lora=True)
            _save(layer, f"{root}/ep2")
            return _diffs(layer, cfg, lora=True)  # zero: the values the checkpoint must hold

    def load(ep: int, src: str, dst: str | None = None, lora: bool = True):
        def run():
            with megatron_parallel(ep=ep):
                model, layer, cfg = _build(ep=ep, seed=10 + ep, lora=lora)
                before = _diffs(layer, cfg, lora)
                _load(model, layer, f"{root}/{src}")
                if dst is not None:
                    _save(layer, f"{root}/{dst}")
                return {"fresh": before, **_diffs(layer, cfg, lora)}

        return run

    def save_sequential_ep2():
        with megatron_parallel(ep=2):
            _, layer, cfg = _build(ep=2, seed=3, lora=False, sequential=True)
            _set_known(layer, cfg, lora=False)
            _save(layer, f"{root}/sequential_ep2")
            return {}

    out = {}
    with cpu_shim():
        out["save_ep2"] = _case(save_ep2)
        out["ep2_to_ep1"] = _case(load(ep=1, src="ep2", dst="ep1"))
        out["ep1_to_ep2"] = _case(load(ep=2, src="ep1"))
        out["ep2_to_ep2"] = _case(load(ep=2, src="ep2"))
        out["save_sequential_ep2"] = _case(save_sequential_ep2)
        out["megatron_ep2_to_ours_ep1"] = _case(load(ep=1, src="sequential_ep2", lora=False))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("grouped_mlp_dist_ckpt")
    return run_ranks(_worker, world_size=2, args=(str(root),), timeout_s=300, daemon=False)


def _check(results, case: str, keys=("fc1", "fc2")) -> None:
    for rank in (0, 1):
        got = results[rank][case]
        assert "error" not in got, f"rank {rank}: {got['error']}"
        assert all(got["fresh"][k] > 0.1 for k in keys), got["fresh"]  # rebuilt: other values
        assert all(got[k] == 0.0 for k in keys), f"rank {rank}: max |loaded - known| {got}"


def test_saves_run_on_every_rank(results):
    for rank in (0, 1):
        for case in ("save_ep2", "save_sequential_ep2"):
            assert "error" not in results[rank][case], results[rank][case]["error"]
        assert set(results[rank]["save_ep2"].values()) == {0.0}


def test_ep2_checkpoint_loads_at_ep1_with_every_expert_in_place(results):
    _check(results, "ep2_to_ep1")


def test_ep1_checkpoint_loads_back_at_ep2(results):
    _check(results, "ep1_to_ep2")


def test_ep2_checkpoint_reloads_at_ep2_on_each_rank_its_own_experts(results):
    _check(results, "ep2_to_ep2")


def test_megatron_sequential_mlp_checkpoint_loads_into_art_grouped_mlp(results):
    _check(results, "megatron_ep2_to_ours_ep1")


@pytest.mark.parametrize("case", ["ep2_to_ep1", "ep1_to_ep2", "ep2_to_ep2"])
def test_expert_lora_follows_its_expert(results, case):
    _check(results, case, keys=("linear_fc1.lora", "linear_fc2.lora"))
