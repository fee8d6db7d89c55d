"""The training environment imports megatron-core 0.19 and every project package."""

import importlib

import pytest


def test_megatron_core_is_019():
    import megatron.core

    assert megatron.core.__version__.startswith("0.19."), megatron.core.__version__


@pytest.mark.parametrize("name", ["art_megatron_ext", "hybridep", "art_megatron_ext.compat"])
def test_project_packages_import(name):
    assert importlib.import_module(name) is not None


def test_compat_accepts_installed_megatron():
    from art_megatron_ext import compat

    assert compat.require_megatron().startswith("0.19.")


@pytest.mark.parametrize("bad", ["0.16.1", "0.20.0", "1.0.0", "garbage"])
def test_compat_refuses_untested_megatron(bad):
    from art_megatron_ext import compat

    with pytest.raises(compat.UnsupportedMegatronVersion, match=r">=0.19,<0.20"):
        compat.check_megatron_version(bad)
