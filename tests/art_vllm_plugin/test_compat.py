"""The vLLM version gate accepts the supported range (0.32 through 0.34) and names it when
refusing; per-version declarations and the V1 runner gate follow the installed vLLM."""

import pytest

from art_vllm_plugin import compat
from art_vllm_plugin.compat import versions


@pytest.mark.parametrize(
    "ok", ["0.32.0", "0.32.0+cpu", "0.32.7", "0.32.1.post1", "0.33.0", "0.34.0+cpu", "0.34.2"]
)
def test_supported_versions_pass(ok):
    compat.check_vllm_version(ok)


@pytest.mark.parametrize("bad", ["0.31.2", "0.35.0", "0.35.0rc1", "1.0.0", "not-a-version"])
def test_unsupported_versions_name_the_range(bad):
    with pytest.raises(compat.UnsupportedVllmVersion, match=r"vllm >=0\.32\.0,<0\.35"):
        compat.check_vllm_version(bad)


def test_installed_vllm_is_supported():
    assert compat.require_supported_vllm().startswith(("0.32.", "0.33.", "0.34."))


@pytest.mark.parametrize(
    ("version", "v1"), [("0.32.0+cpu", True), ("0.33.0", True), ("0.34.0+cpu", False)]
)
def test_the_v1_runner_exists_before_0_34_only(version, v1):
    assert versions.has_v1_runner(version) is v1


@pytest.mark.parametrize(
    ("spec", "version", "inside"),
    [
        (">=0.32,<0.34", "0.33.0", True),
        (">=0.32,<0.34", "0.34.0+cpu", False),
        (">=0.34,<0.35", "0.34.0+cpu", True),
        (">=0.34,<0.35", "0.34.1rc1", True),
        (">=0.32,<0.35", "0.32.0+cpu", True),
    ],
)
def test_a_declaration_range_is_read_on_the_release(spec, version, inside):
    assert versions.in_range(spec, version) is inside


def test_a_declaration_outside_the_installed_vllm_is_refused_by_name():
    """A V1-runner name on 0.34 (or a 0.34-only name on 0.32) is never loaded half-way."""
    from art_vllm_plugin.compat import names

    other = names.USE_V2_MODEL_RUNNER if not versions.has_v1_runner() else names.START_RELOAD
    with pytest.raises(compat.NotInThisVllm, match=other.key.replace(".", r"\.")):
        compat.load(other)
