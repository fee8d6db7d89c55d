"""The `vllm.endpoint_plugins` entry point: attaches the `/art/*` router to the API server.

vLLM loads endpoint plugins only when `VLLM_PLUGINS` names them, so a server started without
`--plugin art` has no `/art/*` routes at all.
"""

from __future__ import annotations

from argparse import Namespace

from art_vllm_plugin.selection import PLUGIN_NAME


class ArtEndpointPlugin:
    name = PLUGIN_NAME
    required_tasks = ("generate",)  # every /art route needs a generating engine

    def attach_router(self, app) -> None:
        from art_vllm_plugin.api_server import metrics_route
        from art_vllm_plugin.api_server.routes import router

        app.include_router(router)
        app.add_middleware(metrics_route.ArtMetricsMiddleware)  # added last: runs first

    async def init_state(self, engine_client, state, args: Namespace) -> None:
        from art_vllm_plugin.api_server.state import ArtApiState

        state.art = ArtApiState.create(engine_client=engine_client, args=args, app_state=state)
