"""`scripts/check_vllm_compat.py` against the installed vLLM and against edited copies of it.

The checker reads vLLM's source statically. Against the installed tree (the range the plugin
supports) every declared patch and name must resolve; against a copy of that tree with one
declared method removed, one name the plugin adds now defined by vLLM, or one wrapped
signature changed, exactly those rows must be reported.
"""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest

from art_vllm_plugin.compat import names, patches

REPO = Path(__file__).resolve().parents[3]


def _load_checker():
    spec = importlib.util.spec_from_file_location(
        "check_vllm_compat", REPO / "scripts" / "check_vllm_compat.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


checker = _load_checker()


@pytest.fixture(scope="module")
def installed() -> Path:
    """The installed `vllm` package directory (read, never imported here)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None, "vLLM is not installed"
    return Path(spec.origin).parent


def _shadow(tmp_path: Path, installed: Path, relative: str, edit) -> Path:
    """A `vllm` tree equal to the installed one except `relative`, rewritten by `edit`:
    symlinks everywhere, real directories only along the edited file's path."""
    root = tmp_path / "site"
    target = root / "vllm"
    source = installed
    parts = Path(relative).parts
    for depth in range(len(parts)):
        target.mkdir(parents=True, exist_ok=True)
        for entry in source.iterdir():
            if entry.name != parts[depth] and entry.name != "__pycache__":
                (target / entry.name).symlink_to(entry)
        if depth < len(parts) - 1:
            source, target = source / parts[depth], target / parts[depth]
    original = (installed / relative).read_text()
    edited = edit(original)
    assert edited != original, f"the edit did not change {relative}"
    (root / "vllm" / relative).write_text(edited)
    return root


def _rows(location, baseline=None) -> dict[str, list]:
    version, rows = checker.check(location, baseline)
    by_name: dict[str, list] = {}
    for row in rows:
        by_name.setdefault(row.name, []).append(row)
    return {"version": version, "rows": rows, "by_name": by_name}


def test_every_declaration_exists_in_the_installed_vllm(installed):
    result = _rows(installed.parent)
    held_patches, held_names, target = checker.declarations_for(result["version"])
    assert target == result["version"], "the installed vLLM is outside the supported range"
    assert len(result["rows"]) == len(held_patches) + len(held_names)
    bad = [r for r in result["rows"] if r.status != "ok"]
    assert not bad, bad
    # Wrapped functions are shown with their signature, added names as free.
    salt = result["by_name"]["vllm.v1.engine.core:EngineCore.add_request"][0]
    assert salt.detail.startswith("(self, request"), salt.detail
    added = result["by_name"]["vllm.v1.engine.core:EngineCore.art_slot_state"][0]
    assert (added.what, added.detail) == ("add", "the name is free")


def test_declarations_are_checked_against_the_versions_they_claim():
    """The V1 runner's names are checked up to 0.33 only, 0.34's reload calls from 0.34; a
    vLLM past the range is checked against what holds for the newest supported one."""
    v1_name = "VllmConfig.use_v2_model_runner"
    for version, v1 in (("0.32.0+cpu", True), ("0.33.0", True), ("0.34.0+cpu", False)):
        held_patches, held_names, target = checker.declarations_for(version)
        assert target == version
        assert any(n.qualname == v1_name for n in held_names) is v1
        assert any(n.qualname == "start_reload" for n in held_names) is not v1
        assert any(p.qualname.startswith("CPUModelRunner.") for p in held_patches) is v1
    assert checker.declarations_for("0.35.1")[2] == "0.34.0"
    total = len(patches.ALL) + len(names.ALL)
    assert sum(map(len, checker.declarations_for("0.34.0")[:2])) < total


def test_a_removed_method_is_reported_missing(tmp_path, installed):
    """Negative control: `_load_adapter` gone from the worker LoRA manager's base class."""
    site = _shadow(
        tmp_path,
        installed,
        "lora/worker_manager.py",
        lambda text: text.replace("def _load_adapter(", "def _load_adapter_renamed("),
    )
    result = _rows(site)
    bad = [r for r in result["rows"] if r.status != "ok"]
    assert [r.name for r in bad] == [
        "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager._load_adapter"
    ]
    assert bad[0].status == "MISSING" and "_load_adapter" in bad[0].detail
    assert checker.main([str(site), "--only-problems"]) == 1
    assert checker.main([str(installed.parent), "--only-problems"]) == 0


def test_a_name_vllm_now_defines_is_reported_taken(tmp_path, installed):
    site = _shadow(
        tmp_path,
        installed,
        "v1/engine/core.py",
        lambda text: text.replace(
            "class EngineCore:\n",
            "class EngineCore:\n    def art_slot_state(self):\n        ...\n",
            1,
        ),
    )
    bad = [r for r in _rows(site)["rows"] if r.status != "ok"]
    assert [(r.name, r.status) for r in bad] == [
        ("vllm.v1.engine.core:EngineCore.art_slot_state", "TAKEN")
    ]


def test_a_changed_signature_is_flagged_against_a_baseline(tmp_path, installed):
    site = _shadow(
        tmp_path,
        installed,
        "v1/engine/core.py",
        lambda text: text.replace(
            "def add_request(self, request: Request, request_wave: int = 0):",
            "def add_request(self, request: Request, request_wave: int = 0, *, priority=0):",
            1,
        ),
    )
    assert not [r for r in _rows(site)["rows"] if r.status != "ok"]  # alone: it exists
    changed = [r for r in _rows(site, installed.parent)["rows"] if r.status != "ok"]
    assert {r.name for r in changed} == {"vllm.v1.engine.core:EngineCore.add_request"}
    from art_vllm_plugin.compat import patches

    wraps = [
        p for p in patches.ALL if p.key.startswith("vllm.v1.engine.core:EngineCore.add_request@")
    ]
    assert len(wraps) >= 2  # salting, batch stamps, ... each wrap it
    assert len(changed) == len(wraps)  # one row per wrap, each flagged
    assert all(r.status == "CHANGED" and "priority" in r.detail for r in changed)


def test_a_wheel_is_read_in_place(tmp_path, installed):
    """The same rows from a `.whl` (a zip of the package) as from the unpacked tree."""
    wheel = tmp_path / "vllm-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        for path in installed.rglob("*.py"):
            archive.write(path, "vllm/" + path.relative_to(installed).as_posix())
    from_wheel = _rows(wheel)
    from_tree = _rows(installed.parent)
    assert from_wheel["version"] == from_tree["version"]
    assert [(r.name, r.status, r.detail) for r in from_wheel["rows"]] == [
        (r.name, r.status, r.detail) for r in from_tree["rows"]
    ]
