"""Prefix-cache salting by policy version, decided in EngineCore.

vLLM hashes a request's prompt blocks (with its LoRA name/path and `cache_salt`) when the
request is built, and reuses any cached block with the same hash. After an in-place update the
slot's name and often its path are unchanged, so without a salt a new request would reuse KV
computed by the old policy. Here every request on a slot gets the salt

    art1:<slot>:<version>[:<user cache_salt>]

so KV computed under an older version is never reused by a newer one, and users who set their
own `cache_salt` stay separated. Base-model requests are untouched (stock behaviour).

When the salt is fixed: once, where vLLM builds the `Request` from the client's
`EngineCoreRequest` (`EngineCore.preprocess_add_request`, on EngineCore's input thread, beside
the step loop): the salt is set on the incoming request before the `Request` hashes its prompt
blocks, so the prompt is hashed once, with the salt, off the step loop. The version it used is
kept on the request (`SALTED_VERSION_ATTR`). On the step loop, the thread that commits updates,
`add_request` only compares that version with the slot's current one (no hashing): an update
that committed in between re-salts and re-hashes that request there. Then, for every request
still *waiting* (not yet scheduled, nothing computed) when an update of its slot commits: those
are re-salted and re-hashed. So a request admitted in the same step as an update, whichever came
first, has its prefill, the first moment it can look up cached blocks, salted with the version
its tokens are computed by. Running requests keep their KV.

The user's own salt is kept on the request (`USER_SALT_ATTR`): it is that request's data, and
it must survive re-salting.
"""

from __future__ import annotations

from art_vllm_plugin import compat
from art_vllm_plugin.engine_core.state import engine_state

USER_SALT_ATTR = "_art_user_salt"
#: The slot version a request's salt was derived from.
SALTED_VERSION_ATTR = "_art_salted_version"


def derive_salt(slot: str, version: int, user_salt: str | None) -> str:
    salt = f"art1:{slot}:{version}"
    return f"{salt}:{user_salt}" if user_salt else salt


def salt_request(request, versions: dict[int, int]) -> bool:
    """Set a queued `Request`'s salt for its slot's current version and re-hash its prompt
    blocks; True if the salt changed."""
    lora = request.lora_request
    if lora is None:
        return False
    if not hasattr(request, USER_SALT_ATTR):
        setattr(request, USER_SALT_ATTR, request.cache_salt)
    version = versions.get(lora.lora_int_id, 0)
    setattr(request, SALTED_VERSION_ATTR, version)
    salt = derive_salt(lora.lora_name, version, getattr(request, USER_SALT_ATTR))
    if salt == request.cache_salt:
        return False
    request.cache_salt = salt
    compat.rehash_request_blocks(request)
    return True


def resalt_waiting(core, lora_int_id: int, versions: dict[int, int]) -> int:
    """Re-salt requests of this slot that wait with nothing computed; returns how many."""
    count = 0
    for request in compat.waiting_requests(compat.engine_scheduler(core)):
        lora = request.lora_request
        if (
            lora is not None
            and lora.lora_int_id == lora_int_id
            and request.num_computed_tokens == 0
            and salt_request(request, versions)
        ):
            count += 1
    return count


def _versions_seen_from_input_thread(core) -> dict[int, int]:
    """The engine's slot versions, read from the input thread: the state is never created
    there (the step loop may be creating it); none yet means no update committed."""
    state = compat.attached_state(core)
    return state.updates.versions if state is not None else {}


def salt_on_preprocess(preprocess_add_request):
    """Wrapper for `EngineCore.preprocess_add_request` (input thread): salt the incoming
    `EngineCoreRequest` before vLLM builds the `Request`, which hashes the prompt with it."""

    def preprocess_add_request_salted(self, request):
        lora = request.lora_request
        if lora is None:
            return preprocess_add_request(self, request)
        user_salt = request.cache_salt
        version = _versions_seen_from_input_thread(self).get(lora.lora_int_id, 0)
        request.cache_salt = derive_salt(lora.lora_name, version, user_salt)
        req, wave = preprocess_add_request(self, request)
        setattr(req, USER_SALT_ATTR, user_salt)
        setattr(req, SALTED_VERSION_ATTR, version)
        return req, wave

    return preprocess_add_request_salted


def salt_new_requests(add_request):
    """Wrapper for `EngineCore.add_request` (step loop): a request salted at preprocessing
    keeps its salt unless its slot's version changed since (no hashing); one that was not
    (built elsewhere) is salted here."""

    def add_request_salted(self, request, request_wave: int = 0):
        lora = request.lora_request
        if lora is not None:
            versions = engine_state(self).updates.versions
            if getattr(request, SALTED_VERSION_ATTR, None) != versions.get(lora.lora_int_id, 0):
                salt_request(request, versions)
        return add_request(self, request, request_wave)

    return add_request_salted
