"""A mixture-of-experts model over several data-parallel engines is refused at start, naming
the flags (art_vllm_plugin.expert_layout, issue 36 item 5): its experts span the engines,
which commit an update at their own steps, so a batch could compute with experts of two
versions under one label. Dense models over DP engines, and MoE models in one engine, serve.

The refusal is checked on vLLM's own start (`vllm serve` of the tiny Qwen3-MoE with
`--data-parallel-size 2 --enable-expert-parallel`): before it, that server started, and its
updates would have landed on each engine at that engine's next step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from support.vllm_server import TINY

from art_vllm_plugin import serve_process
from art_vllm_plugin.expert_layout import check_expert_layout, experts_across_engines

pytestmark = pytest.mark.serve


def _config(dp: int, moe: bool, ep: bool = False):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=dp, enable_expert_parallel=ep),
        model_config=SimpleNamespace(is_moe=moe, model="tiny-moe"),
    )


@pytest.mark.parametrize(("dp", "moe"), [(1, True), (2, False), (4, False)])
def test_experts_inside_one_engine_serve(dp, moe):
    assert experts_across_engines(_config(dp, moe, ep=True)) is None
    check_expert_layout(_config(dp, moe))


@pytest.mark.parametrize(
    ("ep", "how"),
    [
        (True, "--enable-expert-parallel: each engine holds some experts"),
        (False, "the experts are tensor-parallel over every engine's ranks"),
    ],
)
def test_experts_across_engines_are_refused_naming_the_flags(ep, how):
    with pytest.raises(ValueError) as refused:
        check_expert_layout(_config(2, True, ep=ep))
    message = str(refused.value)
    assert message.startswith("--data-parallel-size 2 with a mixture-of-experts model")
    assert how in message
    assert "experts of two versions under one label" in message


def test_serve_with_experts_across_engines_is_refused_before_anything_starts(server_log):
    model = TINY / "moe"
    if not (model / "config.json").exists():
        pytest.fail(f"the tiny MoE model is missing at {model}: run `make tiny`")
    config = serve_process.ServeConfig(
        model=str(model),
        args=(
            *("--dtype", "float32", "--enforce-eager", "--max-model-len", "256"),
            *("--data-parallel-size", "2", "--enable-expert-parallel"),
            "--art-allow-unauthenticated",
        ),
        log_path=server_log,
        startup_timeout_s=300,
    )
    try:
        server = serve_process.start(config)
    except serve_process.ServerStartError as refused:
        log = str(refused) + server_log.read_text(errors="replace")
    else:
        server.stop()
        pytest.fail("a MoE model over two data-parallel engines started with the plugin")
    assert "--data-parallel-size 2 with a mixture-of-experts model" in log
    assert "--enable-expert-parallel: each engine holds some experts" in log
    assert "Engine core initialization" not in log
