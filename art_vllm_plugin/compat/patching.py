"""Applying declared patches, and attaching the plugin's state to vLLM objects.

One mechanism for every patch: a wrapper carries the patch's key (`MARK`), so applying a
patch twice changes nothing, and several patches of one method (each its own key) stack in
the order they are applied. A patch that is not declared in `compat.patches` is refused, so
the declarations stay the complete list that `scripts/check_vllm_compat.py` checks.

The plugin's per-role state hangs on the vLLM object it belongs to (an EngineCore, a model
runner, the API server's `OpenAIServingModels`) under one attribute, `STATE_ATTR`.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Iterable
from typing import Any

from art_vllm_plugin.compat import patches
from art_vllm_plugin.compat.declarations import ADD, WRAP, VllmName, VllmPatch

#: The attribute a wrapper carries: the key of the patch that made it.
MARK = "__art_patch__"
#: The attribute a name added onto a vLLM class carries (one function may be added to two).
ADDED = "__art_added__"
#: The one attribute under which a vLLM object holds the plugin's state.
STATE_ATTR = "_art_state"
_DECLARED = frozenset(p.key for p in patches.ALL)
_MAX_CHAIN = 64


class UndeclaredPatch(RuntimeError):
    """A patch that is not listed in `compat.patches` (declare it there first)."""


class VllmNameTaken(RuntimeError):
    """vLLM now defines a name the plugin would add: adding it would shadow vLLM's."""


class NotInThisVllm(RuntimeError):
    """A declaration used on a vLLM outside the versions it holds for (`checked`): e.g. a V1
    model runner name on 0.34. The caller must have gated the path by version first."""


def _require_version(declared: VllmName | VllmPatch) -> None:
    """Refuse a declaration that does not hold for the installed, supported vLLM. A vLLM
    outside the supported range is the version gate's to refuse (`plugin_loader.activate`),
    and only where the plugin is selected: `--plugin` itself is added in every process."""
    from art_vllm_plugin.compat.versions import applies, is_supported, vllm_version

    if is_supported() and not applies(declared.checked):
        raise NotInThisVllm(
            f"{declared.key} holds for vLLM {declared.checked}, not the installed "
            f"{vllm_version()}: the art plugin path that needs it is not available on this vLLM"
        )


def load(name: VllmName) -> Any:
    """The class, function or constant a declaration names (imports its module); refused on a
    vLLM the declaration does not hold for."""
    _require_version(name)
    obj: Any = importlib.import_module(name.module)
    for part in name.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _require(patch: VllmPatch, kind: str) -> None:
    if patch.key not in _DECLARED:
        raise UndeclaredPatch(f"{patch.key} is not declared in art_vllm_plugin.compat.patches")
    if patch.kind != kind:
        raise UndeclaredPatch(f"{patch.key} is declared as {patch.kind!r}, applied as {kind!r}")
    _require_version(patch)


def _owner(patch: VllmPatch) -> Any | None:
    if patch.only_if_imported:
        module = sys.modules.get(patch.module)
        if module is None:
            return None
    else:
        module = importlib.import_module(patch.module)
    owner: Any = module
    for part in filter(None, patch.owner_path.split(".")):
        owner = getattr(owner, part)
    return owner


def _carries(fn: Any, key: str) -> bool:
    """Whether `fn`, or a function it wraps (`__wrapped__` chain), is the wrapper of `key`."""
    for _ in range(_MAX_CHAIN):
        if fn is None:
            return False
        if getattr(fn, MARK, None) == key:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _mark(wrapper: Callable, patch: VllmPatch, original: Callable) -> Callable:
    # Set after `functools.wraps`, which copies the inner wrapper's marker along.
    wrapper.__dict__[MARK] = patch.key
    if "__wrapped__" not in wrapper.__dict__:
        wrapper.__wrapped__ = original
    return wrapper


def wrap(patch: VllmPatch, make_wrapper: Callable[[Callable], Callable]) -> bool:
    """Replace the declared function or method by `make_wrapper(original)` (once).

    Static and class methods stay what they are. Returns whether anything changed (False
    when already applied, or for an `only_if_imported` patch whose module is not loaded)."""
    _require(patch, WRAP)
    if patch.per_instance:
        raise UndeclaredPatch(f"{patch.key} is per instance: use compat.wrap_instance")
    owner = _owner(patch)
    if owner is None:
        return False
    attr = patch.attribute
    if _carries(getattr(owner, attr), patch.key):
        return False
    raw = inspect.getattr_static(owner, attr)
    if isinstance(raw, staticmethod | classmethod):
        original = raw.__func__
        replacement = type(raw)(_mark(make_wrapper(original), patch, original))
    else:
        original = raw
        replacement = _mark(make_wrapper(original), patch, original)
    setattr(owner, attr, replacement)
    return True


def wrap_instance(patch: VllmPatch, obj: Any, make_wrapper: Callable[[Callable], Callable]) -> bool:
    """Replace a bound method of one object by `make_wrapper(bound original)` (once)."""
    _require(patch, WRAP)
    if not patch.per_instance:
        raise UndeclaredPatch(f"{patch.key} is declared for the class: use compat.wrap")
    attr = patch.attribute
    original = getattr(obj, attr)
    if _carries(original, patch.key):
        return False
    setattr(obj, attr, _mark(make_wrapper(original), patch, original))
    return True


def add(patch: VllmPatch, value: Any) -> bool:
    """Add a new name onto a vLLM class (once); refused if vLLM defines that name itself."""
    _require(patch, ADD)
    owner = _owner(patch)
    attr = patch.attribute
    if owner.__dict__.get(attr) is value:
        return False
    existing = getattr(owner, attr, None)
    if existing is not None and not getattr(existing, ADDED, False):
        raise VllmNameTaken(
            f"vLLM's {patch.owner_path} now has {attr!r}; the art plugin would shadow it "
            f"({patch.key}): check this vLLM with scripts/check_vllm_compat.py"
        )
    setattr(value, ADDED, True)
    setattr(owner, attr, value)
    return True


def add_all(declared: Iterable[VllmPatch], source: Any) -> None:
    """`add` each declared name with the attribute of the same name of `source` (a module)."""
    for patch in declared:
        add(patch, getattr(source, patch.attribute))


def is_applied(patch: VllmPatch) -> bool:
    """Whether the patch is in place (never imports its module)."""
    module = sys.modules.get(patch.module)
    if module is None:
        return False
    owner: Any = module
    for part in filter(None, patch.owner_path.split(".")):
        owner = getattr(owner, part, None)
    current = getattr(owner, patch.attribute, None)
    if patch.kind == ADD:
        return current is not None and getattr(current, ADDED, False)
    return _carries(current, patch.key)


def original_of(patch: VllmPatch, current: Callable) -> Callable:
    """What the wrapper of `patch` wraps, found from `current` (the attribute as it is now),
    e.g. to call vLLM's own loader past the plugin's wrapper."""
    fn = current
    for _ in range(_MAX_CHAIN):
        if fn is None:
            break
        if getattr(fn, MARK, None) == patch.key:
            return fn.__wrapped__
        fn = getattr(fn, "__wrapped__", None)
    raise UndeclaredPatch(f"{patch.key} is not applied to {current!r}")


def attached_state(obj: Any) -> Any | None:
    """The plugin state `obj` holds, or None."""
    return getattr(obj, "__dict__", {}).get(STATE_ATTR)


def attach_state(obj: Any, state: Any) -> Any:
    """Make `obj` hold `state` (the one attribute the plugin sets on a vLLM object)."""
    obj.__dict__[STATE_ATTR] = state
    return state
