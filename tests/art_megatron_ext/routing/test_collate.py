"""Route collation: recorded routes land where the layout says, everything else holds the
distinct dummy route 0..topk-1 with padding_mask True, dtypes promote without a scan, and bad
input is refused naming the trajectory."""

import itertools

import numpy as np
import pytest
import torch

from art_megatron_ext.routing.collate import (
    RoutePlacement,
    RouteSegment,
    RouteValidationError,
    chain_routes,
    collate_padded_routes,
    collate_routes,
)

LAYERS, TOPK = 3, 2


def _routes(rng, counts, dtype=np.uint8, num_experts=8):
    return [rng.integers(2, num_experts, size=(n, LAYERS, TOPK)).astype(dtype) for n in counts]


def _is_dummy(region):
    return bool((region == torch.arange(TOPK, dtype=region.dtype)).all())


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_puts_each_trajectory_on_its_side(side):
    rng = np.random.default_rng(0)
    routes = _routes(rng, [4, 7, 0])
    out = collate_padded_routes(
        routes, [4, 7, 0], seq_len=7, num_layers=LAYERS, topk=TOPK, padding_side=side
    )
    assert out.routes.shape == (3, 7, LAYERS, TOPK) and out.routes.dtype == torch.uint8
    for row, array in enumerate(routes):
        n = len(array)
        live = slice(0, n) if side == "right" else slice(7 - n, 7)
        pad = slice(n, 7) if side == "right" else slice(0, 7 - n)
        np.testing.assert_array_equal(out.routes[row, live].numpy(), array)
        assert _is_dummy(out.routes[row, pad])
        assert not out.padding_mask[row, live].any() and out.padding_mask[row, pad].all()


def test_dummy_routes_are_distinct_experts_so_dropless_counts_hold():
    out = collate_padded_routes([None], [0], seq_len=5, num_layers=LAYERS, topk=TOPK)
    routes = out.routes.reshape(-1, TOPK)
    assert all(len(set(token.tolist())) == TOPK for token in routes)
    assert out.padding_mask.all()


def test_uncaptured_suffix_is_filled_as_padding():
    rng = np.random.default_rng(1)
    short = _routes(rng, [3])[0]  # trajectory has 5 tokens, routes for the first 3
    out = collate_padded_routes([short], [5], seq_len=6, num_layers=LAYERS, topk=TOPK)
    np.testing.assert_array_equal(out.routes[0, :3].numpy(), short)
    assert _is_dummy(out.routes[0, 3:])
    assert out.padding_mask[0].tolist() == [False] * 3 + [True] * 3


def test_mixed_dtypes_promote_to_the_widest():
    rng = np.random.default_rng(2)
    a, b = _routes(rng, [2], np.uint8)[0], _routes(rng, [3], np.int16, num_experts=1000)[0]
    out = collate_padded_routes([a, b], [2, 3], seq_len=3, num_layers=LAYERS, topk=TOPK)
    assert out.routes.dtype == torch.int16
    np.testing.assert_array_equal(out.routes[1].numpy(), b)
    c = _routes(rng, [1], np.uint16, num_experts=60_000)[0]
    out = collate_padded_routes([a, c], [2, 1], seq_len=2, num_layers=LAYERS, topk=TOPK)
    assert out.routes.dtype == torch.int32
    np.testing.assert_array_equal(out.routes[1, :1].numpy(), c)


def test_accepts_torch_tensors():
    rng = np.random.default_rng(3)
    array = _routes(rng, [4], np.int32)[0]
    out = collate_padded_routes(
        [torch.from_numpy(array)], [4], seq_len=4, num_layers=LAYERS, topk=TOPK
    )
    np.testing.assert_array_equal(out.routes[0].numpy(), array)


