"""Router replay in Megatron-core: the recorded experts are the ones a replayed forward and
backward use, padding rows stay out of expert-bias accounting, and virtual pipeline > 1 is
refused.

The multi-rank cases run once in two spawned gloo ranks with expert parallelism 2 (real
`MoELayer`s, `SequentialMLP` experts, alltoall dispatcher, the CPU shim of
tests/support/megatron_cpu.py). Each rank records routing on its own batch, ships the routes
through a route bundle and padded collation (the production path), replays them, then does the
same for prefix-packed rows (routes recorded per trajectory alone, packed by `pack_groups`),
and returns numbers that the tests below assert on.
"""

import types

import numpy as np
import pytest
import torch
from support.train_ranks import run_ranks

from art_megatron_ext.compat import megatron_router_replay
from art_megatron_ext.routing.replay import (
    RouterReplayError,
    check_replay_supported,
    replay_targets,
    replaying_routes,
)

SEQ, HIDDEN, LAYERS, TOPK, EXPERTS, VOCAB = 6, 16, 2, 2, 8, 32
LENGTHS = {0: [6, 4, 3], 1: [5, 6, 1]}  # per rank: right-padded trajectories


def _replay_worker(rank: int, world_size: int, groups) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    from support.megatron_cpu import build_moe_layer, cpu_shim, megatron_parallel, moe_test_config

    from art_megatron_ext.routing import (
        collate_padded_routes,
        decode_route_bundle,
        encode_route_bundle,
    )

    router_replay, action = megatron_router_replay()
    out: dict = {}
    with cpu_shim(), megatron_parallel(ep=world_size):
        router_replay.clear_global_router_replay_instances()
        config = moe_test_config(
            num_layers=LAYERS,
            num_moe_experts=EXPERTS,
            moe_router_topk=TOPK,
            moe_enable_routing_replay=True,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
        )
        torch.manual_seed(0)  # routers identical on both ranks; experts sharded by EP
        layers = [build_moe_layer(config, layer_number=i + 1) for i in range(LAYERS)]
        lengths = LENGTHS[rank]
        batch = len(lengths)
        x = torch.randn(SEQ, batch, HIDDEN, generator=torch.Generator().manual_seed(rank))
        real = torch.zeros(batch, SEQ, dtype=torch.bool)
        for b, n in enumerate(lengths):
            real[b, :n] = True
        real_sm = real.t().reshape(-1)  # sequence-major, as the routers see tokens
        maps: list[torch.Tensor] = []
        for layer in layers:
            layer.router.register_forward_hook(lambda m, i, o: maps.append(o[1].detach().clone()))
        params = [p for layer in layers for p in layer.parameters()]

        def forward_backward(padding_mask=None):
            maps.clear()
            for layer in layers:
                layer.router.local_tokens_per_expert.zero_()
                layer.zero_grad(set_to_none=True)
            h = x
            for layer in layers:
                h, _ = layer(h, padding_mask=padding_mask)
            (h * real.t()[..., None]).sum().backward()
            grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
            counts = [layer.router.local_tokens_per_expert.clone() for layer in layers]
            return h.detach(), grads, counts

        # 1. Record (the rollout's routing), then ship routes as a bundle and collate them.
        router_replay.set_global_router_replay_action(action.RECORD)
        out_rec, grads_rec, _ = forward_backward()
        recorded = [r.detach().clone() for r in router_replay.get_recorded_data()]
        router_replay.clear_global_router_replay_action()
        router_replay.clear_global_indices()
        per_layer = [r.view(SEQ, batch, TOPK) for r in recorded]
        routes = [
            torch.stack([r[:n, b] for r in per_layer], dim=1).numpy().astype(np.int32)
            for b, n in enumerate(lengths)
        ]
        bundle = decode_route_bundle(bytes(encode_route_bundle(routes, num_experts=EXPERTS)))
        collated = collate_padded_routes(
            bundle.routes, lengths, seq_len=SEQ, num_layers=LAYERS, topk=TOPK
        )
        recorded_maps = [
            torch.zeros(SEQ * batch, EXPERTS, dtype=torch.bool).scatter(1, r.long(), True)
            for r in recorded
        ]
        expected_counts = [m[real_sm].sum(0).float() for m in recorded_maps]

        # 2. Replay on the same weights: same outputs and gradients on real tokens.
        with replaying_routes(collated.routes, config, model=layers):
            out_rep, grads_rep, counts_rep = forward_backward(collated.padding_mask)
        out["forward_diff"] = float((out_rep - out_rec)[real.t()].abs().max())
        out["grad_diff"] = max(
            float((a - b).abs().max()) for a, b in zip(grads_rep, grads_rec, strict=True)
        )
        out["maps_equal_on_real"] = all(
            torch.equal(m[real_sm], r[real_sm]) for m, r in zip(maps, recorded_maps, strict=True)
        )
        dummy = torch.zeros(EXPERTS, dtype=torch.bool)
        dummy[:TOPK] = True
        out["padding_rows_dummy"] = all(bool((m[~real_sm] == dummy).all()) for m in maps)
        out["counts_match_real_only"] = all(
            torch.equal(c, e) for c, e in zip(counts_rep, expected_counts, strict=True)
        )
        from megatron.core.transformer.moe.router import TopKRouter

        megatron_method = TopKRouter.__dict__["_apply_expert_bias"]
        out["bias_fix_scoped"] = megatron_method.__module__ == TopKRouter.__module__ and all(
            "_apply_expert_bias" not in layer.router.__dict__ for layer in layers
        )
        out["actions_cleared"] = all(
            i.router_replay_action is None and i.target_topk_idx is None
            for i in router_replay.global_router_replay_instances
        )

        # 3. A different router: its own routing differs, replay still uses the recorded one.
        with torch.no_grad():
            for layer in layers:
                g = torch.Generator().manual_seed(1)
                layer.router.weight.add_(torch.randn(layer.router.weight.shape, generator=g) * 3)
        forward_backward()
        out["natural_routing_differs"] = any(
            not torch.equal(m[real_sm], r[real_sm])
            for m, r in zip(maps, recorded_maps, strict=True)
        )
        with replaying_routes(collated.routes, config, model=layers):
            forward_backward(collated.padding_mask)
        out["perturbed_maps_equal_on_real"] = all(
            torch.equal(m[real_sm], r[real_sm]) for m, r in zip(maps, recorded_maps, strict=True)
        )

        # 4. Control: without the padding mask, the dummy rows are counted.
        with replaying_routes(collated.routes, config, model=layers):
            _, _, counts_unmasked = forward_backward(None)
        out["unmasked_counts_differ"] = any(
            not torch.equal(c, e) for c, e in zip(counts_unmasked, expected_counts, strict=True)
        )
        out["unmasked_extra"] = float(
            sum((c - e).sum() for c, e in zip(counts_unmasked, expected_counts, strict=True))
        )
        out["padding_slots"] = int((~real_sm).sum()) * TOPK * LAYERS

        # 5. Packed rows: routes recorded per trajectory alone, packed with shared prefixes
        #    stored once, replayed on the packed batch. Inputs are token embeddings (no
        #    attention in a bare MoE stack), so a token's routing depends on its id only.
        out.update(_replay_packed(layers, config, groups, router_replay, action, maps))
        router_replay.clear_global_router_replay_instances()
    return out


