"""Prefix-cache salting by policy version, decided in EngineCore.

vLLM hashes a request's prompt blocks (with its LoRA name/path and `cache_salt`) when the
request is built, and reuses any cached block with the same hash. After an in-place update the
slot's name and often its path are unchanged, so without a salt a new request would reuse KV
computed by the old policy. Here every request on a slot gets the salt

    art1:<slot>:<version>[:<user cache_salt>]

so KV computed under an older version is never reused by a newer one, and users who set their
own `cache_salt` stay separated. Base-model requests are untouched (stock behaviour).

When the salt is fixed: the slot's version is read in the engine loop, the same thread that
commits updates, when the request is added to the scheduler (`add_request`), and again for
every request still *waiting* (not yet scheduled, nothing computed) when an update of its slot
commits: those are re-salted and re-hashed. So a request admitted in the same step as an update,
whichever came first, has its prefill, the first moment it can look up cached blocks, salted
with the version its tokens are computed by. Running requests keep their KV.

The user's own salt is kept on the request (`USER_SALT_ATTR`): it is that request's data, and
it must survive re-salting.
"""

from __future__ import annotations

from art_vllm_plugin import compat
from art_vllm_plugin.engine_core.state import engine_state

USER_SALT_ATTR = "_art_user_salt"


def derive_salt(slot: str, version: int, user_salt: str | None) -> str:
    salt = f"art1:{slot}:{version}"
    return f"{salt}:{user_salt}" if user_salt else salt


def salt_request(request, versions: dict[int, int]) -> bool:
    """Set the request's salt for its slot's current version; True if it changed."""
    lora = request.lora_request
    if lora is None:
        return False
    if not hasattr(request, USER_SALT_ATTR):
        setattr(request, USER_SALT_ATTR, request.cache_salt)
    salt = derive_salt(
        lora.lora_name, versions.get(lora.lora_int_id, 0), getattr(request, USER_SALT_ATTR)
    )
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


def salt_new_requests(add_request):
    """Wrapper for `EngineCore.add_request`: salt by the slot's version in this engine."""

    def add_request_salted(self, request, request_wave: int = 0):
        salt_request(request, engine_state(self).updates.versions)
        return add_request(self, request, request_wave)

    return add_request_salted
