"""Which layouts put an MoE model's experts across data-parallel engines
(art_vllm_plugin.expert_layout, issue 36 item 5): there every update commits inside one pause
of the whole group (`api_server/expert_cut.py`, tested on a running server in
test_experts_across_engines.py); dense models over DP engines, and MoE models in one engine,
commit at each engine's own next step. Until item 5 the layouts named here were refused at
start.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from art_vllm_plugin.api_server.expert_cut import CommitWindow, window_of
from art_vllm_plugin.expert_layout import experts_across_engines

pytestmark = pytest.mark.serve


class _Client:
    """What `window_of` reads of an engine client (AsyncLLM): its config."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config


def _config(dp: int, moe: bool, ep: bool = False):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=dp, enable_expert_parallel=ep),
        model_config=SimpleNamespace(is_moe=moe, model="tiny-moe"),
    )


@pytest.mark.parametrize(("dp", "moe"), [(1, True), (2, False), (4, False)])
def test_experts_inside_one_engine_need_no_window(dp, moe):
    assert experts_across_engines(_config(dp, moe, ep=True)) is None
    assert window_of(_Client(_config(dp, moe))).why is None


@pytest.mark.parametrize(
    ("ep", "how"),
    [
        (True, "--enable-expert-parallel: each engine holds some experts"),
        (False, "the experts are tensor-parallel over every engine's ranks"),
    ],
)
def test_experts_across_engines_are_named_with_their_flags(ep, how):
    why = experts_across_engines(_config(2, True, ep=ep))
    assert why.startswith("--data-parallel-size 2 with a mixture-of-experts model")
    assert how in why
    window = window_of(_Client(_config(2, True, ep=ep)))
    assert isinstance(window, CommitWindow) and window.why == why
    assert window.figures()["required"] is True