def _replay_packed(layers, config, groups, router_replay, action, maps) -> dict:
    from art_megatron_ext.packing import PackingConfig, Trajectory, TrajectoryGroup, pack_groups

    table = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(5))

    def run(tokens_sb, padding_mask=None):  # tokens [S, B]
        maps.clear()
        for layer in layers:
            layer.router.local_tokens_per_expert.zero_()
        h = table[tokens_sb.contiguous()].contiguous()
        for layer in layers:
            h, _ = layer(h, padding_mask=padding_mask)
        h.sum().backward()
        return [layer.router.local_tokens_per_expert.clone() for layer in layers]

    recorded_groups = []
    for group in groups:
        members = []
        for t in group.trajectories:
            router_replay.set_global_router_replay_action(action.RECORD)
            run(torch.as_tensor(t.tokens)[:, None])
            per_layer = [r.clone() for r in router_replay.get_recorded_data()]  # [n, K] each
            router_replay.clear_global_router_replay_action()
            router_replay.clear_global_indices()
            routes = torch.stack(per_layer, dim=1).numpy().astype(np.uint8)
            members.append(Trajectory(t.tokens, t.assistant_mask, routes=routes))
        recorded_groups.append(TrajectoryGroup(members))
    packed = pack_groups(recorded_groups, PackingConfig(seq_len=24, vocab_size=VOCAB))
    real = packed.segment_ids >= 0  # [rows, seq]
    real_sm = real.t().reshape(-1)
    expected_maps = []
    for layer in range(LAYERS):
        targets = packed.routes.routes[:, :, layer].transpose(0, 1).reshape(-1, TOPK).long()
        expected_maps.append(
            torch.zeros(len(targets), EXPERTS, dtype=torch.bool).scatter(1, targets, True)
        )
    with torch.no_grad():  # the trainer's router has moved on since the rollout
        for layer in layers:
            g = torch.Generator().manual_seed(2)
            layer.router.weight.add_(torch.randn(layer.router.weight.shape, generator=g) * 3)
    run(packed.tokens.t())
    natural_differs = any(
        not torch.equal(m[real_sm], e[real_sm]) for m, e in zip(maps, expected_maps, strict=True)
    )
    with replaying_routes(packed.routes.routes, config, model=layers):
        counts = run(packed.tokens.t(), packed.routes.padding_mask)
    return {
        "packed_natural_routing_differs": natural_differs,
        "packed_shares_prefixes": packed.stats.physical_tokens < packed.stats.logical_tokens,
        "packed_maps_equal": all(
            torch.equal(m[real_sm], e[real_sm]) for m, e in zip(maps, expected_maps, strict=True)
        ),
        "packed_counts_real_only": all(
            torch.equal(c, e[real_sm].sum(0).float())
            for c, e in zip(counts, expected_maps, strict=True)
        ),
        "packed_has_padding": bool((~real).any()),
    }


