"""The art endpoint plugin: attaches the `/art/*` router to the API server.

vLLM instantiates it through its endpoint-plugin loading (`load_endpoint_plugins`), which the
general plugin feeds only when `art` is selected (see `art_vllm_plugin.plugin_loader`), so a
server started without `--plugin art` has no `/art/*` routes and no trace of the plugin.
"""

from __future__ import annotations

from argparse import Namespace

from art_vllm_plugin.selection import PLUGIN_NAME


class ArtEndpointPlugin:
    name = PLUGIN_NAME
    required_tasks = ("generate",)  # every /art route needs a generating engine

    def attach_router(self, app) -> None:
        from art_vllm_plugin.api_server import (
            body_limits,
            control_routes,
            metrics_route,
            route_completions,
        )
        from art_vllm_plugin.api_server.routes import router
        from art_vllm_plugin.compat.api_server import control_routes as vllm_control_routes

        app.include_router(router)
        app.include_router(route_completions.router)
        # vLLM's own control routes (registered before plugins attach): the key, and no
        # weight change outside the plugin's versioning (control_routes.py).
        app.add_middleware(control_routes.ControlRouteGuard, paths=vllm_control_routes(app))
        # Bodies to /art bounded before any route parses them (--art-max-body-bytes).
        app.add_middleware(body_limits.ArtBodyLimitMiddleware)
        app.add_middleware(metrics_route.ArtMetricsMiddleware)  # added last: runs first

    async def init_state(self, engine_client, state, args: Namespace) -> None:
        """The API server's start: its state, then its hooks (`install.install_api_server`).

        The plugin is already active in this process: vLLM reaches this class only through
        the plugin handover that `plugin_loader.activate` installs."""
        from art_vllm_plugin import compat, features, install
        from art_vllm_plugin.api_server import route_completions
        from art_vllm_plugin.api_server.state import ApiServerState

        art = ApiServerState.create(engine_client=engine_client, args=args, app_state=state)
        art.attach(state)
        install.install_api_server()
        config = engine_client.vllm_config
        layout = await compat.call_engine_utility(engine_client, "art_cpu_layout")
        art.facts = features.ServerFacts(
            lora_enabled=config.lora_config is not None,
            prefix_caching=bool(config.cache_config.enable_prefix_caching),
            api_key=bool(art.api_key_digests),
            allow_unauthenticated=art.allow_unauthenticated,
            cpu_layout_cpus=tuple(layout) if layout is not None else None,
            refused_slots=tuple(sorted(art.slots.refused.items())),
            routes_capture=route_completions.capture_mode(config),
            model_runner=compat.model_runner_name(config),
        )
