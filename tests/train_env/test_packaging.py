"""The installed package, not the checkout: wheel and sdist carry the CUDA sources, each
installs into a clean virtual environment with one extra, and the kernels build from there.

How the clean environments stay cheap and honest (no torch or megatron-core download, no
network): each is a fresh `python -m venv --without-pip` on the base interpreter of an
existing environment, plus a `.pth` line naming a view directory (tests/train_env/
venv_view.py) that links exactly the installed distributions the extra needs, resolved
recursively from the wheel's own metadata. pip then installs the wheel there with
`--no-index`, so it must find every requirement of the extra in that view (a test checks that
it refuses an extra the view lacks). Nothing else of the source environment is visible: no
pytest, no editable art-pipeline, no other extra. Every check runs with the working directory
outside the checkout and asserts that modules come from the venv.

The wheel's venv compiles the HybridEP kernels from its installed `hybridep/_csrc` (the plain
kernels, not CUTLASS: seconds, not minutes). The sdist's venv (wheel built from the unpacked
sdist alone) builds against the same cache: the key hashes every source byte and file name,
so a hit proves its sources are the ones that just compiled.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VIEW_TOOL = Path(__file__).resolve().parent / "venv_view.py"
SERVE_PYTHON = REPO / ".venv-serve" / "bin" / "python"
CUDA_SUFFIXES = {".cu", ".cuh", ".h", ".hpp"}
IGNORE = shutil.ignore_patterns(
    ".venv-serve", ".venv-train", ".cache", ".git", "build", "dist", "*.egg-info",
    "__pycache__", ".gpu-carry", "gpu-check-out", ".pytest_cache", ".ruff_cache", "*.so",
)  # fmt: skip
BUILD = """
import sys
from setuptools import build_meta
print(build_meta.build_sdist(sys.argv[1]) if sys.argv[2] == "sdist" else
      build_meta.build_wheel(sys.argv[1]))
"""
IMPORT_ALL = """
import importlib, json, pkgutil, sys, sysconfig
site = sysconfig.get_paths()["purelib"]
names, failed = [], {}
for top in sys.argv[1].split(","):
    package = importlib.import_module(top)
    names.append(top)
    for info in pkgutil.walk_packages(getattr(package, "__path__", []), top + "."):
        names.append(info.name)
for name in names:
    try:
        module = importlib.import_module(name)
        if not (module.__file__ or "").startswith(site):
            failed[name] = f"imported from {module.__file__}, not the venv"
    except Exception as exc:
        failed[name] = repr(exc)[:300]
print(json.dumps({"modules": names, "failed": failed,
                  "loaded": sorted(m for m in ("torch", "vllm", "megatron") if m in sys.modules)}))