def test_placements_write_segments_of_several_trajectories_into_one_row():
    rng = np.random.default_rng(4)
    a, b = _routes(rng, [6, 4])
    placements = [
        RoutePlacement(trajectory=0, row=0, start=0, length=6),
        RoutePlacement(trajectory=1, row=0, start=8, length=2, source_start=2),
    ]
    out = collate_routes(
        [a, b], [6, 4], placements, batch=1, seq_len=12, num_layers=LAYERS, topk=TOPK
    )
    np.testing.assert_array_equal(out.routes[0, :6].numpy(), a)
    np.testing.assert_array_equal(out.routes[0, 8:10].numpy(), b[2:4])
    assert _is_dummy(out.routes[0, 6:8]) and _is_dummy(out.routes[0, 10:])
    assert out.padding_mask[0].tolist() == [False] * 6 + [True] * 2 + [False] * 2 + [True] * 2


@pytest.mark.parametrize(
    ("routes", "counts", "match"),
    [
        (
            [np.zeros((2, LAYERS, TOPK), np.uint8), np.zeros((5, LAYERS, TOPK), np.uint8)],
            [2, 4],
            "trajectory 1: routes cover 5 tokens but the trajectory has 4",
        ),
        (
            [np.zeros((2, LAYERS, TOPK), np.uint8), np.zeros((2, LAYERS, 3), np.uint8)],
            [2, 2],
            "trajectory 1: routes shape",
        ),
        ([np.zeros((2, LAYERS, TOPK), np.int64)], [2], "trajectory 0: routes dtype int64"),
        ([np.zeros((2, LAYERS, TOPK), np.float32)], [2], "trajectory 0: routes dtype float32"),
        ([[1, 2]], [2], "trajectory 0: routes must be a numpy array"),
        ([None], [9], "trajectory 0: 9 tokens do not fit a row of 8"),
    ],
)
def test_rejects_bad_routes_naming_the_trajectory(routes, counts, match):
    with pytest.raises(RouteValidationError, match=match):
        collate_padded_routes(routes, counts, seq_len=8, num_layers=LAYERS, topk=TOPK)


def test_rejects_overlapping_placements():
    placements = [
        RoutePlacement(trajectory=0, row=0, start=0, length=4),
        RoutePlacement(trajectory=1, row=0, start=3, length=2),
    ]
    with pytest.raises(RouteValidationError, match="trajectories 0 and 1 overlap in row 0"):
        collate_routes(
            [None, None], [4, 2], placements, batch=1, seq_len=8, num_layers=LAYERS, topk=TOPK
        )


def test_rejects_a_placement_past_the_trajectory_end():
    placements = [RoutePlacement(trajectory=0, row=0, start=0, length=3, source_start=2)]
    with pytest.raises(RouteValidationError, match="trajectory 0: tokens \\[2, 5\\) outside"):
        collate_routes([None], [4], placements, batch=1, seq_len=8, num_layers=LAYERS, topk=TOPK)


def test_every_output_byte_is_written_exactly_once(monkeypatch):
    """Count the bytes np.copyto writes into the output: exactly its size, no prefill."""
    import art_megatron_ext.routing.collate as collate_module

    written = []
    real_copyto = np.copyto

    def counting_copyto(dst, src, **kwargs):
        written.append(dst.nbytes)
        real_copyto(dst, src, **kwargs)

    monkeypatch.setattr(collate_module.np, "copyto", counting_copyto)
    rng = np.random.default_rng(5)
    out = collate_padded_routes(
        _routes(rng, [3, 8, 5]), [4, 8, 6], seq_len=9, num_layers=LAYERS, topk=TOPK
    )
    assert sum(written) == out.routes.numel() * out.routes.element_size()


def test_reused_buffer_gives_the_same_result_as_a_fresh_one():
    rng = np.random.default_rng(6)
    routes, counts = _routes(rng, [3, 5]), [4, 5]
    fresh = collate_padded_routes(routes, counts, seq_len=6, num_layers=LAYERS, topk=TOPK)
    buffer = collate_padded_routes(
        _routes(rng, [6, 6, 6]), [6, 6, 6], seq_len=6, num_layers=LAYERS, topk=TOPK
    )  # three rows of other data: garbage for this batch
    reused = collate_padded_routes(
        routes, counts, seq_len=6, num_layers=LAYERS, topk=TOPK, out=buffer
    )
    assert torch.equal(reused.routes, fresh.routes)
    assert torch.equal(reused.padding_mask, fresh.padding_mask)
    assert reused.routes.data_ptr() == buffer.routes.data_ptr()


