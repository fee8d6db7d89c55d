"""The cache salt is set once per request, where vLLM builds it, and the step loop hashes nothing.

vLLM's own `EngineCore.preprocess_add_request` and `Request` run here on a stand-in engine
(the three attributes preprocessing reads), with vLLM's real prompt block hasher wrapped to
count each time a request's prompt is hashed. Before, the salt was set in `add_request`, on
the step loop, and the prompt hashed a second time there. The salts and hashes must equal
what that rule gave. The serving behaviour (hits within a version, none across, waiting
requests re-salted) is `tests/art_vllm_plugin/test_prefix_salting.py`, on a real server.
"""

from __future__ import annotations

import inspect
import time
from types import SimpleNamespace

import pytest
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import Request

from art_vllm_plugin import compat
from art_vllm_plugin.engine_core import cache_salting
from art_vllm_plugin.engine_core.state import engine_state

BLOCK = 4
PROMPT = list(range(100, 118))  # four full blocks
SLOT, LORA_ID = "policy", 7

#: vLLM's own preprocessing, without the plugin's wrapper if this process installed it.
PREPROCESS = inspect.unwrap(EngineCore.preprocess_add_request)


class CountingHasher:
    """vLLM's prompt block hasher; `calls` holds the salt of each request it hashed."""

    def __init__(self):
        init_none_hash(sha256)
        self.inner = get_request_block_hasher(BLOCK, sha256)
        self.calls: list[tuple[str, str | None]] = []

    def __call__(self, request):
        hashes = self.inner(request)
        if hashes:
            self.calls.append((request.request_id, request.cache_salt))
        return hashes


def engine(hasher) -> SimpleNamespace:
    """A stand-in EngineCore: what `preprocess_add_request` reads, and the plugin's state."""
    return SimpleNamespace(
        mm_receiver_cache=None, request_block_hasher=hasher, structured_output_manager=None
    )


def incoming(request_id: str, user_salt: str | None = None, lora=True) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(PROMPT),
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=2),
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=LoRARequest(SLOT, LORA_ID, "/adapters/policy") if lora else None,
        cache_salt=user_salt,
        data_parallel_rank=None,
    )


@pytest.fixture
def counted(monkeypatch):
    """(hasher, engine at slot version 3, derive_salt call count)."""
    hasher = CountingHasher()
    core = engine(hasher)
    engine_state(core).updates.versions[LORA_ID] = 3
    derived = []
    original = cache_salting.derive_salt
    monkeypatch.setattr(
        cache_salting,
        "derive_salt",
        lambda *a: derived.append(a) or original(*a),
    )
    return hasher, core, derived


def admit(core, request: EngineCoreRequest) -> Request:
    """What EngineCore does with an incoming request: preprocess (input thread), then
    `add_request` (step loop), both through the plugin's wrappers."""
    added = []
    req, wave = cache_salting.salt_on_preprocess(PREPROCESS)(core, request)
    cache_salting.salt_new_requests(lambda self, r, w: added.append(r))(core, req, wave)
    assert added == [req]
    return req


def previous_rule(hasher, core, request: EngineCoreRequest) -> Request:
    """The rule before: build the Request unsalted, salt and re-hash it in `add_request`."""
    req = Request.from_engine_core_request(request, hasher)
    cache_salting.salt_request(req, engine_state(core).updates.versions)
    return req


@pytest.mark.parametrize("user_salt", [None, "user-1"])
def test_salt_is_derived_and_the_prompt_hashed_once_per_request(counted, user_salt):
    hasher, core, derived = counted
    req = admit(core, incoming("r1", user_salt))
    assert len(derived) == 1, "the salt is derived once per request"
    assert hasher.calls == [("r1", req.cache_salt)], "one hashing, already salted"
    assert req.cache_salt == cache_salting.derive_salt(SLOT, 3, user_salt)

    before = previous_rule(hasher, core, incoming("r0", user_salt))
    assert req.cache_salt == before.cache_salt
    assert req.block_hashes == before.block_hashes and len(req.block_hashes) == 4
    # the previous rule hashed twice: unsalted when built, salted again on the step loop
    assert [salt for rid, salt in hasher.calls if rid == "r0"] == [user_salt, req.cache_salt]


def test_many_requests_one_hashing_each(counted):
    hasher, core, derived = counted
    for i in range(5):
        admit(core, incoming(f"r{i}", "u" if i % 2 else None))
    assert len(derived) == 5
    assert [rid for rid, _ in hasher.calls] == [f"r{i}" for i in range(5)]


def test_an_update_between_preprocessing_and_the_step_loop_resalts_there(counted):
    hasher, core, _ = counted
    req, wave = cache_salting.salt_on_preprocess(PREPROCESS)(core, incoming("r1", "u"))
    engine_state(core).updates.versions[LORA_ID] = 4  # committed on the step loop meanwhile
    cache_salting.salt_new_requests(lambda self, r, w: None)(core, req, wave)
    assert req.cache_salt == cache_salting.derive_salt(SLOT, 4, "u")
    assert [salt for _, salt in hasher.calls] == [
        cache_salting.derive_salt(SLOT, 3, "u"),
        cache_salting.derive_salt(SLOT, 4, "u"),
    ]
    assert req.block_hashes == previous_rule(hasher, core, incoming("r0", "u")).block_hashes


def test_a_request_preprocessed_before_the_engine_state_exists_is_at_version_0():
    hasher = CountingHasher()
    core = engine(hasher)  # no plugin state yet: the input thread must not create it
    req, _ = cache_salting.salt_on_preprocess(PREPROCESS)(core, incoming("r1"))
    assert compat.attached_state(core) is None
    assert req.cache_salt == cache_salting.derive_salt(SLOT, 0, None)


def test_base_model_requests_keep_the_users_salt(counted):
    hasher, core, derived = counted
    req = admit(core, incoming("r1", "user-1", lora=False))
    assert req.cache_salt == "user-1" and not derived
    assert hasher.calls == [("r1", "user-1")]


def test_the_base_version_enters_every_salt_once_the_base_weights_changed(counted):
    """After a full-weight update (base version > 0) a slot request's salt carries it, and a
    base-model request is salted too (re-hashed); before it both are as they always were."""
    hasher, core, _ = counted
    assert cache_salting.derive_salt(SLOT, 3, "u") == f"art1:{SLOT}:3:u"
    assert admit(core, incoming("r0", "mine", lora=False)).cache_salt == "mine"  # stock
    engine_state(core).updates.base_version = 1
    req = admit(core, incoming("r1"))
    assert req.cache_salt == f"art1:{SLOT}:3:b1"
    base_model = admit(core, incoming("r2", "mine", lora=False))
    assert base_model.cache_salt == "art1::0:b1:mine"
    assert hasher.calls[-1] == ("r2", "art1::0:b1:mine")  # hashed once, with the salt
    # a request built before the base changed is re-salted on the step loop
    engine_state(core).updates.base_version = 2
    waiting = Request.from_engine_core_request(incoming("r3", lora=False), hasher)
    assert cache_salting.salt_request(waiting, {}, 2) and waiting.cache_salt == "art1::0:b2"