def _packing_groups():
    """Two prompts x three rollouts, as packing receives them (routes recorded later)."""
    from art_megatron_ext.packing import Trajectory, TrajectoryGroup

    rng = np.random.default_rng(3)
    groups = []
    for _ in range(2):
        prompt = rng.integers(0, VOCAB, 5)
        members = []
        for n in (3, 6, 4):
            tokens = np.concatenate([prompt, rng.integers(0, VOCAB, n)])
            members.append(Trajectory(tokens, np.arange(len(tokens)) >= 5))
        groups.append(TrajectoryGroup(members))
    return groups


@pytest.fixture(scope="module")
def ranks():
    """Needs two spawned gloo ranks with Megatron-core (about 30 s on the 2-core box)."""
    return run_ranks(_replay_worker, world_size=2, args=(_packing_groups(),), timeout_s=300)


def test_replayed_routing_equals_recorded_routing(ranks):
    assert all(r["maps_equal_on_real"] for r in ranks)


def test_replay_overrides_a_router_that_would_route_differently(ranks):
    assert all(r["natural_routing_differs"] for r in ranks)  # the premise holds
    assert all(r["perturbed_maps_equal_on_real"] for r in ranks)


def test_replay_reproduces_the_recorded_forward_and_backward(ranks):
    for r in ranks:
        assert r["forward_diff"] == 0.0
        assert r["grad_diff"] <= 1e-6


def test_replay_on_packed_rows_uses_the_routes_recorded_per_trajectory(ranks):
    for r in ranks:
        assert r["packed_shares_prefixes"] and r["packed_has_padding"]  # the premise holds
        assert r["packed_natural_routing_differs"]
        assert r["packed_maps_equal"]
        assert r["packed_counts_real_only"]


def test_padding_rows_get_the_dummy_route(ranks):
    assert all(r["padding_rows_dummy"] for r in ranks)


def test_padding_rows_do_not_count_toward_expert_bias(ranks):
    for r in ranks:
        assert r["counts_match_real_only"]
        # Teeth: without the mask the dummy route's slots are counted too.
        assert r["unmasked_counts_differ"]
        assert r["unmasked_extra"] == r["padding_slots"]


