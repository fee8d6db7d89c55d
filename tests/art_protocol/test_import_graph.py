"""The house's import rules, read from the source (AST), imports inside functions included.

- `art_vllm_plugin` (vLLM) and `art_megatron_ext` (Megatron) never import each other; both may
  import `art_protocol`, the light package they share.
- `art_protocol` imports neither side, nor torch, vLLM, Megatron or anything heavy, anywhere
  (not even lazily inside a function): a trainer installs it without extras.
- No import cycle anywhere in the packages, lazy imports included: a cycle hidden behind a
  function-level import is still two modules that cannot be understood apart.

An edge goes from a module to the deepest module an import names (`from a.b import c` is an
edge to `a.b.c` when that is a module, else to `a.b`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("art_protocol", "art_vllm_plugin", "art_megatron_ext", "hybridep")
#: Each package's forbidden imports (top-level names).
FORBIDDEN = {
    "art_vllm_plugin": {"art_megatron_ext", "hybridep", "megatron"},
    "art_megatron_ext": {"art_vllm_plugin", "vllm"},
    "hybridep": {"art_vllm_plugin", "vllm"},
    "art_protocol": {
        "art_vllm_plugin",
        "art_megatron_ext",
        "hybridep",
        "torch",
        "vllm",
        "megatron",
        "transformers",
        "safetensors",
        "peft",
    },
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
    }


MODULES = _modules()


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _imports(module: str, path: Path) -> set[str]:
    """Every module `module` imports, anywhere in its body (absolute dotted names)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in MODULES else target)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _top(name: str) -> str:
    return name.split(".")[0]


def test_the_walk_sees_every_package_and_function_level_imports():
    """The graph is not vacuous: every package has modules, and a known lazy import inside a
    function (the plugin's entry point loads its loader on call) is an edge."""
    for package in PACKAGES:
        assert any(_top(m) == package for m in MODULES), package
    assert "art_vllm_plugin.plugin_loader" in GRAPH["art_vllm_plugin"]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_import(package):
    bad = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if _top(module) == package
        for target in targets
        if _top(target) in FORBIDDEN[package]
    )
    assert not bad, "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), or a self-loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_anywhere():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_lazy_cycle():
    """Negative control: two modules that import each other, one only inside a function."""
    graph = {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.a"}}
    assert _cycles(graph) == [["p.a", "p.b"]]
