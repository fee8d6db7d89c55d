"""`--enable-lora` on the tiny MoE model in the CPU build without `--lora-target-modules` that
leave out the experts is refused at start, naming the flag, before any process loads the model
(`worker/moe_lora_cpu.py`); and why: the CPU build lacks the kernels expert LoRA runs on."""

from __future__ import annotations

import pytest

from art_vllm_plugin import serve_process

pytestmark = pytest.mark.serve


def test_moe_lora_without_expert_free_targets_refuses_to_start(server_log):
    """One start, with no `--lora-target-modules` (what a user types first); which target
    lists reach the experts is `test_which_targets_reach_the_experts`. Refused where vLLM
    builds its config: no worker loads the model (it did, a minute on these hosts, when the
    refusal came from the MoE layer's construction)."""
    from support.vllm_server import TINY, tiny_paths

    tiny_paths()
    config = serve_process.ServeConfig(
        model=str(TINY / "moe"),
        args=(
            *("--dtype", "float32", "--enforce-eager", "--max-model-len", "256"),
            *("--gpu-memory-utilization", "0.2", "--enable-lora", "--max-lora-rank", "8"),
        ),
        log_path=server_log,
        startup_timeout_s=420,
    )
    with pytest.raises(serve_process.ServerStartError) as refused:
        serve_process.start(config)
    text = str(refused.value) + server_log.read_text(errors="replace")
    assert "needs --lora-target-modules that leave out the experts" in text
    assert "Loading weights took" not in text and "EngineCore" not in text, text[-2000:]


def test_which_targets_reach_the_experts():
    from art_vllm_plugin.worker.moe_lora_cpu import expert_modules, experts_targeted

    assert experts_targeted(None)  # no --lora-target-modules: every supported module
    assert experts_targeted(["q_proj", "experts"])
    assert experts_targeted(["model.layers.1.mlp.experts"])
    assert not experts_targeted(["q_proj", "k_proj", "v_proj", "o_proj"])
    assert not experts_targeted(["shared_experts_gate"])
    names = ["model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.self_attn.q_proj"]
    assert expert_modules(names) == names[:1]


def test_the_cpu_build_has_no_expert_lora_kernels():
    """Why the refusal stands, even on Model Runner V2 under Triton's interpreter (measured: a
    stock `vllm serve` of the tiny MoE with `--enable-lora` starts with the Triton LoRA
    experts, then its first forward dies on `_moe_C.moe_align_block_size`). If this fails,
    vLLM's CPU build gained a piece of expert LoRA: measure again before keeping the refusal."""
    import torch
    import vllm._custom_ops  # noqa: F401  (loads the build's ops)
    from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    assert PunicaWrapperCPU.add_lora_w13 is PunicaWrapperBase.add_lora_w13  # NotImplementedError
    assert PunicaWrapperCPU.add_lora_w2 is PunicaWrapperBase.add_lora_w2
    for op in ("moe_align_block_size", "moe_lora_align_block_size"):
        assert not hasattr(torch.ops._moe_C, op), op
