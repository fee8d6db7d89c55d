"""LoRA on a mixture-of-experts model in the CPU build, for adapters that leave the experts out.

Why: vLLM 0.32 builds every `FusedMoE` layer with `is_lora_enabled = lora_config is not None`,
and with that flag `select_unquantized_moe_backend` picks the Triton LoRA experts, which the
CPU build does not have: `--enable-lora` on any MoE model fails at start there, even when no
adapter touches an expert. When `--lora-target-modules` leaves the experts out, vLLM never
wraps them (`LoRAModelManager` skips modules outside the targets), so the experts are plain
experts and the CPU MoE kernel serves them exactly. This module clears the flag in that case
only, and refuses what it cannot serve, each with its own message:

- `--enable-lora` on a MoE model without `--lora-target-modules`, or with targets that name
  the experts: the server does not start (the message names the flag), refused where vLLM
  turns the arguments into its config (`refuse_at_config`), before any process loads the
  model (the check where vLLM builds each MoE layer stays as the backstop);
- an adapter with expert weights (loaded at start, by `/v1/load_lora_adapter` or by a slot
  update): refused at load, so its expert deltas are never silently dropped.

Scope: installed by `install.install_worker` on the CPU platform (the art plugin is
selected); elsewhere vLLM's own LoRA experts serve.

Not even Model Runner V2 under Triton's interpreter lifts this (measured with vLLM 0.32's CPU
build, tiny Qwen3-MoE, `--enable-lora`, no plugin): the server starts with the Triton LoRA
experts, and the first forward dies in `moe_align_block_size`, a CUDA op (`_moe_C`) the CPU
build does not have; the LoRA path behind it needs `_moe_C.moe_lora_align_block_size` and the
punica wrapper's `add_lora_w13` / `add_lora_w2`, which `PunicaWrapperCPU` leaves unimplemented.
How an update writes expert LoRA on a GPU is tested on vLLM's own expert LoRA layers, built on
CPU and never run (`tests/art_vllm_plugin/worker/test_expert_adapter_update.py`).
"""

from __future__ import annotations

import functools
import re

from art_vllm_plugin import compat

#: A module name inside a MoE experts block (`model.layers.1.mlp.experts[.0.gate_proj]`).
_EXPERTS = re.compile(r"(^|\.)experts(\.|$)")


class MoeLoraRefused(ValueError):
    """LoRA on this MoE model cannot be served by the CPU build as configured."""


def experts_targeted(target_modules) -> bool:
    """Whether `--lora-target-modules` (None: every supported module) reaches the experts."""
    if target_modules is None:
        return True
    return any(_EXPERTS.search(name) for name in target_modules)


def expert_modules(names) -> list[str]:
    return [n for n in names if _EXPERTS.search(n)]


def _applies(vllm_config) -> bool:
    return (
        vllm_config is not None and vllm_config.lora_config is not None and compat.is_cpu_platform()
    )


def _refusal(targets) -> MoeLoraRefused:
    return MoeLoraRefused(
        "--enable-lora on a mixture-of-experts model in the CPU build needs "
        "--lora-target-modules that leave out the experts (the CPU build has no "
        "LoRA MoE kernel; vLLM would need Triton), e.g. --lora-target-modules "
        f"q_proj k_proj v_proj o_proj; got {targets!r}"
    )


def check_config(vllm_config) -> None:
    """Raise `MoeLoraRefused` when LoRA on this MoE model reaches the experts on CPU: the rule
    of `keep_cpu_experts`, read from the model's config instead of a built layer."""
    if not _applies(vllm_config) or not vllm_config.model_config.is_moe:
        return
    targets = vllm_config.lora_config.target_modules
    if experts_targeted(targets):
        raise _refusal(targets)


def refuse_at_config(create_engine_config):
    """Wrapper for `EngineArgs.create_engine_config`: the refusal in seconds, where vLLM
    builds its config, instead of after every worker loaded the model (minutes for a large
    MoE model)."""

    @functools.wraps(create_engine_config)
    def create_engine_config_checked(self, *args, **kwargs):
        config = create_engine_config(self, *args, **kwargs)
        check_config(config)
        return config

    return create_engine_config_checked


def keep_cpu_experts(post_init):
    """Wrapper for `FusedMoEConfig.__post_init__`: clear `is_lora_enabled` when the LoRA
    targets leave the experts out; refuse targets that reach them."""

    def moe_post_init(self) -> None:
        post_init(self)
        if not self.is_lora_enabled:
            return
        vllm_config = compat.current_vllm_config_or_none()
        if not _applies(vllm_config):
            return
        targets = vllm_config.lora_config.target_modules
        if experts_targeted(targets):
            raise _refusal(targets)
        # The experts are never wrapped by LoRA (outside the targets): serve them with
        # the CPU MoE kernel instead of the Triton LoRA experts.
        self.is_lora_enabled = False

    return moe_post_init


def refuse_expert_weights(validate):
    """Wrapper for `LoRAModelManager._validate_moe_lora_format`: an adapter with expert
    weights is refused when no expert is wrapped by LoRA (never silently dropped)."""

    def validate_format(self, lora_model) -> None:
        if compat.is_cpu_platform() and not expert_modules(compat.lora_modules(self)):
            experts = expert_modules(compat.lora_model_module_names(lora_model))
            if experts:
                raise MoeLoraRefused(
                    f"adapter (LoRA id {lora_model.id}) has weights for MoE experts "
                    f"({experts[0]}, {len(experts)} in all); this CPU server applies LoRA "
                    "to non-expert modules only (--lora-target-modules), so it refuses "
                    "the adapter instead of dropping those weights"
                )
        validate(self, lora_model)

    return validate_format
