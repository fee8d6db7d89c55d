"""Ships the CUDA sources (`csrc/`) inside the wheel as `hybridep/_csrc` (package data).

Why a build_py step and not `package-data`: the sources live at the repository root, shared
by both libraries, outside every package; setuptools' package data can only name files inside
a package. Everything else about the project is declared in pyproject.toml. The sdist carries
`csrc/` through MANIFEST.in, so a wheel built from the sdist gets the same copy.
`hybridep.build.find_csrc()` looks in the installed package first, then in the checkout
(editable installs and source trees use `csrc/` where it is).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CSRC = Path(__file__).resolve().parent / "csrc"
SUFFIXES = {".cu", ".cuh", ".h", ".hpp"}


class BuildPyWithCsrc(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads csrc/ in the checkout
        if not CSRC.is_dir():
            raise SystemExit(f"csrc/ not found next to setup.py ({CSRC}); the sdist is incomplete")
        target = Path(self.build_lib) / "hybridep" / "_csrc"
        shutil.rmtree(target, ignore_errors=True)
        for src in sorted(CSRC.rglob("*")):
            if src.is_file() and src.suffix in SUFFIXES:
                dest = target / src.relative_to(CSRC)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest)


setup(cmdclass={"build_py": BuildPyWithCsrc})
