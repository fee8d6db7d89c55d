"""The serving side's route pieces without a server: per-slot store, route_spans rule, body."""

from __future__ import annotations

import json

import numpy as np
import pytest

from art_protocol.client import decode_routed_completion
from art_protocol.route_bundle import encode_route_bundle
from art_protocol.routed_completion import RoutedBodyError, encode_body, split_body
from art_vllm_plugin.routes.spans import expected_rows, route_spans
from art_vllm_plugin.routes.store import RouteSlotStore, RouteStoreError


def test_store_rows_follow_kv_blocks_so_a_second_request_on_the_same_blocks_reads_them():
    store = RouteSlotStore(num_blocks=6, block_size=4, num_layers=2, topk=2, dtype=np.uint8)
    first = np.arange(10 * 4, dtype=np.uint8).reshape(10, 2, 2)
    store.write([5, 2, 3], 0, first[:7])  # prefill of 7 tokens in blocks 5, 2
    store.write([5, 2, 3], 7, first[7:10])  # later forward: tokens 7..9
    # another request sharing the two cached blocks and owning block 0
    np.testing.assert_array_equal(store.read([5, 2, 0], 0, 8), first[:8])
    np.testing.assert_array_equal(store.read([5, 2, 3], 3, 10), first[3:10])
    with pytest.raises(RouteStoreError, match=r"positions \[0, 13\)"):
        store.read([5, 2, 3], 0, 13)


def test_route_spans_end_where_the_base_version_changes_and_keep_it():
    # same slot version throughout; the base weights changed after completion token 1
    policy = [
        {"start": 0, "end": 2, "slot": "s", "version": 3},
        {"start": 2, "end": 5, "slot": "s", "version": 3, "base_version": 1},
    ]
    spans = route_spans(policy, prompt_len=4, prompt_start=0, num_rows=expected_rows(4, 5, 0))
    assert spans == [
        {"start": 0, "end": 5, "slot": "s", "version": 3},
        {"start": 5, "end": 8, "slot": "s", "version": 3, "base_version": 1},
    ]


def test_route_spans_take_the_sampling_version_of_the_next_token():
    # prompt of 4 tokens, 5 completion tokens; tokens 0-1 sampled at v1, 2-4 at v2
    policy = [
        {"start": 0, "end": 2, "slot": "s", "version": 1},
        {"start": 2, "end": 5, "slot": "s", "version": 2},
    ]
    rows = expected_rows(4, 5, 0)
    assert rows == 8
    # row t (t >= 3) is the forward that sampled completion token t - 3
    spans = route_spans(policy, prompt_len=4, prompt_start=0, num_rows=rows)
    assert spans == [
        {"start": 0, "end": 5, "slot": "s", "version": 1},  # prompt rows 0-3, rows of tokens 4
        {"start": 5, "end": 8, "slot": "s", "version": 2},
    ]
    # skipping the first 3 prompt rows shifts rows, not versions
    spans = route_spans(policy, prompt_len=4, prompt_start=3, num_rows=expected_rows(4, 5, 3))
    assert spans == [
        {"start": 0, "end": 2, "slot": "s", "version": 1},
        {"start": 2, "end": 5, "slot": "s", "version": 2},
    ]


def test_route_spans_refuse_policy_spans_that_do_not_cover_the_rows():
    with pytest.raises(ValueError, match="do not cover 8 route rows"):
        route_spans([{"start": 0, "end": 3, "slot": None, "version": 0}], 4, 0, 8)


def _body(routes, completion=None):
    completion = completion or {
        "choices": [{"index": i, "routes": {"rows": len(r)}} for i, r in enumerate(routes)]
    }
    return encode_body(completion, encode_route_bundle(routes, num_experts=8))


def test_body_decodes_to_views_of_the_received_buffer():
    routes = [np.random.default_rng(0).integers(0, 8, (n, 2, 2), dtype=np.uint8) for n in (5, 0, 9)]
    body = bytes(_body(routes))
    decoded = decode_routed_completion(body)
    for got, want in zip(decoded.routes, routes, strict=True):
        np.testing.assert_array_equal(got, want)
        assert not got.flags.writeable  # a view of the immutable bytes, not a copy
    assert np.shares_memory(decoded.routes[2], np.frombuffer(body, dtype=np.uint8))
    assert (
        decoded.completion["art_routes"]["length"]
        == len(body) - decoded.completion["art_routes"]["offset"]
    )
    assert decoded.completion["art_routes"]["offset"] % 8 == 0


def test_body_with_disagreeing_json_or_header_is_refused_with_the_reason():
    routes = [np.zeros((3, 2, 2), dtype=np.uint8)]
    body = _body(routes)
    with pytest.raises(RoutedBodyError, match="magic"):
        split_body(b"XXXX" + bytes(body[4:]))
    with pytest.raises(RoutedBodyError, match="disagrees with the body"):
        split_body(bytes(body) + b"\0" * 8)
    wrong_rows = _body(routes, {"choices": [{"index": 0, "routes": {"rows": 4}}]})
    with pytest.raises(RoutedBodyError, match="JSON says 4 route rows, bundle holds 3"):
        decode_routed_completion(wrong_rows)
    # the JSON never holds route arrays: only counts and spans
    text = json.dumps(split_body(body).completion)
    assert "routed_experts" not in text


def test_art_routes_flag_turns_on_native_capture_and_tells_the_workers(monkeypatch):
    import argparse

    from art_vllm_plugin.cli import add_art_options
    from art_vllm_plugin.routes import config

    monkeypatch.setenv(config.ENV_VAR, "0")  # restored after the test (the flag sets it)
    parser = argparse.ArgumentParser(prog="vllm serve")
    add_art_options(parser)
    assert parser.parse_args([]).art_routes is False
    assert not config.selected()
    args = parser.parse_args(["--art-routes"])
    assert args.art_routes is True and args.enable_return_routed_experts is True
    assert config.selected()  # exported for the EngineCore and worker processes


def test_routes_size_limit_comes_from_the_environment(monkeypatch):
    from art_vllm_plugin.routes import config

    monkeypatch.setenv(config.MAX_BYTES_ENV, "4096")
    assert config.max_body_bytes() == 4096
    monkeypatch.setenv(config.MAX_BYTES_ENV, "lots")
    with pytest.raises(ValueError, match="ART_VLLM_ROUTES_MAX_BYTES must be a positive integer"):
        config.max_body_bytes()
