"""The ctypes mirrors of the C ABI structs have the C layout (size and every field offset).

Compiles a tiny host-only C++ program against csrc/*/…h with g++ and compares `sizeof` and
`offsetof` with ctypes; a field added on one side only fails here, not as garbage on a GPU.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from hybridep import build as kb
from hybridep import build_hybridep_abi as abi

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def _structs():
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    return {
        ("grouped_gemm/grouped_gemm.h", "ArtGroupedGemmParams"): cg.GroupedGemmParams,
        ("hybridep/hybridep.h", "ArtHepLayoutParams"): abi.LayoutParams,
        ("hybridep/hybridep.h", "ArtHepPermuteParams"): abi.PermuteParams,
        ("hybridep/hybridep.h", "ArtHepIntraParams"): abi.IntraParams,
        ("hybridep/hybridep.h", "ArtHepBarrierParams"): abi.BarrierParams,
    }


def _c_layout(tmp_path, header: str, struct: str, fields: list[str]) -> list[int]:
    lines = [f'#include "{header}"', "#include <cstddef>", "#include <cstdio>", "int main() {"]
    lines.append(f'  printf("%zu\\n", sizeof({struct}));')
    lines += [f'  printf("%zu\\n", offsetof({struct}, {f}));' for f in fields]
    lines.append("}")
    src = tmp_path / f"{struct}.cpp"
    src.write_text("\n".join(lines))
    exe = tmp_path / struct
    subprocess.run(
        ["g++", "-std=c++17", f"-I{kb.CSRC_DIR}", f"-I{kb.CSRC_DIR / 'common'}", str(src),
         "-o", str(exe)],
        check=True,
    )  # fmt: skip
    return [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True,
                                           check=True).stdout.split()]  # fmt: skip


@pytest.mark.parametrize("key", list(_structs()), ids=lambda k: k[1])
def test_ctypes_mirror_matches_c_layout(tmp_path, key):
    header, name = key
    mirror = _structs()[key]
    fields = [f for f, _ in mirror._fields_]
    expected = [ctypes.sizeof(mirror)] + [getattr(mirror, f).offset for f in fields]
    assert _c_layout(tmp_path, header, name, fields) == expected
