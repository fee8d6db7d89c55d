#!/usr/bin/env python3
"""Check the plugin's declared vLLM seams against a vLLM source tree, without importing it.

    python scripts/check_vllm_compat.py WHEEL_OR_SITE_PACKAGES [--baseline OTHER] [--markdown]

For every patch in `art_vllm_plugin.compat.patches` and every name in
`art_vllm_plugin.compat.names`, it reads vLLM's source with `ast` (a `.whl` is read in place;
a directory may be site-packages or the `vllm` package itself) and reports whether the name
exists, following re-exports (`from .x import Y`) and base classes. A wrapped function's
signature is shown; a name the plugin adds onto a class must still be free. A declaration is
checked only against the vLLM versions it claims (`checked`, e.g. the V1 runner's names up to
0.33); a vLLM past the supported range is checked against the declarations of the newest
supported one (what would have to hold for it). With
`--baseline`, signatures that differ from the baseline tree are flagged (e.g. the installed
vLLM against a newer wheel). Exit status 1 when anything is missing, taken or changed.

Why static: checking a new vLLM must not need installing it (a CUDA build on a CPU host, or
a different torch); this tells what would break before anyone tries.
"""

from __future__ import annotations

import argparse
import ast
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from art_vllm_plugin.compat import names, patches, versions  # noqa: E402 (no vLLM import)
from art_vllm_plugin.compat.declarations import ADD, VllmName, VllmPatch  # noqa: E402

_MAX_HOPS = 12


