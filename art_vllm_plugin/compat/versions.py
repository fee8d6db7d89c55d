"""The vLLM version gate: the plugin refuses to activate on a vLLM outside the supported range.

Why: the plugin patches vLLM internals (see `art_vllm_plugin.compat.patches`), and those
move between minor releases. An untested vLLM fails at plugin load with a message naming the
supported range, instead of misbehaving mid-request.

Supported: 0.32, 0.33 and 0.34. Where a name moved or went away between them, its declaration
in `compat/names.py` or `compat/patches.py` carries the versions it holds for (`versions`), and
`applies` tells whether a declaration holds for the installed vLLM. 0.34 removed the V1 model
runner (Model Runner V2 only): `has_v1_runner` gates what only V1 has.
"""

from __future__ import annotations

import functools

SUPPORTED_VLLM = ("0.32.0", "0.35")  # [min, max)
SUPPORTED_RANGE_TEXT = "vllm >=0.32.0,<0.35"
#: The newest supported vLLM: a newer one is checked against what holds for it.
NEWEST_SUPPORTED = "0.34.0"
#: The first vLLM without the V1 model runner (`v1/worker/gpu_model_runner.py`,
#: `v1/worker/cpu_model_runner.py`, `VllmConfig.use_v2_model_runner` are gone).
NO_V1_RUNNER_FROM = (0, 34)


class UnsupportedVllmVersion(RuntimeError):
    """Raised when the plugin is selected on a vLLM outside the tested range."""


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except InvalidVersion as exc:
        raise UnsupportedVllmVersion(
            f"cannot parse vLLM version {version!r}; the art plugin supports {SUPPORTED_RANGE_TEXT}"
        ) from exc


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM outside [SUPPORTED_VLLM); a local suffix such as '+cpu' is ignored."""
    lo, hi = (_release(v) for v in SUPPORTED_VLLM)
    if not (lo <= _release(version) < hi):
        raise UnsupportedVllmVersion(
            f"vLLM {version} is not supported by the art plugin (art-pipeline); tested range is "
            f"{SUPPORTED_RANGE_TEXT}. Install a supported vLLM, or unselect the plugin "
            "(drop `--plugin art` / remove 'art' from VLLM_PLUGINS)."
        )


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def require_supported_vllm() -> str:
    """Check the installed vLLM; returns its version string."""
    version = vllm_version()
    check_vllm_version(version)
    return version


def in_range(versions: str, version: str) -> bool:
    """Whether `version` ('0.34.0+cpu') lies in a specifier such as '>=0.32,<0.34'. Compared
    on the release only, so a local suffix or a pre-release of a listed minor counts as it."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    release = ".".join(str(part) for part in _release(version))
    return SpecifierSet(versions).contains(Version(release), prereleases=True)


@functools.cache
def is_supported() -> bool:
    """Whether the installed vLLM lies in the supported range."""
    try:
        check_vllm_version(vllm_version())
    except UnsupportedVllmVersion:
        return False
    return True


@functools.cache
def applies(versions: str) -> bool:
    """Whether a declaration for `versions` holds for the installed vLLM."""
    return in_range(versions, vllm_version())


def has_v1_runner(version: str | None = None) -> bool:
    """Whether this vLLM (the installed one by default) still has the V1 model runner."""
    return _release(version or vllm_version())[:2] < NO_V1_RUNNER_FROM
