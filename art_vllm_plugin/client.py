"""The trainer-side client under the plugin's name: `from art_vllm_plugin.client import ...`
keeps working for code written before the client moved to `art_protocol.client`, its one
home. Importing it loads neither vLLM nor torch (the plugin package's `__init__` is light)."""

from __future__ import annotations

from art_protocol.client import *  # noqa: F403 - the same public names
from art_protocol.client import __all__  # noqa: F401
