"""Prefix-cache salting by policy version, decided in EngineCore.

vLLM hashes a request's prompt blocks (with its LoRA name/path and `cache_salt`) when the
request is built, and reuses any cached block with the same hash. After an in-place update the
slot's name and often its path are unchanged, so without a salt a new request would reuse KV
computed by the old policy. Here every request on a slot gets the salt

    art1:<slot>:<version>[:<user cache_salt>]

so KV computed under an older version is never reused by a newer one, and users who set their
own `cache_salt` stay separated. Once the base weights have changed (a full-weight update:
base version > 0) every salt also carries `:b<base version>`, and base-model requests are
salted too (`art1::0:b<base>`), so no request reuses KV computed by older base weights. Until
then base-model requests are untouched (stock behaviour).

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
#: The (slot version, base version) a request's salt was derived from.
SALTED_VERSION_ATTR = "_art_salted_version"


def derive_salt(slot: str, version: int, user_salt: str | None, base_version: int = 0) -> str:
    """`art1:<slot>:<version>[:b<base>][:<user salt>]`; a base-model request's slot is "".
    The base part appears once the base weights changed, so LoRA-only salts stay as they
    always were (and a cache warmed before the plugin's first full-weight update stays
    usable)."""
    salt = f"art1:{slot}:{version}"
    if base_version:
        salt = f"{salt}:b{base_version}"
    return f"{salt}:{user_salt}" if user_salt else salt


def _salt_for(lora, user_salt: str | None, versions: dict[int, int], base: int):
    """(salt, the versions it encodes) for a request on `lora` (None: the base model); the
    salt is None for a base-model request while the base weights are the loaded ones (stock
    behaviour: the user's own salt, if any, stands)."""
    if lora is None:
        if not base:
            return None, (0, 0)
        return derive_salt("", 0, user_salt, base), (0, base)
    version = versions.get(lora.lora_int_id, 0)
    return derive_salt(lora.lora_name, version, user_salt, base), (version, base)


def salt_request(request, versions: dict[int, int], base_version: int = 0) -> bool:
    """Set a queued `Request`'s salt for its slot's current version and the current base
    version, and re-hash its prompt blocks; True if the salt changed."""
    if not hasattr(request, USER_SALT_ATTR):
        setattr(request, USER_SALT_ATTR, request.cache_salt)
    user_salt = getattr(request, USER_SALT_ATTR)
    salt, salted = _salt_for(request.lora_request, user_salt, versions, base_version)
    setattr(request, SALTED_VERSION_ATTR, salted)
    salt = user_salt if salt is None else salt
    if salt == request.cache_salt:
        return False
    request.cache_salt = salt
    compat.rehash_request_blocks(request)
    return True


def resalt_waiting(
    core, lora_int_id: int | None, versions: dict[int, int], base_version: int = 0
) -> int:
    """Re-salt requests that wait with nothing computed, of this slot (`lora_int_id`) or of
    every slot and the base model (None: the base weights changed); returns how many."""
    count = 0
    for request in compat.waiting_requests(compat.engine_scheduler(core)):
        lora = request.lora_request
        mine = lora_int_id is None or (lora is not None and lora.lora_int_id == lora_int_id)
        if (
            mine
            and request.num_computed_tokens == 0
            and salt_request(request, versions, base_version)
        ):
            count += 1
    return count


def _versions_seen_from_input_thread(core) -> tuple[dict[int, int], int]:
    """The engine's slot and base versions, read from the input thread: the state is never
    created there (the step loop may be creating it); none yet means no update committed."""
    state = compat.attached_state(core)
    if state is None:
        return {}, 0
    return state.updates.versions, state.updates.base_version


def salt_on_preprocess(preprocess_add_request):
    """Wrapper for `EngineCore.preprocess_add_request` (input thread): salt the incoming
    `EngineCoreRequest` before vLLM builds the `Request`, which hashes the prompt with it."""

    def preprocess_add_request_salted(self, request):
        versions, base = _versions_seen_from_input_thread(self)
        user_salt = request.cache_salt
        salt, salted = _salt_for(request.lora_request, user_salt, versions, base)
        if salt is None:  # a base-model request on the loaded weights: stock
            return preprocess_add_request(self, request)
        request.cache_salt = salt
        req, wave = preprocess_add_request(self, request)
        setattr(req, USER_SALT_ATTR, user_salt)
        setattr(req, SALTED_VERSION_ATTR, salted)
        return req, wave

    return preprocess_add_request_salted


def salt_new_requests(add_request):
    """Wrapper for `EngineCore.add_request` (step loop): a request salted at preprocessing
    keeps its salt unless its slot's or the base's version changed since (no hashing); one
    that was not (built elsewhere) is salted here."""

    def add_request_salted(self, request, request_wave: int = 0):
        updates = engine_state(self).updates
        versions, base = updates.versions, updates.base_version
        lora = request.lora_request
        if lora is not None or base:
            now = (versions.get(lora.lora_int_id, 0) if lora is not None else 0, base)
            if getattr(request, SALTED_VERSION_ATTR, None) != now:
                salt_request(request, versions, base)
        return add_request(self, request, request_wave)

    return add_request_salted
