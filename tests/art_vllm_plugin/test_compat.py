"""The vLLM version gate accepts the tested range and names it when refusing."""

import pytest

from art_vllm_plugin import compat


@pytest.mark.parametrize("ok", ["0.32.0", "0.32.0+cpu", "0.32.7", "0.32.1.post1"])
def test_supported_versions_pass(ok):
    compat.check_vllm_version(ok)


@pytest.mark.parametrize("bad", ["0.31.2", "0.33.0", "0.33.0rc1", "1.0.0", "not-a-version"])
def test_unsupported_versions_name_the_range(bad):
    with pytest.raises(compat.UnsupportedVllmVersion, match=r"vllm >=0\.32\.0,<0\.33"):
        compat.check_vllm_version(bad)


def test_installed_vllm_is_supported():
    assert compat.require_supported_vllm().startswith("0.32.")
