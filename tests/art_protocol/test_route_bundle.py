"""The route bundle round-trips, uses the narrowest dtype, does not copy on decode, and rejects
every malformed header or body with RouteBundleError naming the problem."""

import struct

import numpy as np
import pytest

from art_protocol.route_bundle import (
    BUNDLE_MAGIC,
    HEADER_SIZE,
    RouteBundleError,
    decode_route_bundle,
    encode_route_bundle,
    route_dtype_for,
)


def _routes(rng, counts, layers=3, topk=2, num_experts=16, dtype=np.int32):
    return [rng.integers(0, num_experts, size=(n, layers, topk)).astype(dtype) for n in counts]


def _header_fields(buffer):
    return list(struct.unpack_from("<4sHBBIIHHIQ", buffer, 0))


def _with_header(buffer, **changes):
    names = [
        "magic",
        "version",
        "code",
        "flags",
        "count",
        "experts",
        "layers",
        "topk",
        "res",
        "total",
    ]
    fields = dict(zip(names, _header_fields(buffer), strict=True))
    fields.update(changes)
    out = bytearray(buffer)
    struct.pack_into("<4sHBBIIHHIQ", out, 0, *fields.values())
    return out


@pytest.mark.parametrize(
    ("num_experts", "dtype"),
    [
        (1, np.uint8),
        (128, np.uint8),
        (256, np.uint8),
        (257, np.uint16),
        (65536, np.uint16),
        (65537, np.int32),
    ],
)
def test_dtype_is_narrowest_that_holds_num_experts(num_experts, dtype):
    assert route_dtype_for(num_experts) == np.dtype(dtype)


def test_round_trip_keeps_values_counts_and_order():
    rng = np.random.default_rng(0)
    routes = _routes(rng, [5, 0, 17, 1])
    bundle = decode_route_bundle(bytes(encode_route_bundle(routes, num_experts=16)))
    assert bundle.dtype == np.uint8
    assert (bundle.num_experts, bundle.num_layers, bundle.topk) == (16, 3, 2)
    assert bundle.token_counts.tolist() == [5, 0, 17, 1]
    for original, decoded in zip(routes, bundle.routes, strict=True):
        np.testing.assert_array_equal(decoded, original)


def test_wide_expert_ids_round_trip_in_int32():
    rng = np.random.default_rng(1)
    routes = _routes(rng, [4, 9], num_experts=100_000, dtype=np.int64)
    bundle = decode_route_bundle(encode_route_bundle(routes, num_experts=100_000))
    assert bundle.dtype == np.int32
    np.testing.assert_array_equal(bundle.routes[1], routes[1])


def test_decode_returns_views_of_the_buffer_not_copies():
    routes = _routes(np.random.default_rng(2), [6, 3])
    buffer = encode_route_bundle(routes, num_experts=16)
    bundle = decode_route_bundle(buffer)
    assert np.shares_memory(bundle.routes[1], np.frombuffer(buffer, dtype=np.uint8))
    assert bundle.routes[1].base is not None


def test_size_is_header_counts_and_narrow_payload():
    routes = _routes(np.random.default_rng(3), [10, 20, 30], layers=4, topk=8, num_experts=128)
    buffer = encode_route_bundle(routes, num_experts=128)
    assert len(buffer) == HEADER_SIZE + 16 + 60 * 4 * 8  # 3 counts padded to 16 bytes


def test_empty_bundle_needs_shape_and_round_trips():
    with pytest.raises(RouteBundleError, match="num_layers and topk are required"):
        encode_route_bundle([], num_experts=8)
    bundle = decode_route_bundle(encode_route_bundle([], num_experts=8, num_layers=2, topk=2))
    assert bundle.routes == [] and bundle.flat.shape == (0, 2, 2)


