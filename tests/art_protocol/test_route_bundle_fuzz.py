"""Fuzz the route bundle decoder: arbitrary bytes, and byte flips, truncations and extensions
of valid bundles, either decode to something self-consistent or raise RouteBundleError; never
another exception, a hang or an allocation the buffer does not back."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from art_protocol.route_bundle import (
    BUNDLE_MAGIC,
    RouteBundleError,
    decode_route_bundle,
    encode_route_bundle,
)


def _check_decodes_consistently_or_refuses(data: bytes) -> None:
    try:
        bundle = decode_route_bundle(data)
    except RouteBundleError:
        return
    # Accepted: everything it claims is backed by the buffer and within range.
    assert bundle.flat.nbytes <= len(data)
    assert sum(r.shape[0] for r in bundle.routes) == bundle.flat.shape[0]
    assert len(bundle.routes) == len(bundle.token_counts)
    if bundle.flat.size:
        assert int(bundle.flat.min()) >= 0 and int(bundle.flat.max()) < bundle.num_experts


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_arbitrary_bytes_never_crash(data):
    _check_decodes_consistently_or_refuses(data)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=28, max_size=200))
def test_arbitrary_bytes_behind_a_valid_magic_never_crash(tail):
    _check_decodes_consistently_or_refuses(BUNDLE_MAGIC + b"\x01\x00" + tail)


@st.composite
def _valid_bundles(draw):
    num_experts = draw(st.sampled_from([2, 16, 256, 300, 70_000]))
    layers = draw(st.integers(1, 3))
    topk = draw(st.integers(1, min(3, num_experts)))
    counts = draw(st.lists(st.integers(0, 6), max_size=5))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    routes = [rng.integers(0, num_experts, size=(n, layers, topk)) for n in counts]
    return routes, num_experts, layers, topk


@settings(max_examples=300, deadline=None)
@given(_valid_bundles())
def test_valid_bundles_round_trip(case):
    routes, num_experts, layers, topk = case
    encoded = encode_route_bundle(routes, num_experts=num_experts, num_layers=layers, topk=topk)
    bundle = decode_route_bundle(bytes(encoded))
    assert len(bundle.routes) == len(routes)
    for original, decoded in zip(routes, bundle.routes, strict=True):
        np.testing.assert_array_equal(decoded, original)


@settings(max_examples=1500, deadline=None)
@given(
    _valid_bundles(),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=4),
)
def test_byte_flips_of_valid_bundles_never_crash(case, flips):
    routes, num_experts, layers, topk = case
    buffer = encode_route_bundle(routes, num_experts=num_experts, num_layers=layers, topk=topk)
    for position, xor in flips:
        buffer[position % len(buffer)] ^= xor
    _check_decodes_consistently_or_refuses(bytes(buffer))


def test_every_truncation_and_extension_of_a_valid_bundle_is_refused():
    rng = np.random.default_rng(7)
    routes = [rng.integers(0, 300, size=(n, 2, 2)) for n in (3, 0, 5)]
    buffer = bytes(encode_route_bundle(routes, num_experts=300))
    for cut in range(len(buffer)):
        try:
            decode_route_bundle(buffer[:cut])
        except RouteBundleError:
            continue
        raise AssertionError(f"truncation to {cut} of {len(buffer)} bytes was accepted")
    for extra in (1, 2, 7, 64):
        try:
            decode_route_bundle(buffer + b"\0" * extra)
        except RouteBundleError:
            continue
        raise AssertionError(f"{extra} trailing bytes were accepted")


def test_random_byte_flips_in_the_header_and_counts_are_refused_or_consistent():
    """Seeded exhaustive-ish sweep: every header/count byte, every bit."""
    rng = np.random.default_rng(8)
    routes = [rng.integers(0, 16, size=(n, 2, 2)) for n in (4, 1, 6)]
    buffer = encode_route_bundle(routes, num_experts=16)
    for position in range(48):
        for bit in range(8):
            flipped = bytearray(buffer)
            flipped[position] ^= 1 << bit
            _check_decodes_consistently_or_refuses(bytes(flipped))
