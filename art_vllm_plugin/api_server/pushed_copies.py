"""The files of each slot's current pushed version, kept where later readers find them.

Why: a path update commits the trainer's path, and whatever reads a committed version later
reads that path (an exact lease copies version N's files from it, checked against the digest,
`api_server/leases.py`). A push has no such path: its staging directory is removed when the
update ends. So the API server writes the validated bytes of a push once more, to
`<temp dir>/art-pushed-<owner>/<slot>-v<version>-<random>/` (disk, not the staging budget),
and that directory is the path the engines commit. It is kept while the version is the slot's
current one: the slot's next update that commits removes it (a lease already taken holds its
own copy). A version replaced since then is "no longer available" to a new lease, as a path
update's deleted directory is. The directory goes when the server exits, and a server that
starts removes those of servers that are gone (`staging.sweep`, same owner rule as stages).
Cost: one disk write of the adapter per push, before the commit, outside the engine's step.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import uuid
from pathlib import Path

from art_vllm_plugin import staging
from art_vllm_plugin.adapters import AdapterFiles

#: Name prefix of a server's directory of kept copies (in the temp directory).
PREFIX = "art-pushed-"


def default_root() -> Path:
    return Path(tempfile.gettempdir())


class PushedCopies:
    """One API server's kept copies: at most one per slot once an update ends."""

    def __init__(self, root: Path | None = None):
        self.root = root or default_root()
        self.dir = self.root / f"{PREFIX}{staging.owner_tag()}"
        self._current: dict[str, Path] = {}
        self._registered = False

    def sweep(self) -> list[Path]:
        """Remove the directories of servers that are gone (at start)."""
        return staging.sweep(self.root, PREFIX)

    def keep(self, slot: str, version: int, files: AdapterFiles) -> Path:
        """Write `files` to a fresh directory; its path is what the engines commit."""
        if not self._registered:
            self.dir.mkdir(mode=0o700, exist_ok=True)
            atexit.register(shutil.rmtree, self.dir, True)
            self._registered = True
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in slot)
        path = self.dir / f"{safe}-v{version}-{uuid.uuid4().hex[:8]}"
        try:
            path.mkdir(mode=0o700)
            for name, data in files.as_files().items():
                (path / name).write_bytes(data)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return path

    def committed(self, slot: str, path: str | Path | None) -> None:
        """Slot `slot` now serves `path`: the previous kept copy of the slot goes."""
        previous = self._current.pop(slot, None)
        if path is not None and Path(path).parent == self.dir:
            self._current[slot] = Path(path)
        if previous is not None and previous != path:
            shutil.rmtree(previous, ignore_errors=True)

    @staticmethod
    def discard(path: str | Path) -> None:
        shutil.rmtree(path, ignore_errors=True)
