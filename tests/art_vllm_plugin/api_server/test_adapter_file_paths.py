"""Every file read from an adapter directory is resolved on its own and must stay inside an
allowed root (`api_server/paths.py`), not only the directory: a directory inside the root whose
files are symlinks out of it is refused, naming the file. The same refusal as a 403 from a real
server: `test_open_routes.py`."""

from __future__ import annotations

import os
import shutil

import pytest

from art_vllm_plugin.adapters import CONFIG_FILE, WEIGHTS_FILE
from art_vllm_plugin.api_server.paths import PathPolicy, PathRefused


@pytest.fixture
def tree(tmp_path, tiny_adapters):
    """`root/` (the allowed root) and `outside/`, each with a copy of tiny adapter a."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    shutil.copytree(tiny_adapters / "a", root / "plain")
    shutil.copytree(tiny_adapters / "a", outside / "a")
    policy = PathPolicy.create(roots=[str(root)], maps=[], default_roots=[])
    return root, outside, policy


def _linked(root, target_dir, name: str, into: str = "linked"):
    """A directory in the root with real files, except `name`: a symlink into `target_dir`."""
    linked = root / into
    shutil.copytree(root / "plain", linked)
    (linked / name).unlink()
    os.symlink(target_dir / name, linked / name)
    return linked


@pytest.mark.parametrize("name", [WEIGHTS_FILE, CONFIG_FILE])
def test_a_file_linked_out_of_the_root_is_refused_naming_it(tree, name):
    root, outside, policy = tree
    linked = _linked(root, outside / "a", name)
    with pytest.raises(PathRefused) as refused:
        policy.resolve(str(linked))
    message = str(refused.value)
    assert f"adapter file {linked / name} resolves to {(outside / 'a' / name).resolve()}" in message
    assert "outside every allowed root" in message and "--art-adapter-root" in message
    # What stays accepted: a link that stays inside the root (a hub-cache-like layout), and
    # a missing file (left to the reader, which reports it missing).
    (linked / name).unlink()
    os.symlink(root / "plain" / name, linked / name)
    assert policy.resolve(str(linked)) == linked.resolve()
    (linked / name).unlink()
    assert policy.resolve(str(linked)) == linked.resolve()


def test_a_committed_directory_outside_the_roots_is_trusted_for_its_own_files(tree):
    """A lease copies a committed version: its directory may lie outside the roots (a start
    adapter, a pushed copy), but its files may not lead out of it and the roots."""
    root, outside, policy = tree
    policy.check_files(outside / "a", trusted=True)
    with pytest.raises(PathRefused, match="outside every allowed root"):
        policy.check_files(outside / "a")
    elsewhere = root.parent / "elsewhere"
    shutil.copytree(outside / "a", elsewhere)
    shutil.copy(outside / "a" / CONFIG_FILE, root / "x.json")
    committed = outside / "committed"
    committed.mkdir()
    os.symlink(elsewhere / WEIGHTS_FILE, committed / WEIGHTS_FILE)
    os.symlink(root / "x.json", committed / CONFIG_FILE)  # into a root: fine
    with pytest.raises(PathRefused, match=f"adapter file {committed / WEIGHTS_FILE}"):
        policy.check_files(committed, trusted=True)
