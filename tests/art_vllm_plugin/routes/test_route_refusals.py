"""`--art-routes` on a model without routed experts is refused at start, naming the reason."""

from __future__ import annotations

import pytest
from support import model_runner

from art_vllm_plugin import serve_process

pytestmark = pytest.mark.serve


def test_dense_model_with_art_routes_refuses_to_start(tiny_model, server_log):
    config = serve_process.ServeConfig(
        model=str(tiny_model),
        args=("--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "256", "--art-routes"),
        log_path=server_log,
        startup_timeout_s=180,
    )
    with pytest.raises(serve_process.ServerStartError) as refused:
        serve_process.start(config)
    capture = {
        "v2": "vLLM's routed-experts capture, Model Runner V2",
        "v1": "route capture in the CPU worker",
    }[model_runner.selected()]
    assert f"--art-routes ({capture}) needs a mixture-of-experts model" in (
        str(refused.value) + server_log.read_text(errors="replace")
    )
