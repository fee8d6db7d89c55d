"""Where update adapters may be read from: allowed roots and trainer-to-server path maps.

A trainer publishes adapters by path, often a path on its own machine. The server translates it
with `--art-path-map TRAINER_PREFIX=SERVER_PREFIX` (longest prefix wins), then accepts it only
if, with every symlink resolved, it lies inside one of the `--art-adapter-root DIR` roots
(repeatable). Without any root, the roots are the directories holding the slots' start
adapters. A path with a `..` component, a symlink leading out of every root, or a path outside
every root is refused (403), and the message shows the resolved path.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


class PathRefused(ValueError):
    """The adapter path is outside every allowed root (or tries to leave one)."""


def parse_path_map(item: str) -> tuple[str, str]:
    trainer, sep, server = item.partition("=")
    if not sep or not trainer or not server:
        raise ValueError(f"--art-path-map expects TRAINER_PREFIX=SERVER_PREFIX, got {item!r}")
    return trainer, server


@dataclass(frozen=True)
class PathPolicy:
    roots: tuple[Path, ...]
    maps: tuple[tuple[str, str], ...] = ()

    @classmethod
    def create(
        cls, roots: Iterable[str], maps: Iterable[str], default_roots: Iterable[str]
    ) -> PathPolicy:
        chosen = list(roots) or list(default_roots)
        resolved = tuple(Path(os.path.realpath(r)) for r in chosen)
        parsed = tuple(sorted((parse_path_map(m) for m in maps), key=lambda m: -len(m[0])))
        return cls(roots=resolved, maps=parsed)

    def translate(self, raw: str) -> str:
        for trainer, server in self.maps:
            if raw == trainer or raw.startswith(trainer.rstrip("/") + "/"):
                return server.rstrip("/") + raw[len(trainer.rstrip("/")) :]
        return raw

    def resolve(self, raw: str) -> Path:
        mapped = self.translate(raw)
        if ".." in Path(mapped).parts:
            raise PathRefused(f"adapter path {raw!r} (server path {mapped}) contains '..'; refused")
        resolved = Path(os.path.realpath(mapped))
        for root in self.roots:
            if resolved == root or root in resolved.parents:
                return resolved
        raise PathRefused(
            f"adapter path {raw!r} resolves to {resolved}, outside every allowed root "
            f"({', '.join(map(str, self.roots))}); pass --art-adapter-root to allow it"
        )
