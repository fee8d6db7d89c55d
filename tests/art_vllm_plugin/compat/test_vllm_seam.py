"""The one vLLM seam, read from the source (AST): only `compat/` touches vLLM, only
`install.py` applies patches, every patch is declared and applied, nothing else patches.

Why: a vLLM bump must be one package to audit (`compat/`) and one script to run
(`scripts/check_vllm_compat.py`). A patch applied anywhere else, or a private name used
without a declaration, would be invisible to both.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.specifiers import SpecifierSet

from art_vllm_plugin import compat
from art_vllm_plugin.compat import names, patches
from art_vllm_plugin.compat.declarations import ADD, WRAP, VllmPatch

PLUGIN = Path(compat.__file__).resolve().parents[1]
COMPAT = PLUGIN / "compat"
INSTALL = PLUGIN / "install.py"
APPLY = {"wrap", "wrap_instance", "add", "add_all"}
#: Attribute names the plugin patches on vLLM classes (wrapped or added).
PATCHED_ATTRIBUTES = {p.attribute for p in patches.ALL}


def _plugin_modules(exclude_compat: bool = True) -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PLUGIN.rglob("*.py")):
        if exclude_compat and COMPAT in path.parents:
            continue
        out[str(path.relative_to(PLUGIN))] = ast.parse(path.read_text(), str(path))
    return out


def _compat_call(node: ast.AST) -> str | None:
    """`compat.NAME(...)` -> NAME."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "compat"
    ):
        return node.func.attr
    return None


def patch_sites(tree: ast.Module) -> list[str]:
    """Places that patch a vLLM class outside compat: an assignment or `setattr` of a name
    the plugin patches, or onto anything obtained from `compat.*(...)`."""
    from_compat: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _compat_call(node.value):
            from_compat.update(t.id for t in node.targets if isinstance(t, ast.Name))
    found = []
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign | ast.AugAssign)
            else []
        )
        for target in targets:
            if not isinstance(target, ast.Attribute):
                continue
            owner = target.value
            if (
                target.attr in PATCHED_ATTRIBUTES
                or _compat_call(owner)
                or (isinstance(owner, ast.Name) and owner.id in from_compat)
            ):
                found.append(f"line {node.lineno}: {ast.unparse(target)} = ...")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id != "setattr" or len(node.args) < 2:
                continue
            owner, name = node.args[0], node.args[1]
            if (
                (isinstance(name, ast.Constant) and name.value in PATCHED_ATTRIBUTES)
                or _compat_call(owner)
                or (isinstance(owner, ast.Name) and owner.id in from_compat)
            ):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_only_compat_imports_vllm():
    bad = [
        f"{name}: {ast.unparse(node)}"
        for name, tree in _plugin_modules().items()
        for node in ast.walk(tree)
        if (
            isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in node.names)
        )
        or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm")
    ]
    assert not bad, "\n".join(bad)


def test_only_install_applies_patches():
    bad = [
        f"{name} line {node.lineno}: compat.{_compat_call(node)}"
        for name, tree in _plugin_modules().items()
        if name != "install.py"
        for node in ast.walk(tree)
        if _compat_call(node) in APPLY
    ]
    assert not bad, "\n".join(bad)


def test_no_module_outside_compat_patches_a_vllm_class():
    bad = {name: sites for name, tree in _plugin_modules().items() if (sites := patch_sites(tree))}
    assert not bad, bad


@pytest.mark.parametrize(
    "source",
    [
        "cls = compat.engine_core_class()\ncls.art_slot_state = f\n",
        "compat.engine_core_class().anything = f\n",
        "setattr(compat.engine_core_class(), name, f)\n",
        "setattr(Anything, 'add_request', f)\n",
        "SomeClass.create_completion = wrapper\n",
    ],
)
def test_the_scan_finds_a_patch_outside_compat(source):
    """Negative control for the scan above."""
    assert patch_sites(ast.parse(source))


