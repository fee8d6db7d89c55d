"""Per-app state of the art routes, kept on `app.state.art`."""

from __future__ import annotations

import time
from argparse import Namespace
from dataclasses import dataclass
from typing import Any


@dataclass
class ArtApiState:
    engine_client: Any
    args: Namespace
    started_at: float

    @classmethod
    def create(cls, engine_client: Any, args: Namespace) -> ArtApiState:
        from art_vllm_plugin import plugin_loader

        # The endpoint plugin only loads when selected; make sure the API process is active
        # even when selection came from VLLM_PLUGINS set after the general plugins loaded.
        plugin_loader.activate()
        return cls(engine_client=engine_client, args=args, started_at=time.time())