"""
BUILD_KERNEL = """
import json, sys, sysconfig
from pathlib import Path
from hybridep import build as kb
from hybridep import build_hybridep_abi as abi
config = kb.BuildConfig(cache_dir=Path(sys.argv[1]), jobs=2)
before = kb.find_cached(abi.library_spec(), config)
built = kb.build(abi.library_spec(), config)
print(json.dumps({
    "csrc": str(kb.find_csrc()), "site": sysconfig.get_paths()["purelib"],
    "sources": [str(s) for s in built.spec.sources], "was_cached": before is not None,
    "exports": sorted(set(abi.SYMBOLS) & kb.exported_symbols(built.path)),
}))
"""


def _run(cmd: list[str], cwd: Path, timeout: float = 900) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("packaging")


@pytest.fixture(scope="module")
def dists(work: Path) -> dict[str, Path]:
    """sdist and wheel from a copy of the working tree, and a wheel from the sdist alone."""
    src = work / "src"
    shutil.copytree(REPO, src, ignore=IGNORE)
    out = work / "dist"
    sdist = out / _run([sys.executable, "-c", BUILD, str(out), "sdist"], src).split()[-1]
    wheel = out / _run([sys.executable, "-c", BUILD, str(out), "wheel"], src).split()[-1]
    with tarfile.open(sdist) as tar:
        tar.extractall(work / "unpacked", filter="data")
    unpacked = next((work / "unpacked").iterdir())
    out2 = work / "dist-from-sdist"
    from_sdist = (
        out2 / _run([sys.executable, "-c", BUILD, str(out2), "wheel"], unpacked).split()[-1]
    )
    return {"sdist": sdist, "wheel": wheel, "sdist-wheel": from_sdist}


def _venv(work: Path, source_python: Path, wheel: Path, extra: str, name: str) -> Path:
    """A clean venv with `wheel[extra]` installed against a view of `source_python`'s
    distributions restricted to that extra's closure; returns its python."""
    base = _run([str(source_python), "-c", "import sys; print(sys._base_executable)"], work)
    venv = work / f"venv-{name}"
    _run([base.strip(), "-m", "venv", "--without-pip", str(venv)], work)
    view = work / f"view-{name}"
    _run([str(source_python), str(VIEW_TOOL), str(wheel), extra, str(view)], work)
    python = venv / "bin" / "python"
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                work).strip()  # fmt: skip
    (Path(site) / "_art_view.pth").write_text(f"{view}\n")
    pip = [str(source_python), "-m", "pip", "--python", str(python), "install", "-q"]
    spec = f"{wheel}[{extra}]" if extra else str(wheel)  # "" is the base install
    _run([*pip, "--no-index", "--no-build-isolation", "--no-cache-dir", spec], work)
    return python


@pytest.fixture(scope="module")
def train_venvs(work, dists) -> dict[str, Path]:
    return {kind: _venv(work, Path(sys.executable), dists[kind], "megatron", f"train-{kind}")
            for kind in ("wheel", "sdist-wheel")}  # fmt: skip


def _cuda_sources() -> list[str]:
    csrc = REPO / "csrc"
    return sorted(p.relative_to(csrc).as_posix() for p in csrc.rglob("*")
                  if p.is_file() and p.suffix in CUDA_SUFFIXES)  # fmt: skip


def test_wheel_and_sdist_carry_the_cuda_sources(dists):
    sources = _cuda_sources()
    assert "hybridep/intranode.cu" in sources and "grouped_gemm/gg_fwd.cu" in sources
    for kind in ("wheel", "sdist-wheel"):
        names = set(zipfile.ZipFile(dists[kind]).namelist())
        missing = [s for s in sources if f"hybridep/_csrc/{s}" not in names]
        assert not missing, f"{kind} lacks {missing}"
    with tarfile.open(dists["sdist"]) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert not [s for s in sources if f"csrc/{s}" not in members]


