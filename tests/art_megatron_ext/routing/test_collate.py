"""Route collation: recorded routes land where the layout says, everything else holds the
distinct dummy route 0..topk-1 with padding_mask True, dtypes promote without a scan, and bad
input is refused naming the trajectory."""

import numpy as np
import pytest
import torch

from art_megatron_ext.routing.collate import (
    RoutePlacement,
    RouteValidationError,
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