def test_install_applies_every_declared_patch():
    tree = ast.parse(INSTALL.read_text())
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        if node.value.id == "P"
    }
    declared = {
        name
        for name, value in vars(patches).items()
        if name != "ALL"
        if isinstance(value, VllmPatch)
        or (isinstance(value, tuple) and value and isinstance(value[0], VllmPatch))
    }
    assert declared - used == set(), "declared but never applied"
    assert used - declared == set(), "applied but not declared"


@pytest.mark.parametrize("patch", patches.ALL, ids=lambda p: p.key)
def test_each_patch_names_the_plugin_code_it_applies(patch):
    """`by` is `module.wrapper` for a wrap, the module holding the added function for an add."""
    module_name, _, attr = patch.by.rpartition(".")
    if patch.kind == ADD:
        module = importlib.import_module(f"art_vllm_plugin.{patch.by}")
        assert callable(getattr(module, patch.attribute))
    else:
        module = importlib.import_module(f"art_vllm_plugin.{module_name}")
        assert callable(getattr(module, attr))


def test_patch_keys_are_unique():
    keys = [p.key for p in patches.ALL]
    assert len(keys) == len(set(keys))


def test_every_private_vllm_name_compat_touches_is_declared():
    """`obj._name` in an accessor (not `self._x`) must be declared, so the checker sees it."""
    declared = {d.qualname.rsplit(".", 1)[-1] for d in (*names.ALL, *patches.ALL)}
    used = {}
    for path in sorted(COMPAT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                used.setdefault(node.attr, f"{path.name}:{node.lineno}")
    plugin_own = {"_DECLARED", "_MAX_CHAIN"}  # the compat package's own names
    # torch.nn.Module's own storage (shard_forms copies a layer without vLLM's help): torch's
    # names, not vLLM's, so the vLLM checker has nothing to check them against
    torch_module = {"_parameters", "_buffers", "_non_persistent_buffers_set"}
    missing = {
        n: where for n, where in used.items() if n not in declared | plugin_own | torch_module
    }
    assert not missing, missing


def test_every_declaration_holds_inside_the_supported_range_only():
    """Each declaration names the supported vLLMs it holds for (all of them, or the versions
    with the V1 runner, or 0.34 on), and at least one; none reaches past the range."""
    lo, hi = compat.SUPPORTED_VLLM
    minors = ("0.32.0", "0.33.0", "0.34.0")
    for declared in (*patches.ALL, *names.ALL):
        spec = SpecifierSet(declared.checked)
        assert hi not in spec and f"{hi}.0" not in spec and "0.31.9" not in spec, declared
        assert any(v in spec for v in minors), declared
    assert lo in SpecifierSet(compat.CHECKED_032_034)


def test_an_undeclared_patch_is_refused_before_vllm_is_touched():
    stray = VllmPatch("vllm.nowhere", "Thing.method", by="tests", why="not declared")
    with pytest.raises(compat.UndeclaredPatch, match="not declared"):
        compat.wrap(stray, lambda original: original)
    with pytest.raises(compat.UndeclaredPatch, match="declared as 'wrap'"):
        compat.add(patches.SPANS_SO_FAR, lambda self: None)
    assert patches.SPANS_SO_FAR.kind == WRAP


def test_a_patch_applies_once_and_its_original_stays_reachable():
    """One marker mechanism: a second application changes nothing."""
    calls = []
    scheduler = SimpleNamespace(schedule=lambda: "batch")

    def make(original):
        def schedule():
            calls.append("stamped")
            return original()

        return schedule

    assert compat.wrap_instance(patches.SCHEDULER_SCHEDULE, scheduler, make) is True
    assert compat.wrap_instance(patches.SCHEDULER_SCHEDULE, scheduler, make) is False
    assert scheduler.schedule() == "batch" and calls == ["stamped"]
    original = compat.original_of(patches.SCHEDULER_SCHEDULE, scheduler.schedule)
    assert original() == "batch" and calls == ["stamped"]
