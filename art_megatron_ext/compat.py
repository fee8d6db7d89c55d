"""The one place that names Megatron-core's private (non-public-API) objects.

Why: Megatron-core moves internals between minor releases (e.g. `moe_utils.permute` returned
3 values in 0.16 and 5 in 0.19). Every module of ours that touches such a name imports it
from here, so a version bump is one file to audit, and an untested version fails at import
with a message instead of deep inside a training step.

Sections below are grouped by the feature that needs them; add a name to the section of its
feature (or a new section) rather than importing Megatron internals elsewhere.
"""

from __future__ import annotations

SUPPORTED_MEGATRON = ((0, 19), (0, 20))  # [min, max): megatron-core 0.19.x
SUPPORTED_RANGE_TEXT = "megatron-core >=0.19,<0.20"


class UnsupportedMegatronVersion(RuntimeError):
    """Raised when the installed megatron-core is outside the tested range."""


def _parse(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError) as exc:
        raise UnsupportedMegatronVersion(
            f"cannot parse megatron-core version {version!r}; art_megatron_ext supports "
            f"{SUPPORTED_RANGE_TEXT}"
        ) from exc


def check_megatron_version(version: str) -> None:
    """Refuse a megatron-core version outside the tested range, naming the range."""
    lo, hi = SUPPORTED_MEGATRON
    if not (lo <= _parse(version) < hi):
        raise UnsupportedMegatronVersion(
            f"megatron-core {version} is not supported by art_megatron_ext; "
            f"tested range is {SUPPORTED_RANGE_TEXT}. Install a supported version "
            "(`pip install 'megatron-core>=0.19,<0.20'`)."
        )


def megatron_version() -> str:
    import megatron.core

    return megatron.core.__version__


def require_megatron() -> str:
    """Import megatron.core and check its version; returns the version string."""
    version = megatron_version()
    check_megatron_version(version)
    return version
