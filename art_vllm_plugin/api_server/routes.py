"""The `/art/*` HTTP routes."""

from __future__ import annotations

import os

from fastapi import APIRouter

from art_vllm_plugin import compat, features, plugin_loader
from art_vllm_plugin.version import __version__

router = APIRouter(prefix="/art")


@router.get("/v1/capabilities")
async def capabilities() -> dict:
    """Plugin and vLLM versions and the plugin features this server has enabled."""
    return {
        "plugin": "art",
        "plugin_version": __version__,
        "api_server": {"pid": os.getpid(), "plugin_active": plugin_loader.is_active()},
        "vllm_version": compat.vllm_version(),
        "supported_vllm": compat.SUPPORTED_RANGE_TEXT,
        "features": features.snapshot(),
        "enabled_features": features.enabled_names(),
    }