class Source:
    """The `vllm` package's Python files, from a wheel or a directory."""

    def __init__(self, location: str | Path) -> None:
        path = Path(location)
        self._zip: zipfile.ZipFile | None = None
        self._root: Path | None = None
        if path.is_file() and path.suffix == ".whl":
            self._zip = zipfile.ZipFile(path)
            self._members = set(self._zip.namelist())
        elif (path / "vllm" / "__init__.py").is_file():
            self._root = path
        elif path.name == "vllm" and (path / "__init__.py").is_file():
            self._root = path.parent
        else:
            raise SystemExit(f"{location}: neither a vLLM wheel nor a directory holding vllm/")
        self._trees: dict[str, ast.Module | None] = {}

    def version(self) -> str:
        tree = self.module("vllm._version") or self.module("vllm.version")
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if (
                        isinstance(target, ast.Name)
                        and target.id in ("__version__", "version")
                        and isinstance(node.value, ast.Constant)
                    ):
                        return str(node.value.value)
        return "unknown"

    def _read(self, relative: str) -> str | None:
        if self._zip is not None:
            return self._zip.read(relative).decode() if relative in self._members else None
        file = self._root / relative
        return file.read_text() if file.is_file() else None

    def is_package(self, module: str) -> bool:
        base = module.replace(".", "/")
        return self._read(f"{base}/__init__.py") is not None

    def module(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            base = module.replace(".", "/")
            text = self._read(f"{base}.py") or self._read(f"{base}/__init__.py")
            self._trees[module] = ast.parse(text) if text is not None else None
        return self._trees[module]


@dataclass
class Found:
    """What a dotted name resolved to."""

    kind: str  # class, function, method, attribute, constant
    module: str
    node: ast.AST | None = None
    note: str = ""


def _module_statements(body: list[ast.stmt]):
    """Top-level statements, looking into `if`/`try` blocks (TYPE_CHECKING, fallbacks)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _module_statements(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _module_statements(
                node.body
                + node.orelse
                + node.finalbody
                + [s for h in node.handlers for s in h.body]
            )


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


class Resolver:
    def __init__(self, source: Source) -> None:
        self.source = source

    def top(self, module: str, name: str, hops: int = 0) -> Found | None:
        """A module-level name: defined there, re-exported from elsewhere, or a submodule."""
        tree = self.source.module(module)
        if tree is None or hops > _MAX_HOPS:
            return None
        for node in _module_statements(tree.body):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return Found("class", module, node)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return Found("function", module, node)
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                return Found("constant", module, node)
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == name
            ):
                return Found("constant", module, node)
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        origin = _absolute(
                            module, self.source.is_package(module), node.level, node.module
                        )
                        if self.source.module(f"{origin}.{alias.name}") is not None:
                            return Found("module", f"{origin}.{alias.name}")
                        return self.top(origin, alias.name, hops + 1)
        for node in _module_statements(tree.body):  # `def __getattr__` serving the name lazily
            if (
                isinstance(node, ast.FunctionDef)
                and node.name == "__getattr__"
                and any(isinstance(c, ast.Constant) and c.value == name for c in ast.walk(node))
            ):
                return Found("constant", module, node, "module __getattr__")
        if self.source.module(f"{module}.{name}") is not None:
            return Found("module", f"{module}.{name}")
        return None

    def _base_classes(self, found: Found, hops: int) -> list[Found]:
        out = []
        for base in found.node.bases:
            if isinstance(base, ast.Subscript):
                base = base.value
            if isinstance(base, ast.Name):
                resolved = self.top(found.module, base.id, hops + 1)
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                holder = self.top(found.module, base.value.id, hops + 1)
                resolved = (
                    self.top(holder.module, base.attr, hops + 1)
                    if holder is not None and holder.kind == "module"
                    else None
                )
            else:
                resolved = None
            if resolved is not None and resolved.kind == "class":
                out.append(resolved)
        return out

    def member(self, cls: Found, name: str, hops: int = 0) -> Found | None:
        """A class member: defined in the body, set as `self.name` in a method, or inherited."""
        if hops > _MAX_HOPS:
            return None
        where = f"{cls.module}.{cls.node.name}"
        for node in cls.node.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return Found("method", cls.module, node, f"defined in {where}")
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return Found("attribute", cls.module, node, f"class field of {where}")
        for node in cls.node.body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for sub in ast.walk(node):
                targets = (
                    sub.targets
                    if isinstance(sub, ast.Assign)
                    else [sub.target]
                    if isinstance(sub, ast.AnnAssign)
                    else []
                )
                for t in targets:
                    if (
                        isinstance(t, ast.Attribute)
                        and t.attr == name
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "self"
                    ):
                        return Found("attribute", cls.module, sub, f"set in {where}.{node.name}")
        for base in self._base_classes(cls, hops):
            found = self.member(base, name, hops + 1)
            if found is not None:
                return found
        return None

    def resolve(self, module: str, qualname: str) -> tuple[Found | None, str]:
        """(what `module.qualname` is, or None with the reason)."""
        first, *rest = qualname.split(".")
        found = self.top(module, first)
        if found is None:
            return None, f"{module} has no {first}"
        for part in rest:
            if found.kind != "class":
                return None, f"{found.module}: {first} is a {found.kind}, not a class"
            member = self.member(found, part)
            if member is None:
                return None, f"{found.module}.{found.node.name} has no {part}"
            found = member
        return found, ""


def _signature(found: Found | None) -> str:
    if found is None or not isinstance(found.node, ast.FunctionDef | ast.AsyncFunctionDef):
        return ""
    decorators = [ast.unparse(d) for d in found.node.decorator_list]
    prefix = "".join(f"@{d} " for d in decorators if d in ("staticmethod", "classmethod"))
    return f"{prefix}({ast.unparse(found.node.args)})"


@dataclass
class Row:
    what: str  # "wrap", "add", or the name's kind
    name: str
    status: str  # ok, MISSING, TAKEN, CHANGED
    detail: str


def check_patch(resolver: Resolver, patch: VllmPatch) -> Row:
    name = f"{patch.module}:{patch.qualname}"
    if patch.kind == ADD:
        owner, why = resolver.resolve(patch.module, patch.owner_path)
        if owner is None or owner.kind != "class":
            return Row("add", name, "MISSING", why or f"{patch.owner_path} is not a class")
        taken = resolver.member(owner, patch.attribute)
        if taken is not None:
            return Row("add", name, "TAKEN", f"vLLM now has it ({taken.note})")
        return Row("add", name, "ok", "the name is free")
    found, why = resolver.resolve(patch.module, patch.qualname)
    if found is None:
        return Row("wrap", name, "MISSING", why)
    if found.kind not in ("method", "function"):
        return Row("wrap", name, "MISSING", f"is a {found.kind}, not a function ({found.note})")
    return Row("wrap", name, "ok", _signature(found))


def check_name(resolver: Resolver, declared: VllmName) -> Row:
    name = f"{declared.module}:{declared.qualname}"
    found, why = resolver.resolve(declared.module, declared.qualname)
    if found is None:
        return Row(declared.kind, name, "MISSING", why)
    detail = _signature(found) if found.kind in ("method", "function") else found.note
    return Row(declared.kind, name, "ok", detail or found.kind)


def declarations_for(version: str) -> tuple[tuple[VllmPatch, ...], tuple[VllmName, ...], str]:
    """The patches and names that must hold for `version`, and the version they were picked
    for: `version` itself inside the supported range, else the newest supported one."""
    try:
        versions.check_vllm_version(version)
        target = version
    except versions.UnsupportedVllmVersion:
        target = versions.NEWEST_SUPPORTED
    return (
        tuple(p for p in patches.ALL if versions.in_range(p.checked, target)),
        tuple(n for n in names.ALL if versions.in_range(n.checked, target)),
        target,
    )


def check(location: str | Path, baseline: str | Path | None = None) -> tuple[str, list[Row]]:
    """(vLLM version of `location`, one row per declaration that holds for it, patches first)."""
    source = Source(location)
    resolver = Resolver(source)
    held_patches, held_names, _ = declarations_for(source.version())
    rows = [check_patch(resolver, p) for p in held_patches]
    rows += [check_name(resolver, n) for n in held_names]
    if baseline is not None:
        _, before = check(baseline)
        by_name = {(r.what, r.name): r for r in before}
        for row in rows:
            old = by_name.get((row.what, row.name))
            if (
                row.status == "ok"
                and old is not None
                and old.status == "ok"
                and row.detail.startswith(("(", "@"))
                and old.detail != row.detail
            ):
                row.status = "CHANGED"
                row.detail = f"{old.detail} -> {row.detail}"
    return source.version(), rows


def _render(version: str, rows: list[Row], markdown: bool) -> str:
    bad = [r for r in rows if r.status != "ok"]
    held_patches, held_names, target = declarations_for(version)
    other = len(patches.ALL) + len(names.ALL) - len(held_patches) - len(held_names)
    as_of = "" if target == version else f" (as {target}, the newest supported)"
    header = (
        f"vLLM {version}{as_of}: {len(rows)} declarations, {len(bad)} not ok "
        f"({other} declared for other vLLM versions, not checked)"
    )
    if markdown:
        lines = [header, "", "| what | name | status | detail |", "| --- | --- | --- | --- |"]
        lines += [
            f"| {r.what} | `{r.name}` | {r.status} | {r.detail.replace('|', '/')} |" for r in rows
        ]
        return "\n".join(lines)
    width = max(len(r.name) for r in rows)
    lines = [header]
    lines += [f"{r.status:8} {r.what:9} {r.name:{width}}  {r.detail}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("location", help="a vLLM .whl, site-packages, or the vllm package dir")
    parser.add_argument("--baseline", help="another vLLM tree: flag signatures that changed")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--only-problems", action="store_true", help="print rows not ok only")
    args = parser.parse_args(argv)
    version, rows = check(args.location, args.baseline)
    shown = [r for r in rows if r.status != "ok"] if args.only_problems else rows
    print(_render(version, shown, args.markdown) if shown else f"vLLM {version}: ok")
    return 1 if any(r.status != "ok" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
