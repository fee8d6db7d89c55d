"""Where update adapters may be read from: allowed roots and trainer-to-server path maps.

A trainer publishes adapters by path, often a path on its own machine. The server translates it
with `--art-path-map TRAINER_PREFIX=SERVER_PREFIX` (longest prefix wins), then accepts it only
if, with every symlink resolved, it lies inside one of the `--art-adapter-root DIR` roots
(repeatable). Without any root, the roots are the directories holding the slots' start
adapters. A path with a `..` component, a symlink leading out of every root, or a path outside
every root is refused (403), and the message shows the resolved path.

The same holds for every file read from the directory (`ADAPTER_FILES`), each resolved on its
own right before the read: a directory inside a root whose `adapter_model.safetensors` is a
symlink to a file outside every root is refused (403, naming the file) without opening it.
Symlinks that stay inside a root (a hub-cache layout of blobs) are followed. A full-weight
update's checkpoint directory is held to the same rule, file by file (its index, then the
shards the index names: `base_files.write_stage`). What this does not cover: a file swapped
for such a link between the check and the read, which takes write access to the root (and
with that one could write any adapter there anyway).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from art_vllm_plugin.adapters import CONFIG_FILE, WEIGHTS_FILE

#: The files read from an adapter directory (`adapters.read_adapter_files`).
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)


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
        if not self.inside(resolved):
            raise PathRefused(
                f"adapter path {raw!r} resolves to {resolved}, outside every allowed root "
                f"({', '.join(map(str, self.roots))}); pass --art-adapter-root to allow it"
            )
        self.check_files(resolved)
        return resolved

    def inside(self, resolved: Path, roots: Iterable[Path] = ()) -> bool:
        return any(resolved == r or r in resolved.parents for r in (*self.roots, *roots))

    def check_files(
        self,
        directory: str | Path,
        names: Iterable[str] = ADAPTER_FILES,
        trusted: bool = False,
        kind: str = "adapter",
    ) -> None:
        """Each file `directory/name`, every symlink resolved, must lie inside a root (a file
        that does not exist passes: reading it reports it missing). `trusted`: the directory
        itself counts as a root too (a committed version's directory, accepted when it was
        committed: a start adapter, a pushed copy). `kind` names the directory in the
        refusal ("adapter", "checkpoint")."""
        extra = (Path(os.path.realpath(directory)),) if trusted else ()
        for name in names:
            file = Path(directory) / name
            target = Path(os.path.realpath(file))
            if not self.inside(target, extra):
                where = ", ".join(map(str, (*self.roots, *extra)))
                raise PathRefused(
                    f"{kind} file {file} resolves to {target}, outside every allowed root "
                    f"({where}); a file of an {kind} directory may not lead out of the roots "
                    "(pass --art-adapter-root to allow its target)"
                )
