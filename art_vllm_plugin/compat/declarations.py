"""What a declaration of a vLLM seam says: the two record types, plain data.

Every vLLM method the plugin wraps or adds (`VllmPatch`) and every vLLM name it reads, calls,
imports or subclasses (`VllmName`) is declared once, in `compat/patches.py` and
`compat/names.py`, with the vLLM versions it holds for (`checked`: a specifier, read against
each of those versions' sources). The records import nothing from vLLM, so
`scripts/check_vllm_compat.py` can read them and check another vLLM (an unpacked wheel)
statically, without installing or importing it; it checks a declaration only against the
versions it claims.

Why per-version declarations: a name that moved between supported vLLMs is declared twice,
once per range, and the accessor picks the one that `compat.versions.applies`; a name that
went away (the V1 model runner in 0.34) is declared for the versions that have it, and
loading or patching it on another vLLM is refused by name (`compat.patching`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Every supported vLLM: the default (read against the sources of 0.32.0, 0.33.0 and 0.34.0).
CHECKED_032_034 = ">=0.32,<0.35"
#: vLLMs that still have the V1 model runner (0.34 has Model Runner V2 only).
V1_RUNNER = ">=0.32,<0.34"
#: Before 0.34: the reload calls 0.34 wraps in `start_reload` / `finish_reload`.
BEFORE_034 = ">=0.32,<0.34"
#: 0.34 and later.
FROM_034 = ">=0.34,<0.35"

WRAP = "wrap"  # the plugin replaces the function with a wrapper that calls the original
ADD = "add"  # the plugin adds a new name onto a vLLM class (the name must be free)


@dataclass(frozen=True)
class VllmPatch:
    """One vLLM function or method the plugin wraps, or one name it adds onto a vLLM class.

    `module` is the module the plugin imports the owner from; `qualname` is `function`,
    `Class.method` or `Class.new_name`. `by` names the plugin module that supplies the
    wrapper (two patches of one method differ by it). `per_instance`: wrapped on one object
    (an engine's scheduler), not on the class. `only_if_imported`: a module-level copy of a
    function, patched only if that module is already loaded (later imports bind the patched
    original).
    """

    module: str
    qualname: str
    by: str
    why: str
    kind: str = WRAP
    checked: str = CHECKED_032_034
    per_instance: bool = False
    only_if_imported: bool = False

    @property
    def key(self) -> str:
        """Unique per patch; the idempotency marker a wrapper carries."""
        return f"{self.module}:{self.qualname}@{self.by}"

    @property
    def owner_path(self) -> str:
        """The qualname of what is patched (a module-level function has none)."""
        return self.qualname.rpartition(".")[0]

    @property
    def attribute(self) -> str:
        return self.qualname.rpartition(".")[2]


@dataclass(frozen=True)
class VllmName:
    """One vLLM name the plugin relies on without patching it.

    `kind`: "class", "function", "method", "attribute" (set on instances, e.g. in
    `__init__`; a method or property also counts), or "constant" (a module-level value).
    """

    module: str
    qualname: str
    kind: str
    why: str
    checked: str = CHECKED_032_034

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"


def adds(
    module: str, owner: str, names: tuple[str, ...], by: str, why: str
) -> tuple[VllmPatch, ...]:
    """One `ADD` patch per name added onto `owner` (e.g. the utility methods of EngineCore)."""
    return tuple(VllmPatch(module, f"{owner}.{name}", by, why, kind=ADD) for name in names)


def collect(namespace: dict, kind: type) -> tuple:
    """Every `kind` record in a module namespace, single or in a tuple, in definition order."""
    out = []
    for value in namespace.values():
        items = value if isinstance(value, tuple) else (value,)
        out.extend(item for item in items if isinstance(item, kind))
    return tuple(out)