def test_a_buffer_that_does_not_fit_is_refused():
    rng = np.random.default_rng(7)
    small = collate_padded_routes(_routes(rng, [2]), [2], seq_len=6, num_layers=LAYERS, topk=TOPK)
    with pytest.raises(RouteValidationError, match="out buffers"):
        collate_padded_routes(
            _routes(rng, [2, 2]), [2, 2], seq_len=6, num_layers=LAYERS, topk=TOPK, out=small
        )
    wide = _routes(rng, [2], np.int16)
    with pytest.raises(RouteValidationError, match="int16 routes"):
        collate_padded_routes(wide, [2], seq_len=6, num_layers=LAYERS, topk=TOPK, out=small)


# --- Multi-turn chains of segments -----------------------------------------------------------


def _turns(rng, tokens, cuts, dtypes):
    """Segments covering tokens[cut_i:cut_{i+1}] with the given dtypes (token ids attached)."""
    out = []
    for (lo, hi), dtype in zip(itertools.pairwise(cuts), dtypes, strict=True):
        rows = rng.integers(2, 8, size=(hi - lo, LAYERS, TOPK)).astype(dtype)
        out.append(RouteSegment(start=lo, rows=rows, token_ids=tokens[lo:hi]))
    return out


def test_chain_of_turns_lands_in_place_and_gaps_are_masked():
    rng = np.random.default_rng(20)
    tokens = rng.integers(0, 100, 12)
    first, second = _turns(rng, tokens, [0, 5, 9], [np.uint8, np.uint8])
    # turn 2's rows arrive before turn 1's; positions 9..11 were never captured
    chain = chain_routes(0, tokens, [second, first], num_layers=LAYERS, topk=TOPK)
    out = collate_padded_routes([chain], [12], seq_len=14, num_layers=LAYERS, topk=TOPK)
    np.testing.assert_array_equal(out.routes[0, :5].numpy(), first.rows)
    np.testing.assert_array_equal(out.routes[0, 5:9].numpy(), second.rows)
    assert _is_dummy(out.routes[0, 9:])
    assert out.padding_mask[0].tolist() == [False] * 9 + [True] * 5


def test_a_gap_between_turns_is_masked_not_shifted():
    rng = np.random.default_rng(21)
    tokens = rng.integers(0, 100, 10)
    first, _, third = _turns(rng, tokens, [0, 3, 6, 10], [np.uint8] * 3)
    chain = chain_routes(4, tokens, [first, third], num_layers=LAYERS, topk=TOPK)
    out = collate_padded_routes(
        [chain], [10], seq_len=10, num_layers=LAYERS, topk=TOPK, padding_side="left"
    )
    np.testing.assert_array_equal(out.routes[0, :3].numpy(), first.rows)
    assert _is_dummy(out.routes[0, 3:6])
    np.testing.assert_array_equal(out.routes[0, 6:].numpy(), third.rows)
    assert out.padding_mask[0].tolist() == [False] * 3 + [True] * 3 + [False] * 4


def test_chain_promotes_to_the_widest_segment_dtype_from_dtypes_alone():
    rng = np.random.default_rng(22)
    tokens = rng.integers(0, 100, 8)
    segments = _turns(rng, tokens, [0, 4, 8], [np.uint8, np.uint16])
    chain = chain_routes(0, tokens, segments, num_layers=LAYERS, topk=TOPK)
    other = _routes(rng, [3])[0]  # a plain uint8 array beside it
    out = collate_padded_routes([chain, other], [8, 3], seq_len=8, num_layers=LAYERS, topk=TOPK)
    assert out.routes.dtype == torch.int32
    np.testing.assert_array_equal(out.routes[0, 4:].numpy(), segments[1].rows)
    np.testing.assert_array_equal(out.routes[1, :3].numpy(), other)