@pytest.mark.parametrize(
    ("routes", "match"),
    [
        (
            [np.zeros((3, 3, 2), np.int32), np.full((2, 3, 2), 16, np.int32)],
            "trajectory 1: expert id 16",
        ),
        ([np.full((2, 3, 2), -1, np.int32)], "trajectory 0: negative expert id"),
        (
            [np.zeros((2, 3, 2), np.int32), np.zeros((2, 3, 3), np.int32)],
            "trajectory 1: routes shape",
        ),
        (
            [np.zeros((2, 3, 2), np.int32), np.zeros((2, 3, 2), np.float32)],
            "trajectory 1: routes must be",
        ),
        ([np.zeros((2, 3, 2), np.int32), [[[0, 1]]]], "trajectory 1: routes must be"),
    ],
)
def test_encode_rejects_bad_input_naming_the_trajectory(routes, match):
    with pytest.raises(RouteBundleError, match=match):
        encode_route_bundle(routes, num_experts=16)


def _valid():
    return encode_route_bundle(_routes(np.random.default_rng(4), [3, 5, 2]), num_experts=16)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda b: b"XXXX" + bytes(b[4:]), "not a route bundle: magic"),
        (lambda b: _with_header(b, version=2), "unsupported route bundle version 2"),
        (lambda b: _with_header(b, code=9), "unknown dtype code 9"),
        (lambda b: _with_header(b, code=2), "not the narrowest dtype"),
        (lambda b: _with_header(b, flags=1), "reserved header fields"),
        (lambda b: _with_header(b, experts=0), "num_experts 0"),
        (lambda b: _with_header(b, topk=0), "bad shape fields"),
        (lambda b: bytes(b[:-1]), "does not match its header"),
        (lambda b: bytes(b) + b"\0", "does not match its header"),
        (lambda b: bytes(b[:10]), "truncated bundle"),
        (lambda b: _with_header(b, total=2**63), "does not match its header"),
        (lambda b: _with_header(b, count=2**32 - 1), "does not match its header"),
        (lambda b: _with_header(b, layers=65535), "does not match its header"),
    ],
)
def test_decode_rejects_bad_header(mutate, match):
    with pytest.raises(RouteBundleError, match=match):
        decode_route_bundle(mutate(_valid()))


def test_decode_rejects_counts_that_do_not_add_up():
    buffer = _valid()
    struct.pack_into("<I", buffer, HEADER_SIZE + 4, 6)  # 3 + 6 + 2 != 10
    with pytest.raises(RouteBundleError, match="token counts add up to 11, header says 10"):
        decode_route_bundle(buffer)


def test_decode_rejects_a_negative_count():
    buffer = _valid()
    struct.pack_into("<i", buffer, HEADER_SIZE, -1)  # stored as 2**32 - 1
    with pytest.raises(RouteBundleError, match="token counts add up to"):
        decode_route_bundle(buffer)


def test_decode_rejects_expert_id_out_of_range():
    buffer = _valid()
    buffer[-1] = 16
    with pytest.raises(RouteBundleError, match="expert id 16 >= num_experts 16"):
        decode_route_bundle(buffer)


def test_decode_rejects_negative_ids_in_int32_bundles():
    buffer = encode_route_bundle([np.zeros((2, 1, 1), np.int32)], num_experts=100_000)
    buffer[-4:] = struct.pack("<i", -3)
    with pytest.raises(RouteBundleError, match="negative expert id -3"):
        decode_route_bundle(buffer)


def test_decode_rejects_non_zero_alignment_padding():
    buffer = _valid()  # 3 counts end at byte 44; data starts at 48
    buffer[HEADER_SIZE + 12] = 1
    with pytest.raises(RouteBundleError, match="alignment padding"):
        decode_route_bundle(buffer)


def test_magic_is_the_documented_one():
    assert _valid()[:4] == BUNDLE_MAGIC == b"ARTR"


def test_decode_rejects_something_that_is_not_bytes():
    with pytest.raises(RouteBundleError, match="bytes-like object, got str"):
        decode_route_bundle("ARTR")