def test_replay_state_is_cleared_after_the_block(ranks):
    assert all(r["actions_cleared"] for r in ranks)


@pytest.mark.parametrize("vpp", [None, 1])
def test_replay_allowed_without_virtual_pipeline(vpp):
    check_replay_supported(vpp)


def test_replay_refused_with_virtual_pipeline():
    with pytest.raises(RouterReplayError, match="virtual_pipeline_model_parallel_size=2"):
        check_replay_supported(2)
    config = types.SimpleNamespace(
        virtual_pipeline_model_parallel_size=2,
        moe_enable_routing_replay=True,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
    )
    with pytest.raises(RouterReplayError, match="virtual_pipeline"):  # noqa: SIM117
        with replaying_routes(torch.zeros(1, 1, 1, TOPK, dtype=torch.uint8), config):
            pass


def test_targets_are_sequence_major_int64_per_layer():
    routes = torch.arange(2 * 3 * 2 * 2, dtype=torch.int32).reshape(2, 3, 2, 2) % EXPERTS
    targets = replay_targets(routes, num_experts=EXPERTS, topk=2)
    assert [t.dtype for t in targets] == [torch.int64, torch.int64]
    for layer, target in enumerate(targets):
        for s in range(3):
            for b in range(2):
                assert torch.equal(target[s * 2 + b], routes[b, s, layer].long())
    only_second = replay_targets(routes, num_experts=EXPERTS, topk=2, layers=[1])
    assert len(only_second) == 1 and torch.equal(only_second[0], targets[1])


@pytest.mark.parametrize(
    ("routes", "match"),
    [
        (torch.zeros(1, 2, 1, 3, dtype=torch.uint8), "top-3, the routers use top-2"),
        (torch.full((1, 2, 1, 2), EXPERTS, dtype=torch.uint8), "expert id 8 outside"),
        (torch.zeros(2, 1, 2, dtype=torch.uint8), "must be \\[batch, seq, layers, topk\\]"),
    ],
)
def test_targets_reject_bad_routes(routes, match):
    with pytest.raises(RouterReplayError, match=match):
        replay_targets(routes, num_experts=EXPERTS, topk=TOPK)


def test_replay_requires_a_model_built_for_replay():
    config = types.SimpleNamespace(
        virtual_pipeline_model_parallel_size=None,
        moe_enable_routing_replay=False,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
    )
    with pytest.raises(RouterReplayError, match="moe_enable_routing_replay=True"):  # noqa: SIM117
        with replaying_routes(torch.zeros(1, 1, 1, TOPK, dtype=torch.uint8), config):
            pass


def test_replay_refuses_a_layer_count_that_does_not_match_the_routers():
    router_replay, _ = megatron_router_replay()
    saved = list(router_replay.global_router_replay_instances)
    router_replay.clear_global_router_replay_instances()
    try:
        router_replay()  # one router on this "rank"
        config = types.SimpleNamespace(
            virtual_pipeline_model_parallel_size=None,
            moe_enable_routing_replay=True,
            num_moe_experts=EXPERTS,
            moe_router_topk=TOPK,
        )
        routes = torch.zeros(1, 1, 2, TOPK, dtype=torch.uint8)
        with pytest.raises(RouterReplayError, match="2 route layers for 1 routers"):  # noqa: SIM117
            with replaying_routes(routes, config):
                pass
        instance = router_replay.global_router_replay_instances[0]
        with replaying_routes(routes, config, layers=[1]) as control:
            assert instance.target_topk_idx.shape == (1, 2)
            scores = torch.rand(1, EXPERTS)
            _, forward_indices = instance.get_replay_topk(scores, TOPK)
            control.for_recompute()  # recomputation pops the same targets in order
            _, recompute_indices = instance.get_replay_topk(scores, TOPK)
            assert torch.equal(forward_indices, recompute_indices)
        assert instance.target_topk_idx is None and instance.router_replay_action is None
    finally:
        router_replay.global_router_replay_instances[:] = saved