def test_chain_in_packed_placements_takes_the_placed_slice():
    rng = np.random.default_rng(23)
    tokens = rng.integers(0, 100, 9)
    segments = _turns(rng, tokens, [0, 4, 9], [np.uint8, np.uint8])
    chain = chain_routes(0, tokens, segments, num_layers=LAYERS, topk=TOPK)
    full = np.concatenate([s.rows for s in segments])
    # tokens [2, 7) of the trajectory at positions [1, 6) of row 0 (a placement straddling turns)
    placement = RoutePlacement(trajectory=0, row=0, start=1, length=5, source_start=2)
    out = collate_routes(
        [chain], [9], [placement], batch=1, seq_len=8, num_layers=LAYERS, topk=TOPK
    )
    np.testing.assert_array_equal(out.routes[0, 1:6].numpy(), full[2:7])
    assert out.padding_mask[0].tolist() == [True] + [False] * 5 + [True] * 2


def test_chain_refuses_token_ids_that_do_not_align():
    rng = np.random.default_rng(24)
    tokens = rng.integers(0, 100, 8)
    first, second = _turns(rng, tokens, [0, 4, 8], [np.uint8, np.uint8])
    wrong = second.token_ids.copy()
    wrong[2] += 1
    bad = RouteSegment(start=4, rows=second.rows, token_ids=wrong)
    with pytest.raises(RouteValidationError, match=r"trajectory 7 segment 1 .*position 6"):
        chain_routes(7, tokens, [first, bad], num_layers=LAYERS, topk=TOPK)
    shifted = RouteSegment(start=3, rows=second.rows, token_ids=second.token_ids)
    with pytest.raises(RouteValidationError, match=r"trajectory 7 segment 0 .*do not align"):
        chain_routes(7, tokens, [shifted], num_layers=LAYERS, topk=TOPK)


@pytest.mark.parametrize(
    ("segment", "match"),
    [
        (RouteSegment(start=6, rows=np.zeros((3, LAYERS, TOPK), np.uint8)), r"\[6, 9\) outside"),
        (RouteSegment(start=-1, rows=np.zeros((1, LAYERS, TOPK), np.uint8)), "outside"),
        (RouteSegment(start=0, rows=np.zeros((2, LAYERS, 3), np.uint8)), "shape"),
        (RouteSegment(start=0, rows=np.zeros((2, LAYERS, TOPK), np.int64)), "dtype int64"),
        (
            RouteSegment(start=0, rows=np.zeros((2, LAYERS, TOPK), np.uint8), token_ids=[1]),
            "1 token ids for 2 route rows",
        ),
    ],
)
def test_chain_refuses_bad_segments_naming_the_trajectory(segment, match):
    with pytest.raises(RouteValidationError, match=match):
        chain_routes(3, np.arange(8), [segment], num_layers=LAYERS, topk=TOPK)


def test_chain_refuses_overlapping_segments():
    a = RouteSegment(start=0, rows=np.zeros((4, LAYERS, TOPK), np.uint8))
    b = RouteSegment(start=3, rows=np.zeros((2, LAYERS, TOPK), np.uint8))
    with pytest.raises(RouteValidationError, match=r"trajectory 2: .*both cover position 3"):
        chain_routes(2, np.arange(8), [b, a], num_layers=LAYERS, topk=TOPK)


def test_chain_for_another_length_is_refused():
    chain = chain_routes(0, np.arange(5), [], num_layers=LAYERS, topk=TOPK)
    with pytest.raises(RouteValidationError, match="built for 5 tokens, the trajectory has 6"):
        collate_padded_routes([chain], [6], seq_len=6, num_layers=LAYERS, topk=TOPK)
