"""`hybridep.Buffer` with the torch backend on 2 and 4 spawned gloo ranks (CPU).

Each rank runs every case once inside one spawn per world size and returns plain values;
the tests below assert one behaviour each. Expected layouts come from a naive loop over the
all-gathered inputs (`_expected_permuted`), written independently of `hybridep.layout`.
Data are small integers in bf16 so every sum is exact and comparisons are bitwise.
"""

from __future__ import annotations

import pytest
import torch
from support.train_ranks import run_ranks

HIDDEN = 8
LOCAL_EXPERTS = 3
TOKENS = 10
TOPK = 3


def _inputs(rank: int, world: int, seed: int, allowed: list[int] | None = None):
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    experts = world * LOCAL_EXPERTS
    allowed_t = torch.tensor(allowed if allowed is not None else list(range(experts)))
    hidden = torch.randint(-4, 5, (TOKENS, HIDDEN), generator=gen).to(torch.bfloat16)
    routing = torch.zeros(TOKENS, experts, dtype=torch.bool)
    for t in range(TOKENS):
        k = int(torch.randint(0, TOPK + 1, (1,), generator=gen))  # 0..TOPK experts, some none
        pick = allowed_t[torch.randperm(len(allowed_t), generator=gen)[: min(k, len(allowed_t))]]
        routing[t, pick] = True
    probs = torch.rand(TOKENS, experts, generator=gen) * routing
    return hidden, routing, probs