def test_megatron_0_19_expert_bias_cannot_take_a_padding_mask():
    """Why compat.fix_expert_bias_padding_mask exists. When this fails, Megatron fixed the bug
    and the compat fix can go."""
    from megatron.core.transformer.moe.router import TopKRouter

    router = types.SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(8))
    routing_map = torch.zeros(3, EXPERTS, dtype=torch.bool)
    with pytest.raises(RuntimeError, match=r"size of tensor|broadcast"):
        TopKRouter._apply_expert_bias(router, routing_map, torch.tensor([False, True, False]))


def test_expert_bias_fix_counts_only_rows_that_are_not_padding():
    from art_megatron_ext.compat import expert_bias_padding_mask_fixed

    fixed, other = _bare_routers(2)
    routing_map = torch.zeros(3, EXPERTS, dtype=torch.bool)
    routing_map[0, [1, 2]] = routing_map[1, [2, 3]] = routing_map[2, [0, 1]] = True
    padding = torch.tensor([False, True, False])
    with expert_bias_padding_mask_fixed(torch.nn.ModuleList([fixed])):
        with expert_bias_padding_mask_fixed(fixed):  # nested: the inner block changes nothing
            pass
        fixed._apply_expert_bias(routing_map, padding)
        assert fixed.local_tokens_per_expert.tolist() == [1, 2, 1, 0, 0, 0, 0, 0]
        # a router the caller did not hand over keeps Megatron's method (and its bug)
        with pytest.raises(RuntimeError, match=r"size of tensor|broadcast"):
            other._apply_expert_bias(routing_map, padding)
    assert "_apply_expert_bias" not in fixed.__dict__  # restored on exit
    with pytest.raises(RuntimeError, match=r"size of tensor|broadcast"):
        fixed._apply_expert_bias(routing_map, padding)


def _bare_routers(n: int) -> list:
    """`n` real TopKRouter objects without running their constructor (which needs parallel
    state): enough for `_apply_expert_bias`, which reads two attributes."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = []
    for _ in range(n):
        router = TopKRouter.__new__(TopKRouter)
        torch.nn.Module.__init__(router)
        router.enable_expert_bias = True
        router.register_buffer("local_tokens_per_expert", torch.zeros(EXPERTS))
        routers.append(router)
    return routers


def test_replay_with_expert_bias_requires_the_model():
    config = types.SimpleNamespace(
        virtual_pipeline_model_parallel_size=None,
        moe_enable_routing_replay=True,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_router_enable_expert_bias=True,
    )
    router_replay, _ = megatron_router_replay()
    saved = list(router_replay.global_router_replay_instances)
    router_replay.clear_global_router_replay_instances()
    try:
        router_replay()
        with pytest.raises(RouterReplayError, match="pass model="):  # noqa: SIM117
            with replaying_routes(torch.zeros(1, 1, 1, TOPK, dtype=torch.uint8), config):
                pass
    finally:
        router_replay.global_router_replay_instances[:] = saved


def test_the_padding_fix_does_not_outlive_replay(ranks):
    assert all(r["bias_fix_scoped"] for r in ranks)


@pytest.mark.parametrize(
    ("setting", "value", "match"),
    [
        ("virtual_pipeline_model_parallel_size", 2, "virtual_pipeline"),
        ("context_parallel_size", 2, "context_parallel_size=2"),
        ("moe_router_load_balancing_type", "sinkhorn", "sinkhorn"),
        ("moe_router_fusion", True, "fused top-k"),
        ("moe_expert_capacity_factor", 1.0, "token dropping"),
        ("overlap_moe_expert_parallel_comm", True, "overlapped schedule"),
        ("cuda_graph_impl", "local", "captured graph"),
        ("moe_enable_routing_replay", False, "moe_enable_routing_replay=True"),
    ],
)
def test_combinations_that_cannot_be_exact_are_refused_at_configuration(setting, value, match):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from art_megatron_ext.routing.replay import check_replay_config

    fields = dict(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_enable_routing_replay=True,
        use_cpu_initialization=True,
    )
    check_replay_config(TransformerConfig(**fields))  # the baseline is accepted
    config = types.SimpleNamespace(**fields)
    setattr(config, setting, value)
    with pytest.raises(RouterReplayError, match=match):
        check_replay_config(config)
