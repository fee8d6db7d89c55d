"""Router replay under sequence parallelism: with TP = 2 and `sequence_parallel`, each rank's
routers see only its half of the sequence (Megatron scatters the sequence dimension in equal
contiguous parts), and replay hands each rank exactly the routes of its half.

Two spawned gloo ranks, real `MoELayer`s (TP = 2, sequence parallel, alltoall dispatcher,
selective `moe` recompute so the routers also run inside the backward), driven through
`replaying_schedule` with two micro-batches in 1F1B order (both forwards, then both
backwards). The whole sequence's routes go in; every router call must select the given experts
of the rank's own positions. The given routes are random, not what the routers would pick.
(The local-spec GPT cannot run sequence parallel: its torch norms refuse it, so the layers are
driven directly.)
"""

from __future__ import annotations

import pytest
import torch
from support.train_ranks import run_ranks

from art_megatron_ext.routing.replay import RouterReplayError, replay_targets

SEQ, BATCH, HIDDEN, LAYERS, TOPK, EXPERTS, NUM_MB = 8, 2, 16, 2, 2, 8, 2


def _routes(mb: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(50 + mb)
    return torch.rand(BATCH, SEQ, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOPK].byte()


def _sp_worker(rank: int, world_size: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from support.megatron_cpu import build_moe_layer, cpu_shim, megatron_parallel, moe_test_config

    from art_megatron_ext.compat import megatron_router_replay
    from art_megatron_ext.lora.cpu_runtime import cpu_megatron
    from art_megatron_ext.routing.schedule import replaying_schedule

    router_replay, _ = megatron_router_replay()
    out: dict = {}
    with cpu_shim(), megatron_parallel(tp=world_size), cpu_megatron():
        router_replay.clear_global_router_replay_instances()
        config = moe_test_config(
            num_layers=LAYERS,
            tensor_model_parallel_size=world_size,
            moe_enable_routing_replay=True,
            recompute_granularity="selective",
            recompute_modules=["moe"],
        )
        assert config.sequence_parallel
        torch.manual_seed(0)
        layers = [build_moe_layer(config, layer_number=i + 1).train() for i in range(LAYERS)]
        calls: list[tuple[int, bool, torch.Tensor]] = []
        for index, layer in enumerate(layers):

            def hook(module, args, output, index=index):
                in_backward = torch._C._current_graph_task_id() != -1
                calls.append((index, in_backward, output[1].detach().clone()))

            layer.router.register_forward_hook(hook)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        part = SEQ // world_size
        inputs = [
            torch.randn(
                part, BATCH, HIDDEN, generator=torch.Generator().manual_seed(rank * 10 + m)
            ).requires_grad_()
            for m in range(NUM_MB)
        ]
        routes = [_routes(mb) for mb in range(NUM_MB)]

        def forward_step(mb):
            h = inputs[mb]
            for layer in layers:
                h, _ = layer(h)
            return h

        def run(wrap):
            calls.clear()
            step = wrap(forward_step)
            outputs = [step(mb) for mb in range(NUM_MB)]  # both forwards first, as 1F1B warmup
            for o in outputs:
                o.sum().backward()
            return list(calls)

        with replaying_schedule(routes, config) as replay:
            replayed = run(replay.wrap)
        natural = run(lambda f: f)

        def check(recorded):
            seen: dict = {}
            result = []
            for index, in_backward, routing_map in recorded:
                mb = seen.get((index, in_backward), 0)
                seen[(index, in_backward)] = mb + 1
                local = routes[mb][:, tp_rank * part : (tp_rank + 1) * part, index]
                given = local.transpose(0, 1).reshape(-1, TOPK).long()
                expected = torch.zeros_like(routing_map, dtype=torch.bool).scatter(1, given, True)
                result.append((index, in_backward, mb, bool(torch.equal(routing_map, expected))))
            return result

        out["replayed"] = check(replayed)
        out["natural"] = check(natural)
        out["router_tokens"] = int(replayed[0][2].shape[0])
        router_replay.clear_global_router_replay_instances()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_sp_worker, world_size=2, timeout_s=600)


def test_each_sequence_parallel_rank_replays_the_routes_of_its_own_tokens(ranks):
    for rank in ranks:
        assert rank["router_tokens"] == SEQ // 2 * BATCH  # the premise: routers see a shard
        checks = rank["replayed"]
        assert len([c for c in checks if not c[1]]) == LAYERS * NUM_MB
        assert len([c for c in checks if c[1]]) == LAYERS * NUM_MB  # recompute ran
        assert all(c[3] for c in checks), [c[:3] for c in checks if not c[3]]


def test_the_given_routes_are_not_the_routers_own(ranks):
    for rank in ranks:
        assert not any(c[3] for c in rank["natural"])


def test_shard_takes_contiguous_equal_parts_of_the_sequence():
    routes = _routes(0)
    full = replay_targets(routes, num_experts=EXPERTS, topk=TOPK)
    halves = [
        replay_targets(routes, num_experts=EXPERTS, topk=TOPK, shard=(r, 2)) for r in range(2)
    ]
    for layer in range(LAYERS):
        assert torch.equal(torch.cat([h[layer] for h in halves]), full[layer])


def test_shard_refuses_a_sequence_it_cannot_split():
    with pytest.raises(RouterReplayError, match="sequence length 8 cannot be split into 3"):
        replay_targets(_routes(0), num_experts=EXPERTS, topk=TOPK, shard=(0, 3))
