"""The active-slot stack: which LoRA slot the forward passes on this thread use.

It is read by every LoRA site in its forward (`current_choice`) and written only by
`slots.activate_slot`; it is captured with the RNG states Megatron saves for recomputation and
restored with them (`install_recompute_capture`), so a recomputed region runs the slot of the
original forward. See `slots.py` for the rules a site applies to the choice.
"""

from __future__ import annotations

import threading

from .. import compat

#: `current_choice()` when no `activate_slot` is active.
NO_CHOICE = object()


class _ActiveSlots(threading.local):
    """Stack of active choices; thread-local because autograd may run backward elsewhere."""

    def __init__(self) -> None:
        self.stack: list[str | None] = []


_ACTIVE = _ActiveSlots()


def current_choice() -> object:
    """The innermost active choice: a slot name, None (base only) or `NO_CHOICE`."""
    return _ACTIVE.stack[-1] if _ACTIVE.stack else NO_CHOICE


def push(name: str | None) -> None:
    _ACTIVE.stack.append(name)


def pop() -> None:
    _ACTIVE.stack.pop()


def _capture() -> tuple[str | None, ...]:
    return tuple(_ACTIVE.stack)


def _restore(stack: tuple[str | None, ...]) -> None:
    _ACTIVE.stack = list(stack)


def install_recompute_capture() -> None:
    """Hook the active-slot stack into Megatron's recompute state (idempotent)."""
    compat.register_recompute_state("art_lora_active_slot", _capture, _restore)