def _gather(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return torch.stack(out)


def _expected_permuted(rank, hidden_all, routing_all, probs_all, pad, budget):
    """Naive: expert-major blocks of (source, token) rows, padded, clamped to the budget."""
    world = hidden_all.shape[0]
    rows, probs, counts, dropped = [], [], [], 0
    for e in range(LOCAL_EXPERTS):
        g = rank * LOCAL_EXPERTS + e
        block = [(s, t) for s in range(world) for t in range(TOKENS) if routing_all[s, t, g]]
        padded = -(-len(block) // pad) * pad
        start = len(rows)
        room = padded if budget is None else max(0, min(padded, budget - start))
        kept = block[:room]
        dropped += len(block) - len(kept)
        rows += [hidden_all[s, t].float() for s, t in kept]
        probs += [float(probs_all[s, t, g]) for s, t in kept]
        rows += [torch.zeros(HIDDEN)] * (room - len(kept))
        probs += [0.0] * (room - len(kept))
        counts.append(room)
    total = len(rows) if budget is None else budget
    rows += [torch.zeros(HIDDEN)] * (total - len(rows))
    probs += [0.0] * (total - len(probs))
    stacked = torch.stack(rows) if rows else torch.zeros(0, HIDDEN)
    return stacked.to(torch.bfloat16), torch.tensor(probs), counts, dropped


def _expert_scale(tokens_per_expert: torch.Tensor, rows: int) -> torch.Tensor:
    """Row multiplier (local expert index + 1) for an expert-major layout."""
    scale = torch.repeat_interleave(
        torch.arange(1, LOCAL_EXPERTS + 1, dtype=torch.float32), tokens_per_expert.cpu()
    )
    return torch.cat([scale, torch.zeros(rows - scale.numel())]).unsqueeze(1)


def _expected_combined(rank, hidden, routing):
    world_experts = routing.shape[1]
    out = torch.zeros(TOKENS, HIDDEN)
    for t in range(TOKENS):
        for g in range(world_experts):
            if routing[t, g]:
                out[t] += (g % LOCAL_EXPERTS + 1) * hidden[t].float()
    return out.to(torch.bfloat16)


def _errors(buf, hidden, routing, probs):
    """Each bad input and the message fragment its error must carry."""
    import hybridep

    bad_calls = {
        "routing_shape": (
            lambda: buf.dispatch_with_permute(
                hidden=hidden, routing_map=routing[:, :-1], probs=None
            ),
            "routing_map shape",
        ),
        "routing_dtype": (
            lambda: buf.dispatch_with_permute(hidden=hidden, routing_map=routing.int(), probs=None),
            "bool",
        ),
        "probs_dtype": (
            lambda: buf.dispatch_with_permute(
                hidden=hidden, routing_map=routing, probs=probs.to(torch.bfloat16)
            ),
            "float32",
        ),
        "hidden_size": (
            lambda: buf.dispatch_with_permute(
                hidden=hidden[:, :-1], routing_map=routing, probs=probs
            ),
            "hidden size mismatch",
        ),
        "budget_not_multiple": (
            lambda: buf.dispatch_with_permute(
                hidden=hidden, routing_map=routing, pad_multiple=4, num_permuted_tokens=6
            ),
            "multiple of pad_multiple",
        ),
        "non_blocking_without_budget": (
            lambda: buf.dispatch_with_permute(
                hidden=hidden, routing_map=routing, non_blocking=True
            ),
            "needs num_permuted_tokens",
        ),
        "experts_per_rank": (
            lambda: buf.dispatch_with_permute(
                hidden=hidden, routing_map=routing, num_of_experts_per_rank=LOCAL_EXPERTS + 1
            ),
            "num_of_experts_per_rank",
        ),
        "cuda_backend": (
            lambda: hybridep.Buffer(buf.group, HIDDEN, 32, LOCAL_EXPERTS, backend="cuda"),
            "cannot run",
        ),
        "fp8": (lambda: hybridep.Buffer(buf.group, HIDDEN, 32, LOCAL_EXPERTS, use_fp8=True), "fp8"),
    }
    out = {}
    for name, (call, fragment) in bad_calls.items():
        try:
            call()
            out[name] = "no error"
        except (ValueError, TypeError, NotImplementedError, RuntimeError) as exc:
            out[name] = "ok" if fragment in str(exc) else f"{type(exc).__name__}: {exc}"
    return out


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import hybridep

    group = dist.group.WORLD
    buf = hybridep.Buffer(group, HIDDEN, 2 * TOKENS, LOCAL_EXPERTS, backend="auto")
    res: dict = {
        "backend": buf.backend.name,
        "implements_protocol": isinstance(buf.backend, hybridep.HybridEPBackend),
    }
    experts = world * LOCAL_EXPERTS
    scenarios = {
        "uniform": None,
        "idle_experts": [e for e in range(experts) if e % 2 == 0],
        "one_rank_only": list(range(LOCAL_EXPERTS)),
    }
    for seed, (name, allowed) in enumerate(scenarios.items()):
        hidden, routing, probs = _inputs(rank, world, seed, allowed)
        all_h, all_r, all_p = _gather(hidden), _gather(routing), _gather(probs)
        for pad in (1, 4):
            key = f"{name}/pad{pad}"
            tokens, tprobs, scale, tpe, handle = buf.dispatch_with_permute(
                hidden=hidden,
                routing_map=routing,
                probs=probs,
                scaling_factor=None,
                num_of_experts_per_rank=LOCAL_EXPERTS,
                pad_multiple=pad,
            )
            exp_tokens, exp_probs, exp_counts, _ = _expected_permuted(
                rank, all_h, all_r, all_p, pad, None
            )
            # Identity-like experts: multiply each block by (local expert + 1), then combine.
            scaled = (tokens.float() * _expert_scale(tpe, tokens.shape[0])).to(torch.bfloat16)
            combined, back_probs = buf.combine_with_unpermute(
                hidden=scaled, probs=tprobs, handle=handle, pad_multiple=pad
            )
            again, again_probs, _, _, _ = buf.dispatch_with_permute(
                hidden=hidden, handle=handle, pad_multiple=pad
            )
            res[key] = {
                "tokens_bitwise": torch.equal(tokens, exp_tokens),
                "probs_bitwise": torch.equal(tprobs, exp_probs),
                "scale_none": scale is None,
                "counts": tpe.tolist() == exp_counts,
                "counts_cpu_int64": tpe.device.type == "cpu" and tpe.dtype == torch.int64,
                "combine_bitwise": torch.equal(combined, _expected_combined(rank, hidden, routing)),
                "probs_round_trip": torch.equal(back_probs, probs * routing),
                "handle_reuse_tokens": torch.equal(again, tokens),
                "handle_reuse_no_probs": again_probs is None,
                "overflow_zero": int(handle[-1].item()) == 0,
            }
            # Static budget, large enough: same result as blocking, no overflow.
            budget = -(-(len(exp_tokens) + 2 * pad) // pad) * pad
            s_tokens, s_probs, _, s_tpe, s_handle = buf.dispatch_with_permute(
                hidden=hidden,
                routing_map=routing,
                probs=probs,
                pad_multiple=pad,
                num_permuted_tokens=budget,
                non_blocking=True,
            )
            s_scaled = (s_tokens.float() * _expert_scale(s_tpe, budget)).to(torch.bfloat16)
            s_combined, s_back = buf.combine_with_unpermute(
                hidden=s_scaled, probs=s_probs, handle=s_handle, pad_multiple=pad
            )
            res[key]["static_equals_blocking"] = (
                torch.equal(s_tokens[: len(exp_tokens)], tokens)
                and not s_tokens[len(exp_tokens) :].any()
                and torch.equal(s_combined, combined)
                and torch.equal(s_back, back_probs)
                and s_tpe.tolist() == tpe.tolist()
            )
            res[key]["static_no_overflow"] = int(s_handle[-1].item()) == 0
            # Static budget too small: exact drop set, overflow flag where something dropped.
            small = pad * max(1, len(exp_tokens) // (2 * pad))
            d_tokens, d_probs, _, d_tpe, d_handle = buf.dispatch_with_permute(
                hidden=hidden,
                routing_map=routing,
                probs=probs,
                pad_multiple=pad,
                num_permuted_tokens=small,
                non_blocking=True,
            )
            e_tokens, e_probs, e_counts, e_dropped = _expected_permuted(
                rank, all_h, all_r, all_p, pad, small
            )
            res[key]["budget_drop_exact"] = (
                torch.equal(d_tokens, e_tokens)
                and torch.equal(d_probs, e_probs)
                and d_tpe.tolist() == e_counts
            )
            res[key]["budget_overflow_flag"] = bool(d_handle[-1].item()) == (e_dropped > 0)
            res[key]["budget_dropped"] = e_dropped
        # Plain dispatch / combine (no permute), blocking and static layouts.
        recv, recv_probs, _, p_handle = buf.dispatch(
            hidden=hidden, routing_map=routing, probs=probs
        )
        exp_rows = [
            (s, t)
            for s in range(world)
            for t in range(TOKENS)
            if all_r[s, t, rank * LOCAL_EXPERTS : (rank + 1) * LOCAL_EXPERTS].any()
        ]
        lo = rank * LOCAL_EXPERTS
        exp_recv = torch.stack([all_h[s, t] for s, t in exp_rows]) if exp_rows else recv[:0]
        exp_rprobs = (
            torch.stack([all_p[s, t, lo : lo + LOCAL_EXPERTS] for s, t in exp_rows])
            if exp_rows
            else recv_probs[:0]
        )
        out, out_probs = buf.combine(hidden=recv, probs=recv_probs, handle=p_handle)
        need = routing.view(TOKENS, world, LOCAL_EXPERTS).any(-1).sum(1, keepdim=True)
        st_recv, st_probs, _, st_handle = buf.dispatch(
            hidden=hidden, routing_map=routing, probs=probs, non_blocking=True
        )
        st_out, st_out_probs = buf.combine(hidden=st_recv, probs=st_probs, handle=st_handle)
        res[f"{name}/plain"] = {
            "recv_bitwise": torch.equal(recv, exp_recv),
            "recv_probs_bitwise": torch.equal(recv_probs, exp_rprobs),
            "combine_is_rank_count_times_x": torch.equal(
                out, (need.float() * hidden.float()).to(torch.bfloat16)
            ),
            "combine_probs": torch.equal(out_probs, probs),
            "static_combine_equal": torch.equal(st_out, out) and torch.equal(st_out_probs, probs),
            "static_rows": st_recv.shape[0] == world * TOKENS,
        }
    hidden, routing, probs = _inputs(rank, world, 99)
    res["errors"] = _errors(buf, hidden, routing, probs)
    # Different token counts per rank (a caller bug): a clear error on every rank when
    # blocking; with a static budget (no host reads) the overflow flag, and no crash or hang.
    short_hidden, short_routing = hidden[: TOKENS - rank], routing[: TOKENS - rank]
    try:
        buf.dispatch_with_permute(hidden=short_hidden, routing_map=short_routing)
        res["uneven_blocking"] = "no error"
    except ValueError as exc:
        res["uneven_blocking"] = "ok" if "different token counts" in str(exc) else str(exc)
    tokens, _, _, _, handle = buf.dispatch_with_permute(
        hidden=short_hidden, routing_map=short_routing, num_permuted_tokens=8 * TOKENS
    )
    buf.combine_with_unpermute(hidden=tokens, handle=handle)
    res["uneven_static_flag"] = int(handle[-1].item())
    res["zero_tokens"] = _zero_tokens(buf, world)
    res["growth"] = _growth(rank, world)
    return res


def _round_trip(buf, hidden, routing, probs, pad, budget=None):
    """dispatch_with_permute -> (local expert + 1) scaling -> combine_with_unpermute."""
    tokens, tprobs, _, tpe, handle = buf.dispatch_with_permute(
        hidden=hidden, routing_map=routing, probs=probs, pad_multiple=pad,
        num_permuted_tokens=budget, non_blocking=budget is not None,
    )  # fmt: skip
    scaled = (tokens.float() * _expert_scale(tpe, tokens.shape[0])).to(torch.bfloat16)
    out, back = buf.combine_with_unpermute(hidden=scaled, probs=tprobs, handle=handle)
    return tokens, tpe, out, back, int(handle[-1].item())


def _zero_tokens(buf, world: int) -> dict:
    """Every rank passes T = 0: empty outputs, zero counts, no flag, blocking and static."""
    hidden = torch.zeros(0, HIDDEN, dtype=torch.bfloat16)
    routing = torch.zeros(0, world * LOCAL_EXPERTS, dtype=torch.bool)
    probs = torch.zeros(0, world * LOCAL_EXPERTS)
    out = {}
    for mode, budget in (("blocking", None), ("static", 8)):
        tokens, tpe, combined, back, flag = _round_trip(buf, hidden, routing, probs, 4, budget)
        out[mode] = (
            tokens.shape == ((0 if budget is None else budget), HIDDEN)
            and not tokens.any()
            and tpe.tolist() == [0] * LOCAL_EXPERTS
            and combined.shape == (0, HIDDEN)
            and back.shape == (0, world * LOCAL_EXPERTS)
            and flag == 0
        )
    return out


class _Records(__import__("logging").Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


def _growth(rank: int, world: int) -> dict:
    """A dispatch with more tokens than the buffer was built for grows it on every rank."""
    import logging

    import torch.distributed as dist

    import hybridep

    records = _Records()
    logging.getLogger("hybridep.buffer").addHandler(records)
    group = dist.group.WORLD
    res: dict = {}
    big = 4 * TOKENS
    hidden, routing, probs = _inputs(rank, world, 5)
    hidden, routing, probs = (torch.cat([t] * 4) for t in (hidden, routing, probs))
    ref = hybridep.Buffer(group, HIDDEN, big, LOCAL_EXPERTS, backend="torch")
    expected = _round_trip(ref, hidden, routing, probs, 4)
    for mode, budget in (("blocking", None), ("static", 4 * big * LOCAL_EXPERTS)):
        records.messages.clear()
        small = hybridep.Buffer(group, HIDDEN, TOKENS, LOCAL_EXPERTS, backend="torch")
        first = _round_trip(small, hidden[:TOKENS], routing[:TOKENS], probs[:TOKENS], 4, budget)
        grown = _round_trip(small, hidden, routing, probs, 4, budget)
        again = _round_trip(small, hidden, routing, probs, 4, budget)
        same = all(
            torch.equal(g[:n], e) and not g[n:].any()
            for g, e, n in ((grown[0], expected[0], expected[0].shape[0]),)
        ) and all(torch.equal(a, b) for a, b in zip(grown[2:4], expected[2:4], strict=True))
        res[mode] = {
            "first_ok": first[4] == 0,
            "equals_large_buffer": same and torch.equal(again[2], expected[2]),
            "capacity": small.max_num_of_tokens_per_rank,
            "logged": [m for m in records.messages if "growing the buffer" in m],
        }
    # Different counts, some above the capacity: every rank raises, none grows.
    records.messages.clear()
    small = hybridep.Buffer(group, HIDDEN, TOKENS, LOCAL_EXPERTS, backend="torch")
    mine = TOKENS + 1 + 70 * rank
    try:
        small.dispatch_with_permute(
            hidden=torch.zeros(mine, HIDDEN, dtype=torch.bfloat16),
            routing_map=torch.zeros(mine, world * LOCAL_EXPERTS, dtype=torch.bool),
        )
        res["uneven"] = "no error"
    except ValueError as exc:
        res["uneven"] = "ok" if "different token counts" in str(exc) else str(exc)
    res["uneven_capacity"] = small.max_num_of_tokens_per_rank
    res["after_uneven_ok"] = _round_trip(small, hidden, routing, probs, 4)[4] == 0
    logging.getLogger("hybridep.buffer").removeHandler(records)
    return res


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def results(request) -> list[dict]:
    return run_ranks(_worker, request.param, timeout_s=300)


KEYS = [f"{s}/pad{p}" for s in ("uniform", "idle_experts", "one_rank_only") for p in (1, 4)]
PLAIN = [f"{s}/plain" for s in ("uniform", "idle_experts", "one_rank_only")]


def _check(results: list[dict], keys: list[str], field: str) -> None:
    bad = [
        (rank, key) for rank, r in enumerate(results) for key in keys if r[key][field] is not True
    ]
    assert not bad, f"{field} failed at (rank, case): {bad}"


def test_auto_backend_is_torch_on_cpu(results):
    assert {r["backend"] for r in results} == {"torch"}


def test_torch_backend_implements_the_backend_protocol(results):
    assert all(r["implements_protocol"] for r in results)


def test_dispatch_with_permute_is_expert_major_padded_and_bitwise(results):
    _check(results, KEYS, "tokens_bitwise")
    _check(results, KEYS, "scale_none")


def test_dispatched_probs_are_the_routed_experts_probs(results):
    _check(results, KEYS, "probs_bitwise")


def test_tokens_per_expert_are_padded_column_sums_on_host(results):
    _check(results, KEYS, "counts")
    _check(results, KEYS, "counts_cpu_int64")


def test_combine_sums_each_tokens_expert_outputs_exactly(results):
    _check(results, KEYS, "combine_bitwise")


def test_probs_round_trip_through_combine_is_bitwise(results):
    _check(results, KEYS, "probs_round_trip")


def test_handle_reuse_reproduces_the_layout(results):
    _check(results, KEYS, "handle_reuse_tokens")
    _check(results, KEYS, "handle_reuse_no_probs")
    _check(results, KEYS, "overflow_zero")


def test_static_budget_equals_blocking_when_large_enough(results):
    _check(results, KEYS, "static_equals_blocking")
    _check(results, KEYS, "static_no_overflow")


def test_static_budget_drops_exactly_and_flags_overflow(results):
    _check(results, KEYS, "budget_drop_exact")
    _check(results, KEYS, "budget_overflow_flag")
    assert any(r[k]["budget_dropped"] > 0 for r in results for k in KEYS), "no case dropped"


def test_plain_dispatch_rows_are_source_then_token_order(results):
    _check(results, PLAIN, "recv_bitwise")
    _check(results, PLAIN, "recv_probs_bitwise")
    _check(results, PLAIN, "static_rows")


def test_plain_combine_sums_over_ranks_and_scatters_probs(results):
    _check(results, PLAIN, "combine_is_rank_count_times_x")
    _check(results, PLAIN, "combine_probs")
    _check(results, PLAIN, "static_combine_equal")


@pytest.mark.parametrize(
    "name",
    [
        "routing_shape",
        "routing_dtype",
        "probs_dtype",
        "hidden_size",
        "budget_not_multiple",
        "non_blocking_without_budget",
        "experts_per_rank",
        "cuda_backend",
        "fp8",
    ],
)
def test_bad_input_raises_a_clear_error(results, name):
    assert all(r["errors"][name] == "ok" for r in results), [r["errors"][name] for r in results]


def test_uneven_token_counts_raise_when_blocking_and_flag_when_static(results):
    assert all(r["uneven_blocking"] == "ok" for r in results), [
        r["uneven_blocking"] for r in results
    ]
    assert all(r["uneven_static_flag"] != 0 for r in results)


def test_zero_tokens_on_every_rank_give_empty_results_blocking_and_static(results):
    for rank, r in enumerate(results):
        assert r["zero_tokens"] == {"blocking": True, "static": True}, (rank, r["zero_tokens"])


@pytest.mark.parametrize("mode", ["blocking", "static"])
def test_a_larger_dispatch_grows_the_buffer_once_and_logs_it_once(results, mode):
    for rank, r in enumerate(results):
        got = r["growth"][mode]
        assert got["first_ok"], rank
        assert got["equals_large_buffer"], f"rank {rank}: grown buffer differs from a large one"
        assert got["capacity"] == 64, got["capacity"]  # 40 tokens rounded up to the chunk (64)
        assert len(got["logged"]) == 1, got["logged"]  # the repeat at 40 tokens does not grow
        assert "40 tokens per rank" in got["logged"][0], got["logged"][0]


def test_uneven_counts_above_the_capacity_raise_on_every_rank_without_growing(results):
    """The counts are exchanged before any growth: every rank raises at the same call (no rank
    left in a reallocation collective) and the buffer stays as it was, still usable."""
    for rank, r in enumerate(results):
        assert r["growth"]["uneven"] == "ok", (rank, r["growth"]["uneven"])
        assert r["growth"]["uneven_capacity"] == TOKENS
        assert r["growth"]["after_uneven_ok"]