@pytest.mark.parametrize("kind", ["wheel", "sdist-wheel"])
def test_training_side_imports_every_module_with_only_the_megatron_extra(train_venvs, work, kind):
    out = _run([str(train_venvs[kind]), "-c", IMPORT_ALL,
                "hybridep,art_megatron_ext,art_protocol,art_vllm_plugin.client"], work)  # fmt: skip
    result = _last_json(out)
    assert not result["failed"], result["failed"]
    assert "art_megatron_ext.ops.cutlass_grouped_gemm" in result["modules"]
    assert "art_megatron_ext.moe.grouped_mlp" in result["modules"]
    assert "vllm" not in result["loaded"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH")
def test_hybridep_kernels_build_from_the_installed_package(train_venvs, work):
    cache = work / "kernel-cache"
    results = {
        kind: _last_json(_run([str(train_venvs[kind]), "-c", BUILD_KERNEL, str(cache)], work))
        for kind in ("wheel", "sdist-wheel")
    }
    for kind, result in results.items():
        assert result["csrc"] == f"{result['site']}/hybridep/_csrc", kind
        assert all(s.startswith(result["csrc"]) for s in result["sources"]), kind
        assert "art_hybridep_dispatch" in result["exports"], kind
    assert not results["wheel"]["was_cached"]  # compiled from the wheel's installed sources
    assert results["sdist-wheel"]["was_cached"]  # same key: the sdist's sources are identical


@pytest.fixture(scope="module")
def base_venv(work, dists) -> Path:
    return _venv(work, Path(sys.executable), dists["wheel"], "", "base")


#: What the base install may load: numpy, httpx and the distributions httpx itself needs.
BASE_ALLOWED = {"numpy", "httpx", "httpcore", "h11", "anyio", "idna", "certifi", "sniffio",
                "typing_extensions", "exceptiongroup"}  # fmt: skip
THIRD_PARTY_LOADED = """
import json, sys
loaded = {m.split(".")[0] for m in sys.modules if not m.startswith("_")}
ours = {"art_protocol", "art_vllm_plugin"}
print(json.dumps(sorted(loaded - set(sys.stdlib_module_names) - ours)))
"""


def test_base_install_gives_the_shared_package_and_client_with_numpy_and_httpx_only(
    base_venv, work
):
    """`pip install art-pipeline` (no extra): every module of art_protocol and the client
    under its plugin name import, and what they load beyond the standard library is numpy,
    httpx and httpx's own dependencies; xxhash (the `client` extra) is not even installed."""
    out = _run([str(base_venv), "-c", IMPORT_ALL, "art_protocol,art_vllm_plugin.client"], work)
    result = _last_json(out)
    assert not result["failed"] and result["loaded"] == [], result
    assert "art_protocol.autotune.controller" in result["modules"]
    probe = IMPORT_ALL + THIRD_PARTY_LOADED
    loaded = set(_last_json_list(_run([str(base_venv), "-c", probe,
                                       "art_protocol,art_vllm_plugin.client"], work)))  # fmt: skip
    assert {"numpy", "httpx"} <= loaded and loaded <= BASE_ALLOWED, sorted(loaded)
    spec = "import importlib.util as u; print(u.find_spec('xxhash'), u.find_spec('torch'))"
    assert _run([str(base_venv), "-c", spec], work).split() == ["None", "None"]


def _last_json_list(text: str) -> list:
    return json.loads(text.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def client_venv(work, dists) -> Path:
    return _venv(work, Path(sys.executable), dists["wheel"], "client", "client")


def test_client_extra_alone_gives_the_trainer_client_without_vllm_or_torch(client_venv, work):
    """The `client` extra adds xxhash (computing adapter digests) and nothing heavy."""
    out = _run([str(client_venv), "-c", IMPORT_ALL, "art_protocol,art_vllm_plugin.client"], work)
    result = _last_json(out)
    assert not result["failed"] and result["loaded"] == []
    probe = (
        "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('xxhash') is not None)"
    )
    assert _run([str(client_venv), "-c", probe], work).split() == ["None", "True"]


def test_pip_refuses_an_extra_the_view_does_not_hold(client_venv, dists, work):
    """The view is what pip resolves against: megatron-core is not in the client's."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(client_venv), "install", "-q", "--no-index",
         "--no-build-isolation", "--no-cache-dir", f"{dists['wheel']}[megatron]"],
        cwd=work, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode != 0 and "megatron-core" in proc.stdout + proc.stderr


@pytest.mark.skipif(not SERVE_PYTHON.exists(), reason="needs .venv-serve (make serve-env)")
def test_serving_side_imports_every_module_with_only_the_vllm_extra(work, dists):
    python = _venv(work, SERVE_PYTHON, dists["wheel"], "vllm", "serve")
    result = _last_json(_run([str(python), "-c", IMPORT_ALL, "art_vllm_plugin"], work))
    assert not result["failed"], result["failed"]
    assert "art_vllm_plugin.api_server.routes" in result["modules"]
    assert "megatron" not in result["loaded"]
