"""MoE routes on the serving side: per-KV-slot capture store (`store`), route provenance
(`spans`), the `application/vnd.art.routes` response body (`envelope`) and the `--art-routes`
configuration (`config`). The worker glue is `art_vllm_plugin.worker.route_capture`; the HTTP
endpoints are `art_vllm_plugin.api_server.route_completions`."""
