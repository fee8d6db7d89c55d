"""The compressed GPU carry (scripts/gpu_carry.sh) unpacks into importable trees on CPU.

On the device `bench/gpu_check_unpack.py` must turn the carried archives into a megatron-core
that a Python without megatron imports, and a CUTLASS tree `find_cutlass` accepts, in
seconds; a mistake there costs device time and shows up only as skipped Megatron twins. Here:
the unpacker on small archives (exports, a missing part, nothing usable), and gpu_carry.sh
end to end (no kernel pre-build, gzip -1 to stay fast) with the carried megatron imported by
a Python that sees no other megatron.
"""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNPACK = REPO / "bench" / "gpu_check_unpack.py"
IMPORT_FILE = "import megatron.core as m; print(m.__file__)"


def _tar_xz(path: Path, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:xz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _unpack(carry: Path, dest: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(UNPACK), str(carry), str(dest)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _exports(stdout: str) -> dict[str, str]:
    """{name: value} as bash sees them after `eval` (with PYTHONPATH unset before)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    show = 'echo "PYTHONPATH=${PYTHONPATH:-}"; echo "ART_CUTLASS_DIR=${ART_CUTLASS_DIR:-}"'
    script = f"{stdout}\n{show}"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


def _fake_carry(carry: Path, megatron=True, cutlass=True) -> None:
    carry.mkdir()
    if megatron:
        _tar_xz(carry / "megatron-core.tar.xz", {
            "megatron/core/__init__.py": "__version__ = '9.9.9'\n",
            "megatron_core-9.9.9.dist-info/METADATA": "Name: megatron-core\nVersion: 9.9.9\n",
        })  # fmt: skip
    if cutlass:
        _tar_xz(carry / "cutlass.tar.xz", {
            "cutlass/include/cutlass/version.h": "#define CUTLASS_MAJOR 9\n",
            "cutlass/tools/util/include/cutlass/util/packed_stride.hpp": "#pragma once\n",
        })  # fmt: skip


def _import_megatron_isolated(pythonpath: str) -> str:
    """megatron.core.__file__ from a Python that sees only `pythonpath` (no site-packages)."""
    out = subprocess.run(
        [sys.executable, "-S", "-W", "ignore", "-c", IMPORT_FILE],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": pythonpath},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_unpack_exports_both_parts_and_megatron_imports_from_there(tmp_path):
    _fake_carry(tmp_path / "carry")
    dest = tmp_path / "dest"
    res = _unpack(tmp_path / "carry", dest)
    assert res.returncode == 0, res.stderr
    env = _exports(res.stdout)
    assert env["PYTHONPATH"] == str(dest / "site")
    assert env["ART_CUTLASS_DIR"] == str(dest / "cutlass")
    assert (dest / "cutlass" / "tools/util/include/cutlass/util/packed_stride.hpp").is_file()
    assert (dest / "env.sh").read_text().strip() == res.stdout.strip()
    assert _import_megatron_isolated(env["PYTHONPATH"]) == str(
        dest / "site" / "megatron" / "core" / "__init__.py"
    )


def test_a_missing_part_is_reported_and_the_other_still_exported(tmp_path):
    _fake_carry(tmp_path / "carry", megatron=False)
    res = _unpack(tmp_path / "carry", tmp_path / "dest")
    assert res.returncode == 0, res.stderr
    assert "megatron-core.tar.xz: not in" in res.stderr
    assert "PYTHONPATH" not in res.stdout and "ART_CUTLASS_DIR=" in res.stdout


def test_nothing_usable_exits_nonzero_with_the_reason(tmp_path):
    carry = tmp_path / "carry"
    carry.mkdir()
    (carry / "cutlass.tar.xz").write_bytes(b"not an archive")
    res = _unpack(carry, tmp_path / "dest")
    assert res.returncode == 1
    assert res.stdout.strip() == ""
    assert "cutlass.tar.xz: unreadable" in res.stderr and "nothing usable" in res.stderr
    assert _unpack(tmp_path / "absent", tmp_path / "dest2").returncode == 1


@pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("cutlass_library") is None,
    reason="needs the training env (megatron-core and nvidia-cutlass installed)",
)
def test_gpu_carry_script_packs_a_megatron_that_a_bare_python_imports(tmp_path):
    carry = tmp_path / "carry"
    res = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_carry.sh"), str(carry)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHON": sys.executable, "GPU_CARRY_PREBUILD": "0",
             "GPU_CARRY_XZ": "gzip -1"},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(p.name for p in carry.iterdir()) == [
        "MANIFEST.txt", "cutlass.tar.xz", "megatron-core.tar.xz",
    ]  # fmt: skip
    assert "limit 64 MiB" in res.stdout
    manifest = (carry / "MANIFEST.txt").read_text()
    assert "torch>=" in manifest and "packaging" in manifest
    with tarfile.open(carry / "megatron-core.tar.xz") as tar:
        names = tar.getnames()
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert any(n.startswith("megatron_core-") and n.endswith(".dist-info") for n in names)

    dest = tmp_path / "dest"
    unpacked = _unpack(carry, dest)
    assert unpacked.returncode == 0, unpacked.stderr
    # a Python without megatron: -S drops site-packages; an "image" of every other package
    image = _site_without_megatron(tmp_path / "image")
    origin = _import_megatron_isolated(f"{dest / 'site'}:{image}")
    assert origin == str(dest / "site" / "megatron" / "core" / "__init__.py")


def _site_without_megatron(image: Path) -> Path:
    """Links to every entry of the site-packages holding torch, except megatron's."""
    site = Path(importlib.util.find_spec("torch").origin).parents[1]
    image.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith("megatron"):
            (image / entry.name).symlink_to(entry)
    return image
