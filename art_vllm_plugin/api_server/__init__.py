"""Code that runs in the vLLM API-server process: routes, auth, response spans, metrics."""
