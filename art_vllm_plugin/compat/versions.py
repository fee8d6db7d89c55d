"""The vLLM version gate: the plugin refuses to activate on a vLLM outside the tested range.

Why: the plugin patches vLLM internals (see `art_vllm_plugin.compat.patches`), and those
move between minor releases. An untested vLLM fails at plugin load with a message naming the
supported range, instead of misbehaving mid-request.
"""

from __future__ import annotations

SUPPORTED_VLLM = ("0.32.0", "0.33")  # [min, max)
SUPPORTED_RANGE_TEXT = "vllm >=0.32.0,<0.33"


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
