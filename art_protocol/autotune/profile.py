"""Tuner profiles: the settings and recent decisions, saved atomically at every decision.

Format (JSON, `schema_version` 1): `{"schema": "art-autotune-profile", "schema_version",
"saved_at", "step", "settings", "bounds", "decisions"}` where `bounds` are the config's
(low, high) per knob when saved and `decisions` the last few `Decision.as_dict()`s. The file is
written to a temporary sibling, fsynced and renamed over the old one, so a crash leaves the
previous profile or the new one, never a torn file. A profile is resumable by a config whose
bounds contain its settings; otherwise it is refused with a message naming the knob.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from art_protocol.autotune.config import Settings, SettingsError, TunerConfig

SCHEMA = "art-autotune-profile"
SCHEMA_VERSION = 1
KEEP_DECISIONS = 20


class ProfileError(ValueError):
    """A profile that cannot be resumed; the message says why and names the file."""


def save_profile(
    path: Path, settings: Settings, config: TunerConfig, step: int, decisions: list[dict]
) -> None:
    path = Path(path)
    payload = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "saved_at": time.time(),
        "step": step,
        "settings": settings.as_dict(),
        "bounds": {k: list(v) for k, v in config.bounds().items()},
        "decisions": decisions[-KEEP_DECISIONS:],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_profile(path: Path, config: TunerConfig) -> tuple[Settings, dict]:
    """(settings, payload) of a profile this config may resume; ProfileError otherwise."""
    path = Path(path)
    try:
        payload = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"autotune profile {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"autotune profile {path} is not valid JSON: {exc}") from None
    if not isinstance(payload, dict) or payload.get("schema") != SCHEMA:
        raise ProfileError(f"{path} is not an autotune profile (schema != {SCHEMA!r})")
    if payload.get("schema_version") != SCHEMA_VERSION:
        raise ProfileError(
            f"autotune profile {path} has schema_version {payload.get('schema_version')}, "
            f"this tuner reads {SCHEMA_VERSION}"
        )
    try:
        settings = Settings.from_dict(payload.get("settings") or {})
        config.check(settings, f"autotune profile {path}")
    except SettingsError as exc:
        raise ProfileError(f"{exc}; refusing to resume it (the current settings stay)") from None
    return settings, payload
